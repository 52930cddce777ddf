import type { Logger } from '../../../guest-agent/src/log.ts';

export interface StandbyPoolOptions<T> {
  /** Standby items kept ready across all keys; 0 turns the pool off. */
  size: number;
  /** A standby not taken for this long is stopped, and its key not refilled until it is wanted again. */
  idleMs: number;
  /** How long a take waits for a fill already under way before the caller starts its own. */
  joinMs: number;
  log: Logger;
  fill(key: string): Promise<T>;
  dispose(item: T): Promise<void>;
  /** Still usable (its VM alive, its channel open)? */
  alive(item: T): boolean;
  /** May another standby start now? (Host memory: a standby is never worth a live VM's room.) */
  canFill?(): boolean;
}

interface Ready<T> {
  item: T;
  timer: NodeJS.Timeout;
}

interface Filling<T> {
  done: Promise<T | undefined>;
  /** A take that joined this fill owns its item; the pool must not keep it. */
  claimed: boolean;
}

/**
 * Items prepared ahead of demand, per key, for the keys wanted most recently: the qemu
 * backend keeps VMs here that are restored from a pristine snapshot and warmed, so a
 * wake skips the restore, the channel and the first run of the guest's code. Fills are
 * started only by `replenish()` (after a wake, never beside one) and one key at a time,
 * so the pool never competes with the wake it serves.
 */
export class StandbyPool<T> {
  private readonly ready = new Map<string, Ready<T>[]>();
  private readonly filling = new Map<string, Filling<T>>();
  /** Keys by recency of demand, most recent first, at most `size` of them. */
  private wanted: string[] = [];
  private closed = false;
  /** Disposals under way: close() waits for them, so nothing the pool started outlives it. */
  private readonly disposing = new Set<Promise<void>>();
  private fills = 0;
  private hits = 0;
  private misses = 0;

  constructor(private readonly opts: StandbyPoolOptions<T>) {}

  get enabled(): boolean {
    return this.opts.size > 0 && !this.closed;
  }

  /** Counts for /metrics and benches. */
  stats(): { ready: number; filling: number; fills: number; hits: number; misses: number } {
    let ready = 0;
    for (const l of this.ready.values()) ready += l.length;
    return { ready, filling: this.filling.size, fills: this.fills, hits: this.hits, misses: this.misses };
  }

  /**
   * A ready item for `key`, or the one being filled for it (waited for up to `joinMs`);
   * undefined when there is none: the caller starts its own. Either way the key becomes
   * the most wanted one, and the caller calls `replenish()` when its start is over.
   */
  async take(key: string): Promise<T | undefined> {
    if (!this.enabled) return undefined;
    this.want(key);
    const list = this.ready.get(key) ?? [];
    while (list.length) {
      const r = list.shift() as Ready<T>;
      clearTimeout(r.timer);
      if (this.opts.alive(r.item)) {
        this.hits++;
        return r.item;
      }
      this.opts.log.warn('standby.dead', { key });
      this.dispose(r.item);
    }
    const f = this.filling.get(key);
    if (f && !f.claimed) {
      f.claimed = true;
      let timer: NodeJS.Timeout | undefined;
      const late = new Promise<'late'>((resolve) => (timer = setTimeout(() => resolve('late'), this.opts.joinMs)));
      const got = await Promise.race([f.done, late]).finally(() => clearTimeout(timer));
      if (got !== 'late' && got !== undefined && this.opts.alive(got)) {
        this.hits++;
        return got;
      }
      // Too slow: the fill goes on and its item joins the pool when it is ready.
      if (got === 'late') void f.done.then((item) => item !== undefined && this.place(key, item));
      else if (got !== undefined) this.dispose(got);
    }
    this.misses++;
    return undefined;
  }

  /** Starts fills for wanted keys that have none (one fill per key at a time). */
  replenish(): void {
    if (!this.enabled) return;
    for (const key of this.wanted) {
      if ((this.ready.get(key)?.length ?? 0) > 0 || this.filling.has(key)) continue;
      if (this.opts.canFill && !this.opts.canFill()) {
        this.opts.log.info('standby.skipped', { key, why: 'not enough host memory for a standby VM' });
        return;
      }
      this.startFill(key);
    }
  }

  /** Stops `item` if it is still waiting to be taken (a wake needs its room); false if it is not in the pool (taken, or never placed). */
  discard(item: T, why: string): boolean {
    for (const [key, list] of this.ready) {
      const i = list.findIndex((r) => r.item === item);
      if (i < 0) continue;
      const [r] = list.splice(i, 1) as [Ready<T>];
      clearTimeout(r.timer);
      if (list.length === 0) this.ready.delete(key);
      this.dispose(item);
      this.opts.log.info('standby.stopped', { key, count: 1, why });
      return true;
    }
    return false;
  }

  /** Stops every standby (ready or being filled). */
  async close(): Promise<void> {
    this.closed = true;
    const items: T[] = [];
    for (const l of this.ready.values()) for (const r of l) {
      clearTimeout(r.timer);
      items.push(r.item);
    }
    this.ready.clear();
    const fills = [...this.filling.values()].map((f) => f.done);
    for (const i of items) this.dispose(i);
    // A fill that ends after close() disposes its own item (see place).
    await Promise.all(fills.map((p) => p.catch(() => undefined)));
    await Promise.all([...this.disposing]);
  }

  private dispose(item: T): void {
    const p: Promise<void> = this.opts
      .dispose(item)
      .catch((err: unknown) => this.opts.log.warn('standby.dispose_failed', { error: (err as Error).message }))
      .finally(() => this.disposing.delete(p));
    this.disposing.add(p);
  }

  private want(key: string): void {
    this.wanted = [key, ...this.wanted.filter((k) => k !== key)];
    const dropped = this.wanted.slice(this.opts.size);
    this.wanted = this.wanted.slice(0, this.opts.size);
    // Keys no longer among the most wanted give their standbys back.
    for (const k of dropped) this.drain(k, 'another template or size is wanted more recently');
  }

  private drain(key: string, why: string): void {
    const list = this.ready.get(key);
    if (!list?.length) return;
    this.ready.delete(key);
    for (const r of list) {
      clearTimeout(r.timer);
      this.dispose(r.item);
    }
    this.opts.log.info('standby.stopped', { key, count: list.length, why });
  }

  /** Keeps a filled item ready for `key` (or stops it: the pool closed, or the key is no longer wanted). */
  private place(key: string, item: T): void {
    if (this.closed || !this.wanted.includes(key)) {
      this.dispose(item);
      return;
    }
    const timer = setTimeout(() => {
      this.wanted = this.wanted.filter((k) => k !== key);
      this.drain(key, `not taken within ${this.opts.idleMs} ms`);
    }, this.opts.idleMs);
    timer.unref();
    const list = this.ready.get(key) ?? [];
    list.push({ item, timer });
    this.ready.set(key, list);
  }

  private startFill(key: string): void {
    this.fills++;
    const f: Filling<T> = { claimed: false, done: Promise.resolve(undefined) };
    f.done = this.opts.fill(key).then(
      (item) => {
        this.filling.delete(key);
        if (f.claimed) return item;
        this.place(key, item);
        return item;
      },
      (err: unknown) => {
        this.filling.delete(key);
        this.opts.log.warn('standby.fill_failed', { key, error: (err as Error).message });
        return undefined;
      },
    );
    this.filling.set(key, f);
  }
}
