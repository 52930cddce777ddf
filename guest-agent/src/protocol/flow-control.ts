import { HutchError, type WireError } from './errors.ts';

/**
 * Per-stream credit-based flow control. A receiver announces a window (bytes it will
 * buffer per stream); a sender may have at most that many bytes outstanding that the
 * receiver has not credited back. The receiver credits bytes when its consumer takes
 * them off the queue, so a slow consumer stalls exactly one stream, and memory on the
 * receiving side is bounded by window x open streams no matter how much is sent.
 */

/** What a stream needs from its connection. */
export interface StreamTransport {
  send(msg: Record<string, unknown>): void;
  sendData(stream: number, payload: Uint8Array): void;
  /** Resolves once the underlying socket has room again (socket-level backpressure). */
  drained(): Promise<void>;
  /** Called when a stream is finished in both directions so the connection can forget it. */
  release(id: number): void;
}

export class InboundStream implements AsyncIterable<Uint8Array> {
  private queue: Uint8Array[] = [];
  private queued = 0;
  /** Bytes the consumer took that have not been credited back yet. */
  private uncredited = 0;
  private done = false;
  private failure: HutchError | undefined;
  private stopped = false;
  private waiter: { resolve: (c: Uint8Array | null) => void; reject: (e: unknown) => void } | undefined;
  /** High-water mark of buffered bytes, kept so tests can assert the memory bound. */
  maxBuffered = 0;
  received = 0;

  constructor(
    readonly id: number,
    readonly window: number,
    private readonly transport: StreamTransport,
  ) {}

  get bufferedBytes(): number {
    return this.queued;
  }

  get ended(): boolean {
    return this.done;
  }

  /** Connection -> stream: a data frame arrived. Returns an error if the sender broke the window. */
  push(chunk: Uint8Array): HutchError | undefined {
    if (this.done || this.stopped) return undefined; // late data after stop/end: drop
    if (this.queued + this.uncredited + chunk.length > this.window) {
      const err = new HutchError('flow_control', `stream ${this.id}: peer sent beyond its credit window`, {
        stream: this.id,
        window: this.window,
        outstanding: this.queued + this.uncredited + chunk.length,
      });
      this.fail(err);
      this.transport.send({ t: 'stop', s: this.id });
      return err;
    }
    this.received += chunk.length;
    if (this.waiter) {
      const w = this.waiter;
      this.waiter = undefined;
      this.consumed(chunk.length);
      w.resolve(chunk);
      return undefined;
    }
    this.queue.push(chunk);
    this.queued += chunk.length;
    if (this.queued > this.maxBuffered) this.maxBuffered = this.queued;
    return undefined;
  }

  /** Connection -> stream: the sender finished (with an error if it aborted). */
  end(err?: WireError): void {
    if (this.done) return;
    if (err) {
      this.fail(HutchError.fromWire(err));
      return;
    }
    this.done = true;
    if (this.waiter && this.queue.length === 0) {
      const w = this.waiter;
      this.waiter = undefined;
      w.resolve(null);
    }
    if (this.queue.length === 0) this.transport.release(this.id);
  }

  fail(err: HutchError): void {
    if (this.done && !this.failure && this.queue.length === 0) return;
    this.done = true;
    this.failure = err;
    this.queue = [];
    this.queued = 0;
    if (this.waiter) {
      const w = this.waiter;
      this.waiter = undefined;
      w.reject(err);
    }
    this.transport.release(this.id);
  }

  /** Next chunk, or null at the end of the stream. */
  read(): Promise<Uint8Array | null> {
    const chunk = this.queue.shift();
    if (chunk) {
      this.queued -= chunk.length;
      this.consumed(chunk.length);
      if (this.done && this.queue.length === 0 && !this.failure) this.transport.release(this.id);
      return Promise.resolve(chunk);
    }
    if (this.failure) return Promise.reject(this.failure);
    if (this.done) return Promise.resolve(null);
    if (this.waiter) return Promise.reject(new HutchError('internal', `stream ${this.id} has two concurrent readers`));
    return new Promise((resolve, reject) => {
      this.waiter = { resolve, reject };
    });
  }

  /** Tells the sender we want no more data; anything still arriving is dropped. */
  stop(): void {
    if (this.stopped) return;
    this.stopped = true;
    const wasDone = this.done;
    this.queue = [];
    this.queued = 0;
    this.done = true;
    if (this.waiter) {
      const w = this.waiter;
      this.waiter = undefined;
      w.resolve(null);
    }
    if (!wasDone) this.transport.send({ t: 'stop', s: this.id });
    this.transport.release(this.id);
  }

