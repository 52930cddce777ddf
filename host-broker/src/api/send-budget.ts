import { setMaxListeners } from 'node:events';
import { ByteBudget } from '../util/byte-budget.ts';

/**
 * Bytes the broker holds for clients that have not taken them yet: every frame it makes for
 * a client (answers, streamed output, events, E2B stream messages), from the moment it is
 * made until the client's socket takes it (the write's callback: the kernel holds it then,
 * and what the kernel holds per socket is bounded). A client that never read its socket made
 * the broker hold all it asked for: 35,288 `read` answers of 4 MB took 1.3 GiB in 9 s, a
 * command's output streamed to an E2B client 1.6 GiB in 25 s.
 *
 * Per connection, per principal and in all, a frame waits for room before it is written,
 * and whoever made it waits with it: a call's output is then no longer drained (its
 * credit comes back only when its frame is written), a request's answer holds its request's
 * place among the connection's unfinished ones. While its connection or principal is past
 * its bound, a connection is not read and its requests are not started (mirroring
 * ReceiveBudget). Frames of one connection are written one after the other, in the order
 * they were made; a principal's, in the order they asked for room (ByteBudget grants one
 * key's reservations in order). A connection holding bytes of which
 * none was taken for `stallMs` is closed, and what it held is given back.
 *
 * Requests already running when a connection reached its bound still answer, and their
 * answers wait (a burst of 64 `read`s of 4 MB answers 256 MB): past OVERFLOW_FACTOR times
 * its bound, a principal's connection with the most queued is closed at once (past that
 * factor of the total, the one with the most of all), so what waits stays bounded even
 * for a principal with many connections.
 */
export const OVERFLOW_FACTOR = 4;

export interface SendLimits {
  /** Bytes queued for one connection (one E2B stream) before its frames wait. */
  connectionBytes: number;
  /** Bytes queued for one principal's connections and streams together. */
  principalBytes: number;
  /** Bytes queued for all clients together. */
  totalBytes: number;
  /** A connection whose queued bytes were not taken for this long is closed. */
  stallMs: number;
}

/** What the budget asks of one connection. */
export interface SenderHooks {
  /** Stop reading (and starting) this connection's requests; `resume` starts again. */
  pause(): void;
  resume(): void;
  /**
   * Close the connection: nothing queued for it was taken for stallMs (`stalled`), or it
   * holds the most of a principal (or of all) past OVERFLOW_FACTOR times the bound.
   */
  close(why: 'stalled' | 'overflow', queuedBytes: number): void;
  /** Aborted when the connection closes: its waiting frames are dropped. */
  closed: AbortSignal;
}

export interface Sender {
  /**
   * Writes a frame of `bytes` once it fits: `write` hands it to the socket and calls `taken`
   * when the socket took it (or failed). Resolves once written; rejects if the connection
   * closed first.
   */
  send(bytes: number, write: (taken: () => void) => void): Promise<void>;
  /** Resolves once this connection and its principal are under their bounds (a request starts then). */
  room(): Promise<void>;
  /** Bytes queued for this connection: made and not yet taken by its socket. */
  readonly queued: number;
  /** The connection's bound on them. */
  readonly limit: number;
  leave(): void;
}

interface Member {
  key: string;
  principal: string;
  hooks: SenderHooks;
  /** Made and not yet taken. */
  queued: number;
  /** Written to the socket and not yet taken. */
  written: number;
  paused: boolean;
  lastTaken: number;
  stallTimer: NodeJS.Timeout | undefined;
  /** Told to close; its bytes count until it has. */
  closing: boolean;
  rooms: Array<{ resolve: () => void; reject: (e: unknown) => void }>;
  takes: Set<() => void>;
  /** The last frame's turn: the next is written after it. */
  tail: Promise<void>;
}

export class SendBudget {
  /** Per connection: keyed by each member's own key, the total never binds. */
  private readonly connections: ByteBudget;
  private readonly principals: ByteBudget;
  private readonly members = new Map<string, Set<Member>>();
  private readonly queuedBy = new Map<string, number>();
  private queuedAll = 0;
  private seq = 0;
  /** The most each principal had queued at once: for tests and operators. */
  readonly peak = new Map<string, number>();

  constructor(readonly limits: SendLimits) {
    this.connections = new ByteBudget(Number.MAX_SAFE_INTEGER, limits.connectionBytes, 'bytes queued for one connection');
    this.principals = new ByteBudget(limits.totalBytes, limits.principalBytes, 'bytes queued for clients');
  }

  /** Bytes queued for one principal's clients, or for all. */
  queuedBytes(principal?: string): number {
    return principal === undefined ? this.queuedAll : (this.queuedBy.get(principal) ?? 0);
  }

  join(principal: string, hooks: SenderHooks): Sender {
    // Each frame waiting for room listens on it: many at once is the normal case here.
    setMaxListeners(0, hooks.closed);
    const m: Member = { key: `c${++this.seq}`, principal, hooks, queued: 0, written: 0, paused: false, lastTaken: 0, stallTimer: undefined, closing: false, rooms: [], takes: new Set(), tail: Promise.resolve() };
    let group = this.members.get(principal);
    if (!group) this.members.set(principal, (group = new Set()));
    group.add(m);
    return {
      send: (bytes, write) => this.send(m, bytes, write),
      room: () => this.room(m),
      get queued() {
        return m.queued;
      },
      limit: this.limits.connectionBytes,
      leave: () => this.leave(m),
    };
  }

