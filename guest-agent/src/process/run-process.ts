import { spawn, type ChildProcess, type StdioOptions } from 'node:child_process';
import { performance } from 'node:perf_hooks';
import type { Readable, Writable } from 'node:stream';
import { HutchError } from '../protocol/errors.ts';

/**
 * The one place that starts tenant processes, for the agent's exec and for the broker's
 * fast path (which runs bwrap through it). A process gets its own session and process
 * group, so a timeout or cancel kills everything it started that stayed in the group
 * (grandchildren included); output is streamed with backpressure and capped.
 */

export interface OutputSummary {
  bytes: number;
  kept: number;
  truncated: boolean;
}

export interface RunResult {
  exitCode: number | null;
  signal: string | null;
  timedOut: boolean;
  cancelled: boolean;
  durationMs: number;
  stdout: OutputSummary;
  stderr: OutputSummary;
}

export type OutputSink = (chunk: Buffer) => void | Promise<void>;

/** How long a killed group is swept (SIGKILL repeated until it is empty). */
const SWEEP_MS = 5_000;

export interface RunOptions {
  argv: string[];
  cwd: string;
  /** The complete environment; nothing is inherited. */
  env: Record<string, string>;
  uid?: number | undefined;
  gid?: number | undefined;
  stdin?: Uint8Array | AsyncIterable<Uint8Array> | undefined;
  onStdout?: OutputSink | undefined;
  onStderr?: OutputSink | undefined;
  /** Bytes of each stream passed to its sink; the rest is counted and dropped. */
  maxOutputBytes?: number | undefined;
  timeoutMs?: number | undefined;
  signal?: AbortSignal | undefined;
  /** Data for extra inherited descriptors 3, 4, ... (each a pipe the child reads, e.g. bwrap --seccomp 3). */
  extraInputs?: Uint8Array[] | undefined;
  /** Between SIGTERM and SIGKILL on timeout. */
  killGraceMs?: number | undefined;
  /** After the process exits, how long to wait for its pipes to close (a background child may hold them). */
  pipeGraceMs?: number | undefined;
  /** Extra teardown run on timeout/cancel, e.g. killing a cgroup that catches escaped descendants. */
  onKill?: (() => void) | undefined;
  /**
   * Kill what is left of the process group when the main process exits. On the host this
   * is a must (nothing of a tenant may outlive its call there); in a VM, background
   * processes such as language servers are allowed to live on between calls.
   */
  killGroupOnExit?: boolean | undefined;
}

export interface RunningProcess {
  pid: number;
  /** Sends a signal to the whole process group. */
  kill(signal: NodeJS.Signals): boolean;
  result: Promise<RunResult>;
}