  /** Reads everything into one buffer, refusing more than maxBytes. */
  async readAll(maxBytes = Number.MAX_SAFE_INTEGER): Promise<Buffer> {
    const parts: Uint8Array[] = [];
    let total = 0;
    for await (const c of this) {
      total += c.length;
      if (total > maxBytes) {
        this.stop();
        throw new HutchError('too_large', `stream ${this.id} carried more than ${maxBytes} bytes`, { limit: maxBytes });
      }
      parts.push(c);
    }
    return Buffer.concat(parts, total);
  }

  async *[Symbol.asyncIterator](): AsyncIterator<Uint8Array> {
    for (;;) {
      const c = await this.read();
      if (c === null) return;
      yield c;
    }
  }

  private consumed(n: number): void {
    this.uncredited += n;
    // Crediting in quarter-window batches keeps credit frames rare while the sender,
    // which still holds >= 3/4 of the window, never stalls on a fast consumer.
    if (this.uncredited >= this.window / 4 && !this.done) {
      this.transport.send({ t: 'credit', s: this.id, n: this.uncredited });
      this.uncredited = 0;
    }
  }
}

export class OutboundStream {
  private credit: number;
  private creditWaiter: (() => void) | undefined;
  private tail: Promise<void> = Promise.resolve();
  private finished = false;
  private failure: HutchError | undefined;
  /** The receiver asked for no more data (e.g. it closed the stdin it was feeding). */
  stoppedByPeer = false;
  sent = 0;
  private openGate: (() => void) | undefined;

  constructor(
    readonly id: number,
    peerWindow: number,
    private readonly maxChunk: number,
    private readonly transport: StreamTransport,
  ) {
    this.credit = peerWindow;
  }

  /**
   * Holds writes until release(): a requester's stream must not carry data before the
   * request that declares it has been sent, or the peer would see an unknown stream.
   */
  hold(): void {
    this.tail = new Promise<void>((resolve) => {
      this.openGate = resolve;
    });
  }

  release(): void {
    const g = this.openGate;
    this.openGate = undefined;
    g?.();
  }

  get ended(): boolean {
    return this.finished;
  }

  /**
   * Sends bytes, waiting for credit and socket room as needed. Writes are ordered.
   * After the peer stopped the stream, writes resolve at once and the bytes are dropped,
   * so a producer (a child's stdout) can keep draining without special cases.
   */
  write(chunk: Uint8Array): Promise<void> {
    if (this.finished && !this.failure) return Promise.reject(new HutchError('internal', `write after end on stream ${this.id}`));
    const p = this.tail.then(() => this.writeNow(chunk));
    this.tail = p.catch(() => undefined);
    return p;
  }

  end(err?: HutchError): void {
    if (this.finished) return;
    this.finished = true;
    // Queue behind pending writes so `end` never overtakes data.
    this.tail = this.tail.then(() => {
      if (this.failure) return;
      if (!this.stoppedByPeer) this.transport.send(err ? { t: 'end', s: this.id, e: err.toWire() } : { t: 'end', s: this.id });
      this.transport.release(this.id);
    });
  }

  /** Resolves when everything written so far has been handed to the socket. */
  flushed(): Promise<void> {
    return this.tail;
  }

  addCredit(n: number): void {
    this.credit += n;
    const w = this.creditWaiter;
    this.creditWaiter = undefined;
    w?.();
  }

  peerStopped(): void {
    this.stoppedByPeer = true;
    this.addCredit(0);
  }

  fail(err: HutchError): void {
    this.failure ??= err;
    this.finished = true;
    this.addCredit(0);
  }

  private async writeNow(chunk: Uint8Array): Promise<void> {
    let off = 0;
    while (off < chunk.length) {
      if (this.failure) throw this.failure;
      if (this.stoppedByPeer) return;
      if (this.credit <= 0) {
        await new Promise<void>((resolve) => {
          this.creditWaiter = resolve;
        });
        continue;
      }
      const n = Math.min(chunk.length - off, this.credit, this.maxChunk);
      const piece = off === 0 && n === chunk.length ? chunk : chunk.subarray(off, off + n);
      this.credit -= n;
      this.sent += n;
      off += n;
      this.transport.sendData(this.id, piece);
      await this.transport.drained();
    }
  }
}
