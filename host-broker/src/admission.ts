import { HutchError } from '../../guest-agent/src/protocol/errors.ts';

type Waiter = { resolve: () => void; reject: (e: Error) => void; timer: NodeJS.Timeout | undefined };

/**
 * A counting semaphore, fair between principals: waiters queue per principal, a free slot
 * goes to the principals in turn (round robin), and each principal's own waiters in arrival
 * order. Plain FIFO let one tenant with a hundred sessions put a hundred wakes ahead of
 * everyone else's next one. Each session has at most one call in flight, so within a
 * principal this is also fair between its sessions. A principal may also hold at most
 * `perPrincipal` slots at once: past it its waiters wait while other principals' go by.
 */
export class FairSemaphore {
  private active = 0;
  /** Principal -> slots it holds. */
  private readonly held = new Map<string, number>();
  /** Principal -> its waiters; the map's order is the rotation (a served principal goes last). */
  private readonly queues = new Map<string, Waiter[]>();

  constructor(
    private readonly limit: number,
    private readonly what: string,
    private readonly perPrincipal = Infinity,
  ) {}

  get waiting(): number {
    let n = 0;
    for (const q of this.queues.values()) n += q.length;
    return n;
  }

  get inUse(): number {
    return this.active;
  }

  /** Slots one principal holds now. */
  heldBy(principal: string): number {
    return this.held.get(principal) ?? 0;
  }

  async acquire(timeoutMs?: number, principal = ''): Promise<() => void> {
    // Waiters still queued are all of principals at their own cap (pump admits the others).
    if (this.active < this.limit && this.heldBy(principal) < this.perPrincipal && !this.queues.has(principal)) {
      this.take(principal);
      return this.releaser(principal);
    }
    await new Promise<void>((resolve, reject) => {
      const w: Waiter = {
        resolve,
        reject,
        timer:
          timeoutMs === undefined
            ? undefined
            : setTimeout(() => {
                const q = this.queues.get(principal);
                const i = q ? q.indexOf(w) : -1;
                if (q && i >= 0) {
                  q.splice(i, 1);
                  if (q.length === 0) this.queues.delete(principal);
                }
                const mine = this.heldBy(principal);
                const why = mine >= this.perPrincipal ? `principal ${principal || 'default'} holds ${mine} of the ${this.perPrincipal} it may` : `${this.limit} in use`;
                reject(new HutchError('busy', `waited ${timeoutMs} ms for a free ${this.what} slot (${why}); retry later`, { what: this.what, limit: this.limit, perPrincipal: this.perPrincipal, principalHeld: mine }));
              }, timeoutMs),
      };
      const q = this.queues.get(principal);
      if (q) q.push(w);
      else this.queues.set(principal, [w]);
    });
    return this.releaser(principal);
  }

  private take(principal: string): void {
    this.active++;
    this.held.set(principal, this.heldBy(principal) + 1);
  }

  /** Gives free slots to waiters: the first principal in the rotation below its cap, which then goes to the back. */
  private pump(): void {
    while (this.active < this.limit) {
      let served = false;
      for (const [principal, q] of this.queues) {
        if (this.heldBy(principal) >= this.perPrincipal) continue;
        const w = q.shift() as Waiter;
        this.queues.delete(principal);
        if (q.length > 0) this.queues.set(principal, q);
        if (w.timer) clearTimeout(w.timer);
        this.take(principal);
        w.resolve();
        served = true;
        break;
      }
      if (!served) return;
    }
  }