export function runProcess(opts: RunOptions): RunningProcess {
  const [file, ...args] = opts.argv;
  if (!file) throw new HutchError('bad_request', 'empty argv');
  const started = performance.now();
  const extra = opts.extraInputs ?? [];
  const stdio: StdioOptions = [opts.stdin === undefined ? 'ignore' : 'pipe', 'pipe', 'pipe', ...extra.map(() => 'pipe' as const)];
  let child: ChildProcess;
  try {
    child = spawn(file, args, {
      cwd: opts.cwd,
      env: opts.env,
      stdio,
      detached: true, // setsid: own session and process group, so the group can be killed as one
      uid: opts.uid,
      gid: opts.gid,
      windowsHide: true,
    });
  } catch (err) {
    throw new HutchError('internal', `spawn ${file} failed: ${(err as Error).message}`, { argv0: file });
  }

  const pid = child.pid;
  let timedOut = false;
  let cancelled = false;
  let killTimer: NodeJS.Timeout | undefined;

  const killGroup = (sig: NodeJS.Signals): boolean => {
    if (pid === undefined) return false;
    try {
      process.kill(-pid, sig);
      return true;
    } catch {
      return false;
    }
  };
  /**
   * SIGKILLs the group until it is empty. One kill(-pgid) can miss a child forked while the
   * kernel walks the group (a fork bomb always has some), and the survivors go on forking in
   * the same group; so the kill repeats until the group is gone, for a bounded time.
   */
  let sweeping = false;
  const sweepGroup = () => {
    if (sweeping || pid === undefined) return;
    sweeping = true;
    const until = Date.now() + SWEEP_MS;
    const step = () => {
      if (!killGroup('SIGKILL') || Date.now() > until) return;
      setTimeout(step, 10).unref();
    };
    step();
  };
  const terminate = (graceful: boolean) => {
    opts.onKill?.();
    if (graceful) {
      killGroup('SIGTERM');
      killTimer = setTimeout(() => {
        sweepGroup();
        opts.onKill?.();
      }, opts.killGraceMs ?? 250);
    } else sweepGroup();
  };

  const timeout =
    opts.timeoutMs !== undefined
      ? setTimeout(() => {
          timedOut = true;
          terminate(true);
        }, opts.timeoutMs)
      : undefined;
  const onAbort = () => {
    cancelled = true;
    terminate(false);
  };
  if (opts.signal?.aborted) onAbort();
  else opts.signal?.addEventListener('abort', onAbort, { once: true });

  const cap = opts.maxOutputBytes ?? Number.MAX_SAFE_INTEGER;
  const out = pump(child.stdout as Readable, cap, opts.onStdout);
  const err = pump(child.stderr as Readable, cap, opts.onStderr);
  if (opts.stdin !== undefined) feed(child.stdin as Writable, opts.stdin);
  extra.forEach((data, i) => feed(child.stdio[3 + i] as Writable, data));

  const result = new Promise<RunResult>((resolve, reject) => {
    child.once('error', (e: NodeJS.ErrnoException) => {
      cleanup();
      if (e.code === 'ENOENT' || e.code === 'EACCES') reject(new HutchError(e.code === 'ENOENT' ? 'not_found' : 'permission_denied', `cannot execute ${file}: ${e.code}`, { argv0: file }));
      else reject(new HutchError('internal', `process error: ${e.message}`, { argv0: file }));
    });
    child.once('exit', (code, signal) => {
      if (opts.killGroupOnExit || timedOut || cancelled) {
        sweepGroup();
        opts.onKill?.();
      }
      // The main process is gone; give its pipes a moment to drain, then stop waiting for
      // descendants that inherited them (a backgrounded server must not hang the call).
      const grace = setTimeout(() => {
        out.abandon();
        err.abandon();
      }, opts.pipeGraceMs ?? 200);
      void Promise.all([out.done, err.done]).then(() => {
        clearTimeout(grace);
        cleanup();
        resolve({
          exitCode: code,
          signal,
          timedOut,
          cancelled,
          durationMs: performance.now() - started,
          stdout: out.summary(),
          stderr: err.summary(),
        });
      });
    });
  });
  function cleanup() {
    if (timeout) clearTimeout(timeout);
    if (killTimer) clearTimeout(killTimer);
    opts.signal?.removeEventListener('abort', onAbort);
  }

  return { pid: pid ?? -1, kill: killGroup, result };
}

interface Pump {
  done: Promise<void>;
  abandon(): void;
  summary(): OutputSummary;
}

function pump(stream: Readable, cap: number, sink: OutputSink | undefined): Pump {
  let bytes = 0;
  let kept = 0;
  // Async iteration pulls one chunk at a time, so a slow sink holds the pipe (and with it
  // the child) back. A 'data' listener with pause() would not do: Node resumes a child's
  // streams when it exits, and the sink would see overlapping calls.
  const done = (async () => {
    try {
      for await (const chunk of stream as AsyncIterable<Buffer>) {
        bytes += chunk.length;
        if (kept >= cap || !sink) continue;
        const piece = kept + chunk.length > cap ? chunk.subarray(0, cap - kept) : chunk;
        kept += piece.length;
        await sink(piece);
      }
    } catch {
      // abandoned (destroyed) or a sink that failed: the result still reports what was seen
    }
  })();
  return {
    done,
    abandon: () => stream.destroy(),
    summary: () => ({ bytes, kept, truncated: bytes > kept }),
  };
}

function feed(w: Writable, data: Uint8Array | AsyncIterable<Uint8Array>): void {
  w.on('error', () => undefined); // EPIPE when the child does not read its input: not our failure
  if (data instanceof Uint8Array) {
    w.end(data);
    return;
  }
  void (async () => {
    try {
      for await (const chunk of data) {
        if (w.destroyed) break;
        if (!w.write(chunk)) await new Promise<void>((r) => w.once('drain', r).once('close', r));
      }
    } catch {
      // the input stream failed (peer gone): close the child's stdin all the same
    }
    w.end();
  })();
}
