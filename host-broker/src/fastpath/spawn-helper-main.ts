/**
 * The spawn helper process: runs runProcess for the broker (see spawner.ts for why). It has
 * no state beyond the runs in flight, and dies with the broker: when the IPC channel
 * closes it kills every process group it started and exits.
 */
import { runProcess, type RunningProcess } from '../../../guest-agent/src/process/run-process.ts';
import { HutchError, toHutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { forkInCgroups } from './thread-cgroup.ts';
import type { FromHelper, StreamName, ToHelper } from './spawn-helper-protocol.ts';

interface Run {
  proc: RunningProcess;
  abort: AbortController;
  /**
   * Resolvers of chunks sent and not yet credited, oldest first. Usually one per stream, but
   * runProcess can call a sink again before the last call settled (Node resumes a child's
   * paused stdio when the child exits), so this is a queue: each credit settles the oldest.
   */
  credit: Record<StreamName, Array<() => void>>;
}

const runs = new Map<number, Run>();

function send(m: FromHelper): void {
  if (process.connected) process.send?.(m);
}

function start(id: number, o: Extract<ToHelper, { t: 'run' }>['opts']): void {
  const abort = new AbortController();
  const credit: Run['credit'] = { stdout: [], stderr: [] };
  const sink = (stream: StreamName) => (chunk: Buffer) =>
    new Promise<void>((resolve) => {
      credit[stream].push(resolve);
      send({ t: 'data', id, stream, chunk });
    });
  let proc: RunningProcess;
  try {
    const start = () => runProcess({
      argv: o.argv,
      cwd: o.cwd,
      env: o.env,
      uid: o.uid,
      gid: o.gid,
      stdin: o.stdin,
      extraInputs: o.extraInputs,
      maxOutputBytes: o.maxOutputBytes,
      timeoutMs: o.timeoutMs,
      killGraceMs: o.killGraceMs,
      pipeGraceMs: o.pipeGraceMs,
      killGroupOnExit: o.killGroupOnExit,
      signal: abort.signal,
      onStdout: o.wantStdout ? sink('stdout') : undefined,
      onStderr: o.wantStderr ? sink('stderr') : undefined,
      onKill: () => send({ t: 'onkill', id }),
    });
    proc = o.cgroupTasks ? forkInCgroups(o.cgroupTasks, start) : start();
  } catch (err) {
    send({ t: 'error', id, error: toHutchError(err).toWire() });
    if (err instanceof HutchError && err.code === 'internal' && o.cgroupTasks) {
      // Stuck in a tenant's cgroup: die, and let the broker start a fresh helper.
      process.stderr.write(`hutch spawn helper: ${err.message}; exiting\n`);
      process.exit(70);
    }
    return;
  }
  runs.set(id, { proc, abort, credit });
  proc.result.then(
    (result) => send({ t: 'result', id, result }),
    (err: unknown) => send({ t: 'error', id, error: toHutchError(err).toWire() }),
  ).finally(() => runs.delete(id));
}

process.on('message', (m: ToHelper) => {
  switch (m.t) {
    case 'run':
      start(m.id, m.opts);
      break;
    case 'cancel':
      runs.get(m.id)?.abort.abort();
      break;
    case 'kill':
      runs.get(m.id)?.proc.kill(m.signal);
      break;
    case 'credit':
      runs.get(m.id)?.credit[m.stream].shift()?.();
      break;
  }
});

process.on('disconnect', () => {
  for (const run of runs.values()) run.proc.kill('SIGKILL');
  process.exit(0);
});

send({ t: 'ready', pid: process.pid });