  private releaser(principal: string): () => void {
    let done = false;
    return () => {
      if (done) return;
      done = true;
      this.active--;
      const left = this.heldBy(principal) - 1;
      if (left > 0) this.held.set(principal, left);
      else this.held.delete(principal);
      this.pump();
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
  /**
   * How long a VM call holds its slot (default DEFAULT_VM_CALL_SLOT_MS); past it the call runs
   * on without one. See admitVmCall.
   */
  vmCallSlotMs?: number;
  /**
   * The most one principal's VMs may reserve, MiB (default: the whole budget). A tenant
   * keeping its VMs busy (long commands, calls in a loop) otherwise held the whole budget, and
   * every other tenant's wakes waited, then failed busy.
   */
  principalMemoryMiB?: number;
  /** Fast-path runs at once, broker-wide (default DEFAULT_FASTPATH_RUNS; the broker passes its fast path's own figure). */
  maxConcurrentFastPath?: number;
  /** Fast-path runs one principal may have at once (default: all of them). */
  principalFastPath?: number;
  /** What a fast-path run counts against the memory budget while it runs, MiB: its own limit (default 512). */
  fastPathRunMiB?: number;
  /** How long a fast-path call may wait for a run slot and for memory before `busy` (default DEFAULT_FASTPATH_QUEUE_MS). */
  fastPathQueueMs?: number;
}

/** A VM call's hold on its admission slot: the push, the start of its run, a short call whole. */
export const DEFAULT_VM_CALL_SLOT_MS = 10_000;
export const DEFAULT_FASTPATH_RUNS = 4;
export const DEFAULT_FASTPATH_QUEUE_MS = 30_000;
const DEFAULT_FASTPATH_RUN_MIB = 512;

/**
 * Admission: wakes and VM calls queue fairly up to what the host can run, and one memory
 * budget bounds what live VMs and running fast-path commands hold (each VM at its size,
 * each fast-path run at its cgroup limit). Fast-path runs have slots of their own (so they
 * never wait behind a wake's slot, only for memory when the budget is spent), at most so
 * many at once and per principal (a session runs one call at a time anyway): eight
 * sessions of one tenant each holding a 400 MB `tail` took 3.2 GiB of the host, unbounded
 * by anything but the session count.
 */
export class Admission {
  readonly wakes: FairSemaphore;
  readonly vmCalls: FairSemaphore;
  readonly fastPathRuns: FairSemaphore;
  private reservedMiB = 0;
  private fastPathMiB = 0;
  /** Principal -> MiB its live VMs reserve. */
  private readonly byPrincipal = new Map<string, number>();
  private readonly memWaiters: Array<() => void> = [];
  /** Wakes inside reserveMemory: while any waits, no standby takes room (it would only be given up again). */
  private wakesWaitingForMemory = 0;
  /** Reservations that give their room up to a wake (standby VMs), oldest first. */
  private readonly yielding: Array<{ mib: number; release: () => void; yieldRoom: () => void }> = [];

  constructor(readonly opts: AdmissionOptions) {
    this.wakes = new FairSemaphore(opts.maxConcurrentWakes, 'wake');
    this.vmCalls = new FairSemaphore(opts.maxConcurrentVmCalls, 'VM call');
    this.fastPathRuns = new FairSemaphore(opts.maxConcurrentFastPath ?? DEFAULT_FASTPATH_RUNS, 'fast-path run', opts.principalFastPath ?? Infinity);
  }

  /**
   * Admits a fast-path run: a run slot (principals in turn, each to its cap), then its memory
   * from the shared budget (standby VMs give theirs up; the principal's VM share is not
   * charged: its cap on runs bounds it). Both within fastPathQueueMs, else `busy`. The
   * returned function ends the run's hold; `queuedMs` is how long it waited.
   */
  async admitFastPath(session: string, principal = ''): Promise<{ release: () => void; queuedMs: number }> {
    const t0 = performance.now();
    const timeoutMs = this.opts.fastPathQueueMs ?? DEFAULT_FASTPATH_QUEUE_MS;
    const slot = await this.fastPathRuns.acquire(timeoutMs, principal);
    try {
      const mib = this.opts.fastPathRunMiB ?? DEFAULT_FASTPATH_RUN_MIB;
      const memory = await this.reserveMemory(mib, session, principal, { timeoutMs: Math.max(0, timeoutMs - (performance.now() - t0)), fastPath: true });
      this.fastPathMiB += mib;
      let released = false;
      const release = () => {
        if (released) return;
        released = true;
        this.fastPathMiB -= mib;
        memory();
        slot();
      };
      return { release, queuedMs: performance.now() - t0 };
    } catch (err) {
      slot();
      throw err;
    }
  }

  /** Reserved by running fast-path commands, MiB. */
  get fastPathReservedMiB(): number {
    return this.fastPathMiB;
  }

  /**
   * Admits a VM call: waits for a slot (principals in turn, up to queueTimeoutMs) and holds
   * it for at most vmCallSlotMs. The slots bound how many calls push and start at once, which
   * is where a burst of calls costs the host; a call still running after that (a `sleep 600`, a long
   * build: its VM's vCPUs are the kernel scheduler's to share) gives its slot to the next
   * waiter. Held for the whole call, four slots taken by one tenant's long commands held
   * every other tenant's VM calls until they failed `busy` two minutes later.
   */
  async admitVmCall(principal?: string): Promise<() => void> {
    const done = await this.vmCalls.acquire(this.opts.queueTimeoutMs, principal);
    const t = setTimeout(done, this.opts.vmCallSlotMs ?? DEFAULT_VM_CALL_SLOT_MS);
    t.unref();
    return () => {
      clearTimeout(t);
      done();
    };
  }

  get memoryReservedMiB(): number {
    return this.reservedMiB;
  }

  /** Reserved by standby VMs, which a wake takes the room of when it needs it, MiB. */
  get yieldingMiB(): number {
    return this.yielding.reduce((n, y) => n + y.mib, 0);
  }

  /** Budget a wake can have now (standbys give theirs up), MiB. */
  get freeMiB(): number {
    return Math.max(0, this.opts.memoryBudgetMiB - this.reservedMiB + this.yieldingMiB);
  }

  /**
   * Reserves room for a VM that is worth less than any session's (a standby), if the budget
   * has it now; never waits. `yieldRoom` is called when a wake needs the room: the
   * reservation is already given back then, and the caller stops its VM. The returned
   * function gives the room back otherwise (the VM was taken by a wake, which reserved its
   * own, or stopped); undefined: no room.
   */
  reserveYielding(mib: number, yieldRoom: () => void): (() => void) | undefined {
    if (!this.roomToYield(mib)) return undefined;
    const entry = { mib, yieldRoom, release: this.hold(mib) };
    this.yielding.push(entry);
    return () => {
      const i = this.yielding.indexOf(entry);
      if (i >= 0) this.yielding.splice(i, 1);
      entry.release();
    };
  }

  /** Whether a reservation that yields (reserveYielding) would be granted now: room in the budget, and no wake waiting for room. */
  roomToYield(mib: number): boolean {
    return this.wakesWaitingForMemory === 0 && this.reservedMiB + mib <= this.opts.memoryBudgetMiB;
  }

  /**
   * Reserves memory for a VM about to wake (standbys give theirs up first), or with
   * `fastPath` for a fast-path run (not charged to the principal's VM share); the returned
   * function gives it back.
   */
  async reserveMemory(mib: number, session: string, principal = '', o: { timeoutMs?: number; fastPath?: boolean } = {}): Promise<() => void> {
    const what = o.fastPath ? 'a fast-path run' : 'its VM';
    if (mib > this.opts.memoryBudgetMiB) {
      throw new HutchError('too_large', `session ${session} asks for ${mib} MiB for ${what}, above the host memory budget of ${this.opts.memoryBudgetMiB} MiB`, { session, mib });
    }
    const cap = o.fastPath ? this.opts.memoryBudgetMiB : Math.min(this.opts.principalMemoryMiB ?? Infinity, this.opts.memoryBudgetMiB);
    if (mib > cap) throw new HutchError('too_large', `session ${session} asks for ${mib} MiB, above the ${cap} MiB one principal's VMs may hold`, { session, mib, principalMemoryMiB: cap });
    const deadline = Date.now() + (o.timeoutMs ?? this.opts.queueTimeoutMs);
    this.wakesWaitingForMemory++;
    try {
      for (;;) {
        // (A share that is the whole budget is the budget's check alone.)
        const overShare = !o.fastPath && cap < this.opts.memoryBudgetMiB && (this.byPrincipal.get(principal) ?? 0) + mib > cap;
        const overBudget = this.reservedMiB + mib > this.opts.memoryBudgetMiB;
        if (!overShare && !overBudget) break;
        // Standbys give their room up, oldest first, but only when that makes room: a wake
        // that must wait for live VMs anyway (or for its principal's own) leaves them for the
        // wakes before it.
        if (!overShare && this.reservedMiB - this.yieldingMiB + mib <= this.opts.memoryBudgetMiB) {
          const standby = this.yielding.shift() as (typeof this.yielding)[number];
          standby.release();
          standby.yieldRoom();
          continue;
        }
        const left = deadline - Date.now();
        if (left <= 0) {
          if (overShare) {
            throw new HutchError('busy', `principal ${principal || 'default'} holds ${this.byPrincipal.get(principal) ?? 0} of the ${cap} MiB its VMs may reserve; session ${session} cannot wake until one of them is released`, {
              session,
              principalReservedMiB: this.byPrincipal.get(principal) ?? 0,
              principalMemoryMiB: cap,
            });
          }
          throw new HutchError('busy', `host memory budget exhausted (${this.reservedMiB - this.yieldingMiB} of ${this.opts.memoryBudgetMiB} MiB reserved by live VMs and fast-path runs); session ${session} cannot start ${what} now`, {
            session,
            reservedMiB: this.reservedMiB,
            fastPathMiB: this.fastPathMiB,
            budgetMiB: this.opts.memoryBudgetMiB,
          });
        }
        await this.memoryFreed(left);
      }
      return this.hold(mib, o.fastPath ? undefined : principal);
    } finally {
      this.wakesWaitingForMemory--;
    }
  }

  /** Resolves when some reservation is given back, or after `ms`. */
  private memoryFreed(ms: number): Promise<void> {
    return new Promise<void>((resolve) => {
      const t = setTimeout(resolve, ms);
      this.memWaiters.push(() => {
        clearTimeout(t);
        resolve();
      });
    });
  }

  private hold(mib: number, principal?: string): () => void {
    this.reservedMiB += mib;
    if (principal !== undefined) this.byPrincipal.set(principal, (this.byPrincipal.get(principal) ?? 0) + mib);
    let released = false;
    return () => {
      if (released) return;
      released = true;
      this.reservedMiB -= mib;
      if (principal !== undefined) {
        const left = (this.byPrincipal.get(principal) ?? mib) - mib;
        if (left > 0) this.byPrincipal.set(principal, left);
        else this.byPrincipal.delete(principal);
      }
      for (const w of this.memWaiters.splice(0)) w();
    };
  }
}
