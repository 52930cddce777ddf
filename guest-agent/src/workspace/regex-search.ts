import { cpus } from 'node:os';
import { Worker } from 'node:worker_threads';
import { HutchError } from '../protocol/errors.ts';
import type { WorkBudget } from './work-budget.ts';

/**
 * grep's regular expressions run off the event loop, in a small pool of worker threads,
 * under a deadline. A tenant's pattern is JavaScript regex syntax (what opencode's grep tool
 * documents), and V8's default engine backtracks: `^(a+)+$` on a 31-character line takes
 * seconds, and each added character doubles it.
 *
 * Two layers:
 * - Linear time where V8 can: the workers turn on
 *   `--enable-experimental-regexp-engine-on-excessive-backtracks` (v8.setFlagsFromString
 *   works at runtime on the guest's Node 18 and the host's Node 20; the flag is process
 *   wide and changes no results, only which engine finishes a pathological match). A
 *   pattern runs on the fast backtracking engine and, past 50,000 backtracks, is re-run on
 *   V8's linear (NFA) engine. The linear engine alone (the `l` flag) was measured
 *   slower on ordinary patterns (50-130x on a 13 MB source-like text), so it is only the fallback.
 * - A deadline for the rest: what the linear engine cannot run (case-insensitive `i`,
 *   backreferences, lookaround, large counted repetitions) stays on the backtracking
 *   engine. Such a search runs in the worker until the call's deadline, then the worker is
 *   terminated and the call fails with a typed `timeout`. The event loop never runs a
 *   tenant's regex, so other calls are answered meanwhile either way.
 */

export interface SearchLimits {
  /** Matches the answer holds: each batch keeps at most this many (the count goes on). */
  maxMatches: number;
  /** Longer lines are cut to this many characters, then `...`. */
  maxLineChars: number;
  /** Bytes of matched lines the answer holds: each batch keeps lines while it has held fewer. */
  maxBytes: number;
}

export interface Match {
  line: number;
  text: string;
}

export interface FileMatches {
  /** Matching lines in the file. */
  count: number;
  /** Those kept: only what can be in the answer (see the worker). */
  matches: Match[];
}

/** Bytes of file content sent to the worker per message. */
const BATCH_BYTES = 4 * 1024 * 1024;
/** Files per message, however small (a directory of 200,000 empty files was one message). */
const BATCH_FILES = 4096;
const IDLE_MS = 30_000;

const WORKER_SOURCE = `
'use strict';
const { parentPort } = require('node:worker_threads');
require('node:v8').setFlagsFromString('--enable-experimental-regexp-engine-on-excessive-backtracks');
let key = null;
let re = null;
parentPort.on('message', (m) => {
  try {
    const k = m.flags + '/' + m.pattern;
    if (k !== key) { re = new RegExp(m.pattern, m.flags); key = k; }
    // The answer takes files newest first (ties in the order sent), each one's matches in
    // line order, up to maxMatches and maxBytes. A match that does not fit within its own
    // batch in that order cannot fit in the whole answer either, so only the batch's first
    // matches are kept and sent back: a batch of 4,096 files of 100 matches each sent
    // 409,600 of them for an answer of 100. Every match is still counted.
    const order = m.files.map((_, i) => i).sort((a, b) => m.mtimes[b] - m.mtimes[a] || a - b);
    const out = new Array(m.files.length);
    let kept = 0;
    let keptBytes = 0;
    for (const i of order) {
      const f = m.files[i];
      const text = Buffer.from(f.buffer, f.byteOffset, f.byteLength).toString('utf8');
      const matches = [];
      let count = 0;
      let lineNo = 0;
      let start = 0;
      while (start < text.length) {
        let end = text.indexOf('\\n', start);
        if (end === -1) end = text.length;
        const line = text.slice(start, end);
        lineNo++;
        if (re.test(line)) {
          count++;
          if (kept < m.maxMatches && keptBytes < m.maxBytes) {
            const cut = line.length > m.maxLineChars ? line.slice(0, m.maxLineChars) + '...' : line;
            matches.push({ line: lineNo, text: cut });
            kept++;
            keptBytes += Buffer.byteLength(cut);
          }
        }
        start = end + 1;
      }
      out[i] = { count, matches };
    }
    parentPort.postMessage({ ok: out });
  } catch (err) {
    parentPort.postMessage({ error: String((err && err.message) || err) });
  }
});
`;

