/**
 * Bytes one principal's WebSocket traffic holds in the broker. ws buffers a message whole
 * before the broker sees it (up to the frame limit, 64 MiB), and a request's message stays
 * held until it is answered (a queued `write` holds its content): with 32 connections and 64
 * requests in flight on each, one token could make the broker hold gigabytes.
 *
 * Two bounds, per principal:
 *  - messages still arriving: past the share, a connection receiving more is paused (its
 *    sender waits on TCP) as long as another of the principal's connections is mid-message
 *    and reading, so one always finishes and nothing deadlocks; all resume once under;
 *  - requests received and not yet answered: past the share a request of more than
 *    SMALL_MESSAGE_BYTES is answered `busy` at once and dropped (a request never waits
 *    here: waiting would hold its bytes). Small ones (signals, most calls) always pass,
 *    and so does a principal's first large one (whatever the share).
 * A principal's messages hold at most about twice its share plus one message (its requests
 * up to the share, messages arriving up to it, one of them finishing past it). Principals
 * never wait on each other: a pause only ever waits for the same principal.
 */
export const SMALL_MESSAGE_BYTES = 64 * 1024;

/** One connection as the budget drives it. */
export interface Receiver {
  /** Bytes of the message now arriving (read since the last complete message). */
  pending(): number;
  pause(): void;
  resume(): void;
}

interface Member {
  r: Receiver;
  paused: boolean;
}

export class ReceiveBudget {
  private readonly members = new Map<string, Set<Member>>();
  private readonly held = new Map<string, number>();
  /** Requests above SMALL_MESSAGE_BYTES each principal holds. */
  private readonly large = new Map<string, number>();
  private heldAll = 0;
  /** The most each principal's messages held at once (seen when data arrived): for tests and operators. */
  readonly peak = new Map<string, number>();

  constructor(
    /** Bytes of one principal's messages arriving plus requests held. */
    readonly principalBytes: number,
    /** Bytes of requests held across all principals. */
    readonly totalBytes: number,
  ) {}

  /** Requests held by one principal, or by all. */
  heldBytes(principal?: string): number {
    return principal === undefined ? this.heldAll : (this.held.get(principal) ?? 0);
  }

  /** A principal's connection: call the returned hooks on data, on each complete message, and on close. */
  join(principal: string, r: Receiver): { onData(): void; onMessage(): void; leave(): void } {
    const m: Member = { r, paused: false };
    let group = this.members.get(principal);
    if (!group) this.members.set(principal, (group = new Set()));
    group.add(m);
    return {
      onData: () => {
        const used = this.used(principal);
        if (used > (this.peak.get(principal) ?? 0)) this.peak.set(principal, used);
        if (m.paused || used <= this.principalBytes) return;
        // Another of this principal's messages is arriving and will finish: wait for it.
        for (const o of group) {
          if (o !== m && !o.paused && o.r.pending() > 0) {
            m.paused = true;
            m.r.pause();
            return;
          }
        }
      },
      onMessage: () => this.rebalance(principal),
      leave: () => {
        group.delete(m);
        if (group.size === 0 && this.members.get(principal) === group) this.members.delete(principal);
        else this.rebalance(principal);
      },
    };
  }

  /**
   * Holds `bytes` of a received request for `principal` until the returned release, or
   * answers undefined when that would pass its share or the total (small ones always pass).
   */
  admit(principal: string, bytes: number): (() => void) | undefined {
    const mine = this.held.get(principal) ?? 0;
    const large = bytes > SMALL_MESSAGE_BYTES;
    // One large request of a principal is always taken (a share set below the frame limit
    // must bound, not refuse for ever, a request that could never fit beside others).
    const largeHeld = this.large.get(principal) ?? 0;
    if (large && largeHeld > 0 && (mine + bytes > this.principalBytes || this.heldAll + bytes > this.totalBytes)) return undefined;
    this.held.set(principal, mine + bytes);
    this.heldAll += bytes;
    if (large) this.large.set(principal, largeHeld + 1);
    let done = false;
    return () => {
      if (done) return;
      done = true;
      if (large) {
        const n = (this.large.get(principal) ?? 1) - 1;
        if (n > 0) this.large.set(principal, n);
        else this.large.delete(principal);
      }
      const left = (this.held.get(principal) ?? bytes) - bytes;
      if (left > 0) this.held.set(principal, left);
      else this.held.delete(principal);
      this.heldAll -= bytes;
      this.rebalance(principal);
    };
  }

  private used(principal: string): number {
    let n = this.held.get(principal) ?? 0;
    for (const m of this.members.get(principal) ?? []) n += m.r.pending();
    return n;
  }

  /** Under the share: everyone reads. Over it: at least one paused message keeps arriving. */
  private rebalance(principal: string): void {
    const group = this.members.get(principal);
    if (!group) return;
    const paused = [...group].filter((m) => m.paused);
    if (paused.length === 0) return;
    if (this.used(principal) <= this.principalBytes) {
      for (const m of paused) {
        m.paused = false;
        m.r.resume();
      }
      return;
    }
    if ([...group].some((m) => !m.paused && m.r.pending() > 0)) return;
    // Nobody is finishing a message: let the one furthest along go on.
    const next = paused.reduce((a, b) => (b.r.pending() > a.r.pending() ? b : a));
    next.paused = false;
    next.r.resume();
  }
}