  private send(m: Member, bytes: number, write: (taken: () => void) => void): Promise<void> {
    if (m.hooks.closed.aborted) return Promise.reject(m.hooks.closed.reason);
    this.count(m, bytes);
    // One frame at a time per connection: written in the order they were made.
    const turn = m.tail.then(() => this.write(m, bytes, write));
    m.tail = turn.catch(() => undefined);
    return turn;
  }

  private async write(m: Member, bytes: number, write: (taken: () => void) => void): Promise<void> {
    let releaseConnection: (() => void) | undefined;
    let releasePrincipal: () => void;
    try {
      releaseConnection = await this.connections.reserve(bytes, m.key, Infinity, m.hooks.closed);
      releasePrincipal = await this.principals.reserve(bytes, m.principal, Infinity, m.hooks.closed);
    } catch (err) {
      releaseConnection?.();
      this.count(m, -bytes);
      throw err;
    }
    if (m.written === 0) m.lastTaken = Date.now(); // a stall is counted from here
    m.written += bytes;
    this.armStall(m);
    let done = false;
    const taken = () => {
      if (done) return;
      done = true;
      m.takes.delete(taken);
      m.written -= bytes;
      m.lastTaken = Date.now();
      (releaseConnection as () => void)();
      releasePrincipal();
      this.count(m, -bytes);
    };
    m.takes.add(taken);
    write(taken);
  }

  private async room(m: Member): Promise<void> {
    m.hooks.closed.throwIfAborted();
    if (this.full(m)) await new Promise<void>((resolve, reject) => m.rooms.push({ resolve, reject }));
  }

  private leave(m: Member): void {
    const group = this.members.get(m.principal);
    group?.delete(m);
    if (group?.size === 0) this.members.delete(m.principal);
    clearTimeout(m.stallTimer);
    // Its frames in the socket are gone with it; waiting ones are dropped by `closed`.
    for (const t of [...m.takes]) t();
    for (const r of m.rooms.splice(0)) r.reject(m.hooks.closed.reason ?? new Error('connection closed'));
  }

  private count(m: Member, bytes: number): void {
    m.queued += bytes;
    const mine = (this.queuedBy.get(m.principal) ?? 0) + bytes;
    if (mine > 0) this.queuedBy.set(m.principal, mine);
    else this.queuedBy.delete(m.principal);
    const wasOver = this.queuedAll >= this.limits.totalBytes;
    this.queuedAll += bytes;
    if (mine > (this.peak.get(m.principal) ?? 0)) this.peak.set(m.principal, mine);
    // Past the total every connection is held; crossing it back concerns them all.
    if (wasOver !== this.queuedAll >= this.limits.totalBytes) for (const p of [...this.members.keys()]) this.rebalance(p);
    else this.rebalance(m.principal);
    if (bytes > 0) this.overflow(m.principal, mine);
  }

  /** Closes the connection holding the most, of a principal past its overflow or of all past the total's. */
  private overflow(principal: string, mine: number): void {
    let among: Iterable<Member> | undefined;
    if (mine > OVERFLOW_FACTOR * this.limits.principalBytes) among = this.members.get(principal);
    else if (this.queuedAll > OVERFLOW_FACTOR * this.limits.totalBytes) among = [...this.members.values()].flatMap((g) => [...g]);
    let most: Member | undefined;
    for (const o of among ?? []) if (!o.closing && o.queued > (most?.queued ?? 0)) most = o;
    if (!most) return;
    most.closing = true;
    most.hooks.close('overflow', most.queued);
  }

  private full(m: Member): boolean {
    return m.queued >= this.limits.connectionBytes || (this.queuedBy.get(m.principal) ?? 0) >= this.limits.principalBytes || this.queuedAll >= this.limits.totalBytes;
  }

  private rebalance(principal: string): void {
    for (const m of this.members.get(principal) ?? []) {
      const full = this.full(m);
      if (full && !m.paused) {
        m.paused = true;
        m.hooks.pause();
      } else if (!full && m.paused) {
        m.paused = false;
        m.hooks.resume();
      }
      if (!full) for (const r of m.rooms.splice(0)) r.resolve();
    }
  }

  /** While bytes sit written and untaken, checks that the socket keeps taking them. */
  private armStall(m: Member): void {
    if (m.stallTimer) return;
    const check = () => {
      m.stallTimer = undefined;
      if (m.written === 0) return;
      const idle = Date.now() - m.lastTaken;
      if (idle >= this.limits.stallMs) {
        m.closing = true;
        m.hooks.close('stalled', m.queued);
        return;
      }
      m.stallTimer = setTimeout(check, this.limits.stallMs - idle);
      m.stallTimer.unref();
    };
    m.stallTimer = setTimeout(check, this.limits.stallMs);
    m.stallTimer.unref();
  }
}
