import { HutchError } from '../../guest-agent/src/protocol/errors.ts';

/**
 * A FIFO counting semaphore: tasks run in arrival order once a slot is free. Each session
 * has at most one call in flight, so FIFO is also fair between sessions.
 */
export class FifoSemaphore {
  private active = 0;
  private readonly waiters: Array<{ resolve: () => void; reject: (e: Error) => void; timer: NodeJS.Timeout | undefined }> = [];

  constructor(
    private readonly limit: number,
    private readonly what: string,
  ) {}

  get waiting(): number {
    return this.waiters.length;
  }

  get inUse(): number {
    return this.active;
  }

  async acquire(timeoutMs?: number): Promise<() => void> {
    if (this.active < this.limit && this.waiters.length === 0) {
      this.active++;
      return this.releaser();
    }
    await new Promise<void>((resolve, reject) => {
      const w = {
        resolve,
        reject,
        timer:
          timeoutMs === undefined
            ? undefined
            : setTimeout(() => {
                const i = this.waiters.indexOf(w);
                if (i >= 0) this.waiters.splice(i, 1);
                reject(new HutchError('busy', `waited ${timeoutMs} ms for a free ${this.what} slot (${this.limit} in use); retry later`, { what: this.what, limit: this.limit }));
              }, timeoutMs),
      };
      this.waiters.push(w);
    });
    return this.releaser();
  }

  private releaser(): () => void {
    let done = false;
    return () => {
      if (done) return;
      done = true;
      const next = this.waiters.shift();
      if (next) {
        if (next.timer) clearTimeout(next.timer);
        next.resolve(); // the slot passes straight to the next waiter
      } else this.active--;
    };
  }
}

export interface AdmissionOptions {
  /** Restores running at once (each is CPU-heavy under TCG). */
  maxConcurrentWakes: number;
  /** VM calls running at once across sessions. */
  maxConcurrentVmCalls: number;
  /** Host memory the live VMs may use, MiB; a wake past it waits, then fails with busy. */
  memoryBudgetMiB: number;
  /** How long a wake or call may wait before `busy`. */
  queueTimeoutMs: number;
}

/**
 * Admission for the expensive route: wakes and VM calls queue fairly up to what the
 * host can run, and a memory budget bounds live VMs. File tools and the fast path never
 * pass through here, so they never wait behind a wake.
 */
export class Admission {
  readonly wakes: FifoSemaphore;
  readonly vmCalls: FifoSemaphore;
  private reservedMiB = 0;
  private readonly memWaiters: Array<() => void> = [];

  constructor(readonly opts: AdmissionOptions) {
    this.wakes = new FifoSemaphore(opts.maxConcurrentWakes, 'wake');
    this.vmCalls = new FifoSemaphore(opts.maxConcurrentVmCalls, 'VM call');
  }

  get memoryReservedMiB(): number {
    return this.reservedMiB;
  }

  /** Reserves memory for a VM about to wake; the returned function gives it back. */
  /** Budget not yet reserved by live VMs, MiB. */
  get freeMiB(): number {
    return Math.max(0, this.opts.memoryBudgetMiB - this.reservedMiB);
  }

  async reserveMemory(mib: number, session: string): Promise<() => void> {
    if (mib > this.opts.memoryBudgetMiB) {
      throw new HutchError('too_large', `session ${session} asks for ${mib} MiB, above the host memory budget of ${this.opts.memoryBudgetMiB} MiB`, { session, mib });
    }
    const deadline = Date.now() + this.opts.queueTimeoutMs;
    while (this.reservedMiB + mib > this.opts.memoryBudgetMiB) {
      const left = deadline - Date.now();
      if (left <= 0) {
        throw new HutchError('busy', `host memory budget exhausted (${this.reservedMiB} of ${this.opts.memoryBudgetMiB} MiB reserved by live VMs); session ${session} cannot wake now`, {
          session,
          reservedMiB: this.reservedMiB,
          budgetMiB: this.opts.memoryBudgetMiB,
        });
      }
      await new Promise<void>((resolve) => {
        const t = setTimeout(resolve, left);
        this.memWaiters.push(() => {
          clearTimeout(t);
          resolve();
        });
      });
    }
    this.reservedMiB += mib;
    let released = false;
    return () => {
      if (released) return;
      released = true;
      this.reservedMiB -= mib;
      for (const w of this.memWaiters.splice(0)) w();
    };
  }
}