interface PooledWorker {
  worker: Worker;
  idleTimer?: NodeJS.Timeout | undefined;
}

/** Worker threads shared by every grep of this process; at most `max` at once, idle ones exit. */
class WorkerPool {
  private readonly idle: PooledWorker[] = [];
  private readonly waiters: Array<(w: PooledWorker) => void> = [];
  private live = 0;

  constructor(private readonly max: number) {}

  acquire(): Promise<PooledWorker> {
    const w = this.idle.pop();
    if (w) {
      clearTimeout(w.idleTimer);
      w.worker.ref();
      return Promise.resolve(w);
    }
    if (this.live < this.max) return Promise.resolve(this.spawn());
    return new Promise((resolve) => this.waiters.push(resolve));
  }

  /** Hands a healthy worker back (to a waiter, or idle until it times out). */
  release(w: PooledWorker): void {
    const next = this.waiters.shift();
    if (next) return next(w);
    w.worker.unref();
    w.idleTimer = setTimeout(() => this.discard(w), IDLE_MS);
    w.idleTimer.unref();
    this.idle.push(w);
  }

  /** Kills a worker (stuck past its deadline, or broken) and makes room for a fresh one. */
  discard(w: PooledWorker): void {
    void w.worker.terminate(); // its 'exit' gives the slot back
  }

  private spawn(): PooledWorker {
    this.live++;
    const w: PooledWorker = { worker: new Worker(WORKER_SOURCE, { eval: true }) };
    // A search in flight has its own error listener; this one keeps an idle worker's
    // failure from becoming an uncaught 'error' event.
    w.worker.on('error', () => undefined);
    w.worker.once('exit', () => {
      clearTimeout(w.idleTimer);
      const i = this.idle.indexOf(w);
      if (i >= 0) this.idle.splice(i, 1);
      this.live--;
      const next = this.waiters.shift();
      if (next) next(this.spawn());
    });
    return w;
  }
}

let pool: WorkerPool | undefined;
function sharedPool(): WorkerPool {
  pool ??= new WorkerPool(Math.max(2, Math.min(4, cpus().length)));
  return pool;
}

/**
 * One grep's search: feed it file contents in order with add(), then finish(). Results come
 * back per file in the order added. Throws `timeout` once the deadline has passed.
 */
export class RegexSearch {
  private worker: PooledWorker | undefined;
  private batch: Uint8Array[] = [];
  private batchMtimes: number[] = [];
  private batchBytes = 0;
  /** Releases of the room the batch's files hold (FileToolsOptions.holdBytes): given back once the worker has them searched. */
  private batchHolds: Array<() => void> = [];
  private failed: HutchError | undefined;

  constructor(
    private readonly pattern: string,
    private readonly flags: string,
    private readonly limits: SearchLimits,
    /** The whole search's time, queueing for a worker included. */
    private readonly budget: WorkBudget,
    /** Each file's result, in the order the files were added: the search keeps none of them. */
    private readonly onFile: (r: FileMatches) => void,
  ) {
    // Syntax errors surface here, on the loop: parsing is linear, matching is what is not.
    try {
      new RegExp(pattern, flags);
    } catch (err) {
      throw new HutchError('bad_request', `invalid regular expression: ${(err as Error).message}`, { pattern });
    }
  }

  /**
   * Adds a file's content and its modification time (the answer's order); `release` (room
   * held for it) is called once it has been searched or the search ends.
   */
  async add(content: Uint8Array, mtime: number, release?: () => void): Promise<void> {
    if (release) this.batchHolds.push(release); // given back by close() if this throws
    this.checkDeadline();
    this.batch.push(content);
    this.batchMtimes.push(mtime);
    this.batchBytes += content.length;
    if (this.batchBytes >= BATCH_BYTES || this.batch.length >= BATCH_FILES) await this.flush();
  }

