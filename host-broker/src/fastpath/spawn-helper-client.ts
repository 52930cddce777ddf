/**
 * The broker's side of the spawn helper (spawner.ts explains why it exists). Forks the
 * helper once, hands it runs, feeds output to the caller's sinks with credit-based
 * backpressure, and restarts it if it dies (runs in flight then fail with `internal`).
 */
import { fork, type ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import { createRequire } from 'node:module';
import { fileURLToPath, pathToFileURL } from 'node:url';
import type { Logger } from '../../../guest-agent/src/log.ts';
import type { OutputSink, RunOptions, RunResult } from '../../../guest-agent/src/process/run-process.ts';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { SpawnedRun, Spawner } from './spawner.ts';
import { CREDIT_BATCH_BYTES, type FromHelper, type HelperRunOptions, type StreamName, type ToHelper } from './spawn-helper-protocol.ts';

const READY_TIMEOUT_MS = 60_000;

interface Pending {
  resolve(r: RunResult): void;
  reject(e: Error): void;
  sinks: Partial<Record<StreamName, OutputSink>>;
  /**
   * The last delivery per stream still settling. The helper sends chunks ahead of credit
   * (spawn-helper-main.ts), so a chunk can arrive while the caller's sink still holds the
   * one before: deliveries are chained, one at a time and in order, as with runProcess.
   */
  tails: Partial<Record<StreamName, Promise<void>>>;
  /** Bytes the caller has taken and the helper has not been told of yet. */
  taken: Record<StreamName, number>;
  onKill: (() => void) | undefined;
}

/** One helper process and the runs it holds; a restarted helper is a new incarnation. */
interface Incarnation {
  child: ChildProcess;
  pid: number;
  pending: Map<number, Pending>;
  exited: boolean;
}

export class HelperSpawner implements Spawner {
  readonly kind = 'helper' as const;
  readonly threadEntry = true;
  private current: Incarnation;
  private starting: Promise<Incarnation> | undefined;
  private nextId = 1;
  private closed = false;

  private constructor(
    child: ChildProcess,
    pid: number,
    private readonly log: Logger,
  ) {
    this.current = this.incarnate(child, pid);
  }

  get forkerPid(): number {
    return this.current.pid;
  }

  static async start(log: Logger): Promise<HelperSpawner> {
    const { child, pid } = await launch();
    log.info('fastpath.helper.started', { pid });
    return new HelperSpawner(child, pid, log);
  }

  run(opts: RunOptions, cgroupTasks?: string[]): SpawnedRun {
    if (this.closed) throw new HutchError('unavailable', 'fast path spawner is closed');
    if (opts.stdin !== undefined && !(opts.stdin instanceof Uint8Array)) {
      throw new HutchError('bad_request', 'the spawn helper takes stdin as bytes, not a stream');
    }
    const id = this.nextId++;
    const wire: HelperRunOptions = {
      argv: opts.argv,
      cwd: opts.cwd,
      env: opts.env,
      stdin: opts.stdin,
      extraInputs: opts.extraInputs,
      maxOutputBytes: opts.maxOutputBytes,
      timeoutMs: opts.timeoutMs,
      killGraceMs: opts.killGraceMs,
      pipeGraceMs: opts.pipeGraceMs,
      killGroupOnExit: opts.killGroupOnExit,
      uid: opts.uid,
      gid: opts.gid,
      wantStdout: opts.onStdout !== undefined,
      wantStderr: opts.onStderr !== undefined,
      cgroupTasks,
    };
    let target: Incarnation | undefined;
    const onAbort = () => {
      if (target) send(target, { t: 'cancel', id });
    };
    opts.signal?.addEventListener('abort', onAbort, { once: true });
    const result = (async () => {
      const inc = await this.live();
      target = inc;
      return new Promise<RunResult>((resolve, reject) => {
        inc.pending.set(id, { resolve, reject, sinks: { stdout: opts.onStdout, stderr: opts.onStderr }, tails: {}, taken: { stdout: 0, stderr: 0 }, onKill: opts.onKill });
        if (!send(inc, { t: 'run', id, opts: wire })) {
          inc.pending.delete(id);
          reject(new HutchError('internal', 'fast path spawn helper is not reachable', { pid: inc.pid }));
          return;
        }
        if (opts.signal?.aborted) onAbort();
      });
    })().finally(() => opts.signal?.removeEventListener('abort', onAbort));
    return { result, kill: (signal) => void (target && send(target, { t: 'kill', id, signal })) };
  }

  async close(): Promise<void> {
    this.closed = true;
    const inc = this.starting ? await this.starting.catch(() => this.current) : this.current;
    if (inc.exited) return;
    const exited = new Promise<void>((r) => inc.child.once('exit', () => r()));
    inc.child.disconnect(); // the helper kills its process groups and exits
    const timer = setTimeout(() => inc.child.kill('SIGKILL'), 2000);
    await exited;
    clearTimeout(timer);
  }

  /** The running helper, restarting it if it died (that fork happens from the broker as it is now). */
  private live(): Promise<Incarnation> {
    if (!this.current.exited) return Promise.resolve(this.current);
    if (this.closed) return Promise.reject(new HutchError('unavailable', 'fast path spawner is closed'));
    this.starting ??= launch().then(
      ({ child, pid }) => {
        this.starting = undefined;
        this.current = this.incarnate(child, pid);
        this.log.info('fastpath.helper.restarted', { pid });
        return this.current;
      },
      (err: unknown) => {
        this.starting = undefined;
        this.log.error('fastpath.helper.restart_failed', { err });
        throw err;
      },
    );
    return this.starting;
  }

  private incarnate(child: ChildProcess, pid: number): Incarnation {
    const inc: Incarnation = { child, pid, pending: new Map(), exited: false };
    child.on('message', (m: FromHelper) => this.onMessage(inc, m));
    // A send racing the helper's death reports here; the exit handler settles the runs.
    child.on('error', (err) => this.log.warn('fastpath.helper.channel_error', { pid, err }));
    child.once('exit', (code, signal) => {
      inc.exited = true;
      const err = new HutchError('internal', `fast path spawn helper exited (code ${code}, signal ${signal})`, { pid });
      for (const p of inc.pending.values()) p.reject(err);
      inc.pending.clear();
      if (this.closed) return;
      this.log.error('fastpath.helper.exited', { pid, code, signal });
      void this.live().catch(() => undefined); // restart now rather than on the next call
    });
    return inc;
  }

  private onMessage(inc: Incarnation, m: FromHelper): void {
    if (m.t === 'ready') return;
    const p = inc.pending.get(m.id);
    if (!p) return;
    switch (m.t) {
      case 'data': {
        const { stream } = m;
        const sink = p.sinks[stream];
        const chunk = Buffer.from(m.chunk.buffer, m.chunk.byteOffset, m.chunk.byteLength);
        const credit = () => {
          p.taken[stream] += chunk.length;
          if (p.taken[stream] < CREDIT_BATCH_BYTES) return;
          send(inc, { t: 'credit', id: m.id, stream, bytes: p.taken[stream] });
          p.taken[stream] = 0;
        };
        const deliver = (): Promise<void> | undefined => {
          let done: void | Promise<void>;
          try {
            done = sink?.(chunk);
          } catch {
            done = undefined; // a throwing sink must not stall the child
          }
          if (!done) {
            credit();
            return undefined;
          }
          return done.then(credit, credit);
        };
        const prev = p.tails[stream];
        const tail = prev ? prev.then(deliver) : deliver();
        if (!tail) break;
        p.tails[stream] = tail;
        void tail.then(() => {
          if (p.tails[stream] === tail) delete p.tails[stream];
        });
        break;
      }
      case 'onkill':
        p.onKill?.();
        break;
      case 'result': {
        inc.pending.delete(m.id);
        // The run is over once the caller's sinks have taken all of its output.
        const { stdout, stderr } = p.tails;
        if (!stdout && !stderr) p.resolve(m.result);
        else void Promise.all([stdout, stderr]).then(() => p.resolve(m.result));
        break;
      }
      case 'error':
        inc.pending.delete(m.id);
        p.reject(HutchError.fromWire(m.error));
        break;
    }
  }
}

function send(inc: Incarnation, m: ToHelper): boolean {
  if (inc.exited || !inc.child.connected) return false;
  try {
    inc.child.send(m);
    return true;
  } catch {
    return false; // the channel closed under us; the exit handler fails the run
  }
}

/** Forks the helper with a small, fixed set of Node flags (not the broker's own). */
async function launch(): Promise<{ child: ChildProcess; pid: number }> {
  // In the npm package the helper is compiled next to the bundled broker (dist/) and runs
  // on plain Node; from the sources it is TypeScript, loaded through tsx's ESM loader.
  const compiled = fileURLToPath(new URL('./spawn-helper-main.js', import.meta.url));
  const entry = existsSync(compiled) ? compiled : fileURLToPath(new URL('./spawn-helper-main.ts', import.meta.url));
  const loader = entry.endsWith('.ts') ? ['--import', pathToFileURL(createRequire(import.meta.url).resolve('tsx')).href] : [];
  const child = fork(entry, [], {
    execArgv: [...loader, '--max-semi-space-size=1'],
    serialization: 'advanced',
    stdio: ['ignore', 'inherit', 'inherit', 'ipc'],
    env: { PATH: process.env['PATH'] ?? '/usr/bin:/bin', HUTCH_LOG_LEVEL: process.env['HUTCH_LOG_LEVEL'] ?? 'info' },
  });
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new HutchError('unavailable', `fast path spawn helper did not start within ${READY_TIMEOUT_MS} ms`));
    }, READY_TIMEOUT_MS);
    const onExit = (code: number | null) => {
      clearTimeout(timer);
      reject(new HutchError('unavailable', `fast path spawn helper exited during start (code ${code})`));
    };
    child.once('exit', onExit);
    child.once('message', (m: FromHelper) => {
      clearTimeout(timer);
      child.off('exit', onExit);
      if (m.t === 'ready') resolve({ child, pid: m.pid });
      else reject(new HutchError('internal', `fast path spawn helper said ${m.t} before ready`));
    });
  });
}
