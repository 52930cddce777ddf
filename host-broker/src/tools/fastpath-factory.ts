import type { Logger } from '../../../guest-agent/src/log.ts';
import { runProcess } from '../../../guest-agent/src/process/run-process.ts';
import type { FastPathRunner } from './fastpath-runner.ts';

/**
 * TEMPORARY until host-broker/src/fastpath lands: runs the command bare on the host
 * workspace. Not a sandbox; replaced by bubblewrap + seccomp.
 */
export async function createFastPath(log: Logger): Promise<FastPathRunner> {
  log.warn('fastpath.unsandboxed', { note: 'temporary bare runner' });
  return {
    run: (req) =>
      runProcess({
        argv: ['bash', '--norc', '--noprofile', '-c', req.command],
        cwd: req.workspace,
        env: { PATH: '/usr/bin:/bin', HOME: '/tmp', LANG: 'C.UTF-8', ...req.env },
        stdin: req.stdin,
        onStdout: req.onStdout,
        onStderr: req.onStderr,
        timeoutMs: req.timeoutMs,
        maxOutputBytes: req.maxOutputBytes,
        signal: req.signal,
        killGroupOnExit: true,
      }).result,
  };
}
