import { connect } from 'node:net';
import type { ChildProcess } from 'node:child_process';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';

/** Polls until a Unix socket accepts connections (a just-started agent, QEMU's chardev). */
export async function waitForSocket(path: string, opts: { proc?: ChildProcess; timeoutMs?: number } = {}): Promise<void> {
  const timeoutMs = opts.timeoutMs ?? 15_000;
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    const p = opts.proc;
    if (p && (p.exitCode !== null || p.signalCode !== null)) {
      throw new HutchError('unavailable', `process exited (${p.exitCode ?? p.signalCode}) before ${path} accepted connections`, { path });
    }
    const ok = await new Promise<boolean>((r) => {
      const s = connect(path);
      s.once('connect', () => (s.destroy(), r(true)));
      s.once('error', () => r(false));
    });
    if (ok) return;
    await new Promise((r) => setTimeout(r, 20));
  }
  throw new HutchError('timeout', `${path} did not accept connections within ${timeoutMs} ms`, { path, timeoutMs });
}
