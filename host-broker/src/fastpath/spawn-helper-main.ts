/**
 * The spawn helper process: runs runProcess for the broker (see spawner.ts for why). It has
 * no state beyond the runs in flight, and dies with the broker: when the IPC channel
 * closes it kills every process group it started and exits.
 */
import { runProcess, type RunningProcess } from '../../../guest-agent/src/process/run-process.ts';
import { HutchError, toHutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { forkInCgroups } from './thread-cgroup.ts';
import { CREDIT_WINDOW_BYTES, type FromHelper, type StreamName, type ToHelper } from './spawn-helper-protocol.ts';

interface Run {
  proc: RunningProcess;
  abort: AbortController;
  credit: Record<StreamName, Window>;
}

/** A stream's bytes sent and not yet credited by the broker, and the sinks waiting for room. */
interface Window {
  inFlight: number;
  waiting: Array<() => void>;
}

const runs = new Map<number, Run>();

function send(m: FromHelper): void {
  if (process.connected) process.send?.(m);
}

function start(id: number, o: Extract<ToHelper, { t: 'run' }>['opts']): void {
  const abort = new AbortController();
  const credit: Run['credit'] = { stdout: newWindow(), stderr: newWindow() };
  const sink = (stream: StreamName) => (chunk: Buffer): void | Promise<void> => {
    const w = credit[stream];
    w.inFlight += chunk.length;
    send({ t: 'data', id, stream, chunk });
    if (w.inFlight <= CREDIT_WINDOW_BYTES) return;
    return new Promise<void>((resolve) => w.waiting.push(resolve));
  };
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

function newWindow(): Window {
  return { inFlight: 0, waiting: [] };
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
    case 'credit': {
      const w = runs.get(m.id)?.credit[m.stream];
      if (!w) break;
      w.inFlight -= m.bytes;
      if (w.inFlight <= CREDIT_WINDOW_BYTES) for (const wake of w.waiting.splice(0)) wake();
      break;
    }
  }
});

process.on('disconnect', () => {
  for (const run of runs.values()) run.proc.kill('SIGKILL');
  process.exit(0);
});

send({ t: 'ready', pid: process.pid });