  /**
   * Sends the batch now if a file of `bytes` would take it past its size: called before the
   * caller waits for room for that file, so a search never waits holding more than it must.
   */
  async makeRoom(bytes: number): Promise<void> {
    if (this.batch.length > 0 && this.batchBytes + bytes > BATCH_BYTES) await this.flush();
  }

  async finish(): Promise<void> {
    try {
      await this.flush();
    } finally {
      this.close();
    }
  }

  /** Gives the worker back, and the room a batch never sent held; call on every exit path (finish does). */
  close(): void {
    if (this.worker && !this.failed) sharedPool().release(this.worker);
    this.worker = undefined;
    releaseAll(this.batchHolds.splice(0));
  }

  private async flush(): Promise<void> {
    if (this.batch.length === 0) return;
    const files = this.batch;
    const mtimes = this.batchMtimes;
    const holds = this.batchHolds;
    this.batch = [];
    this.batchMtimes = [];
    this.batchBytes = 0;
    this.batchHolds = [];
    try {
      const w = await this.acquire();
      for (const a of await this.run(w, files, mtimes)) this.onFile(a);
    } finally {
      releaseAll(holds);
    }
  }

  private async acquire(): Promise<PooledWorker> {
    if (this.worker) return this.worker;
    const p = sharedPool();
    const got = p.acquire();
    // Gave up while queued: when the worker arrives, it goes straight back to the pool.
    this.worker = await this.withDeadline(got, () => void got.then((late) => p.release(late)));
    return this.worker;
  }

  private run(w: PooledWorker, files: Uint8Array[], mtimes: number[]): Promise<FileMatches[]> {
    return this.withDeadline(
      new Promise<FileMatches[]>((resolve, reject) => {
        const onMessage = (m: { ok?: FileMatches[]; error?: string }) => {
          cleanup();
          if (m.ok) resolve(m.ok);
          else reject(new HutchError('bad_request', `regular expression failed: ${m.error}`, { pattern: this.pattern }));
        };
        const onError = (err: Error) => {
          cleanup();
          this.fail(new HutchError('internal', `grep worker failed: ${err.message}`, { pattern: this.pattern }));
          reject(this.failed);
        };
        const cleanup = () => {
          w.worker.off('message', onMessage);
          w.worker.off('error', onError);
        };
        w.worker.on('message', onMessage);
        w.worker.on('error', onError);
        w.worker.postMessage({ pattern: this.pattern, flags: this.flags, files, mtimes, maxMatches: this.limits.maxMatches, maxLineChars: this.limits.maxLineChars, maxBytes: this.limits.maxBytes });
      }),
      () => undefined,
    );
  }

  /** Races `p` against the deadline; on expiry the worker in use is terminated and `timeout` thrown. */
  private withDeadline<T>(p: Promise<T>, onExpire: () => void): Promise<T> {
    const left = this.budget.left();
    if (left <= 0) {
      onExpire();
      return Promise.reject(this.timeoutError());
    }
    return new Promise<T>((resolve, reject) => {
      const timer = setTimeout(() => {
        onExpire();
        reject(this.timeoutError());
      }, left);
      p.then(
        (v) => {
          clearTimeout(timer);
          resolve(v);
        },
        (err) => {
          clearTimeout(timer);
          reject(err);
        },
      );
    });
  }

  private timeoutError(): HutchError {
    const err = this.budget.timeout('the pattern may need exponential backtracking (case-insensitive patterns, backreferences and lookaround cannot use the linear-time engine)');
    this.fail(err);
    return err;
  }

  private fail(err: HutchError): void {
    if (this.failed) return;
    this.failed = err;
    if (this.worker) sharedPool().discard(this.worker);
    this.worker = undefined;
  }

  private checkDeadline(): void {
    if (this.failed) throw this.failed;
    if (this.budget.left() <= 0) throw this.timeoutError();
  }
}

function releaseAll(holds: Array<() => void>): void {
  for (const r of holds) r();
}
