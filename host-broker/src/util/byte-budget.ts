import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';

/**
 * Bytes held in memory at once, across the broker and per principal: what the broker must
 * hold whole (an E2B multipart upload body, a file an in-process read or edit loads)
 * reserves its room before it is read. What does not fit waits (an upload unread, its bytes
 * left in the socket) and fails `busy` past its wait. Without it, thirty concurrent 60 MB
 * uploads took the broker's memory to 2.9 GB; a few hundred would have taken the host's.
 */
export class ByteBudget {
  private used = 0;
  private readonly byKey = new Map<string, number>();
  private readonly waiters: Array<{ bytes: number; key: string; grant: () => void }> = [];

  constructor(
    readonly totalBytes: number,
    readonly perKeyBytes: number,
    private readonly what: string,
  ) {}

  get inUse(): number {
    return this.used;
  }

  /**
   * Reserves `bytes` for `key` (a principal): at once if they fit, else when enough is
   * released, within `waitMs` (Infinity: no deadline; `signal` ends the wait too). More than
   * one key may ever hold is capped at that (a request larger than the per-key budget waits
   * for all of it). A key's reservations are granted in the order they were asked, so what a
   * caller reserves before it writes keeps its order. Returns the release.
   */
  async reserve(bytes: number, key: string, waitMs: number, signal?: AbortSignal): Promise<() => void> {
    const n = Math.min(Math.max(0, bytes), this.perKeyBytes, this.totalBytes);
    signal?.throwIfAborted();
    // Behind this principal's own earlier waiters, never beside them; another's do not hold it back.
    if (this.fits(n, key) && !this.waiters.some((w) => w.key === key)) return this.take(n, key);
    return new Promise<() => void>((resolve, reject) => {
      const leave = (err: unknown) => {
        clearTimeout(timer);
        signal?.removeEventListener('abort', onAbort);
        const i = this.waiters.indexOf(w);
        if (i >= 0) this.waiters.splice(i, 1);
        reject(err);
        this.wake(); // its place in the queue may have held others back
      };
      const onAbort = () => leave(signal?.reason);
      const w = {
        bytes: n,
        key,
        grant: () => {
          clearTimeout(timer);
          signal?.removeEventListener('abort', onAbort);
          resolve(this.take(n, key));
        },
      };
      const timer = Number.isFinite(waitMs)
        ? setTimeout(() => leave(new HutchError('busy', `${this.what}: waited ${waitMs} ms for ${n} bytes of the ${this.perKeyBytes}-byte budget per principal (${this.totalBytes} in all); retry later`, { bytes: n, key })), waitMs)
        : undefined;
      signal?.addEventListener('abort', onAbort, { once: true });
      this.waiters.push(w);
    });
  }

  private fits(n: number, key: string): boolean {
    return this.used + n <= this.totalBytes && (this.byKey.get(key) ?? 0) + n <= this.perKeyBytes;
  }

  private take(n: number, key: string): () => void {
    this.used += n;
    this.byKey.set(key, (this.byKey.get(key) ?? 0) + n);
    let done = false;
    return () => {
      if (done) return;
      done = true;
      this.used -= n;
      const left = (this.byKey.get(key) ?? n) - n;
      if (left > 0) this.byKey.set(key, left);
      else this.byKey.delete(key);
      this.wake();
    };
  }

  /**
   * Grants waiters in arrival order, each that fits (one principal's full budget does not
   * hold another's back), but none before an earlier waiter of its own key.
   */
  private wake(): void {
    const blocked = new Set<string>();
    for (let i = 0; i < this.waiters.length; ) {
      const w = this.waiters[i] as (typeof this.waiters)[number];
      if (!blocked.has(w.key) && this.fits(w.bytes, w.key)) {
        this.waiters.splice(i, 1);
        w.grant();
      } else {
        blocked.add(w.key);
        i++;
      }
    }
  }
}
