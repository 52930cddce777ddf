/**
 * How much of the event loop one peer may take with what it sends. Every frame a peer
 * sends is decoded and dispatched on the loop every other session shares, and what a
 * frame costs is the sender's choice: one 1 MiB frame of empty msgpack maps takes about
 * 200 ms to decode, and an answer to no pending request is dropped without counting as a
 * protocol error (it may be a late answer to a cancelled call). A broker reading a guest
 * agent that is no longer ours (a tenant who got root in the guest) would spend its whole
 * loop on that one guest.
 *
 * A token bucket of loop time: a peer starts with `burstMs`, earns `share` ms for every
 * ms of wall time (up to `burstMs`), and pays what reading its input took. In debt, its
 * reading stops until the debt is earned back, which pushes back on the sender through
 * the transport (a paused socket fills, and QEMU stops taking the guest's writes).
 * The cost is measured, not guessed from sizes, so it covers whatever makes a frame slow.
 */
export interface LoopShareOptions {
  /** Fraction of wall time the peer's input may take, (0, 1]. */
  share: number;
  /** Loop time the peer may take at once before pacing starts (ms). */
  burstMs: number;
  /** Clock in ms (tests pass their own). */
  now?: () => number;
}

/**
 * Broker reading a guest: a fifth of the loop, a quarter second at once. A well-behaved
 * agent's frames are small or carry bytes (decoded as views, not copies); its largest
 * answers (100,000 listed paths) decode in tens of ms, inside the burst.
 */
export const GUEST_LOOP_SHARE: LoopShareOptions = { share: 0.2, burstMs: 250 };

export class LoopShare {
  private tokens: number;
  private last: number;
  private readonly share: number;
  private readonly burstMs: number;
  private readonly now: () => number;
  /** Times the peer ran into debt, and the total ms its reading was stopped for. */
  paused = 0;
  pausedMs = 0;
  /** Loop time charged in all, and the largest single charge (ms). */
  chargedMs = 0;
  maxChargeMs = 0;

  constructor(opts: LoopShareOptions) {
    if (!(opts.share > 0 && opts.share <= 1)) throw new RangeError(`loop share must be in (0, 1], got ${opts.share}`);
    if (!(opts.burstMs >= 0)) throw new RangeError(`loop burst must be >= 0 ms, got ${opts.burstMs}`);
    this.share = opts.share;
    this.burstMs = opts.burstMs;
    this.now = opts.now ?? (() => performance.now());
    this.tokens = opts.burstMs;
    this.last = this.now();
  }

  /** Charges `ms` of loop time spent on the peer's input; returns how long to stop reading it (0: go on). */
  charge(ms: number): number {
    const t = this.now();
    this.chargedMs += ms;
    if (ms > this.maxChargeMs) this.maxChargeMs = ms;
    this.tokens = Math.min(this.burstMs, this.tokens + (t - this.last) * this.share) - ms;
    this.last = t;
    if (this.tokens >= 0) return 0;
    const wait = -this.tokens / this.share;
    this.paused++;
    this.pausedMs += wait;
    return wait;
  }
}
