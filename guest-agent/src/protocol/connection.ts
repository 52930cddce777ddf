import { EventEmitter } from 'node:events';
import type { Duplex } from 'node:stream';
import type { z } from 'zod';
import { HutchError, toHutchError, type WireError } from './errors.ts';
import { DATA_FRAME_OVERHEAD, encodeDataFrameHead, encodeFrame, FrameDecoder } from './frame-codec.ts';
import { MessageSchema, type Capabilities, type Hello, type Message } from './messages.ts';
import {
  EVENTS,
  METHODS,
  isEventName,
  isMethodName,
  type EventData,
  type EventName,
  type MethodName,
  type ParamsOf,
  type ResultOf,
} from './methods.ts';
import { InboundStream, OutboundStream, type StreamTransport } from './flow-control.ts';
import { DEFAULT_MAX_FRAME_BYTES, DEFAULT_STREAM_WINDOW_BYTES, MAX_DATA_CHUNK_BYTES, PROTOCOL_VERSION } from './version.ts';
import { noopLogger, type Logger } from '../log.ts';

export type Role = 'agent' | 'broker';

export interface RequestContext {
  id: number;
  method: MethodName;
  /** Aborted when the requester cancels or the connection closes. */
  signal: AbortSignal;
  /** The receiving end of a stream the requester listed in the request. */
  inbound(id: number): InboundStream;
  /** The sending end of a stream the requester listed in the request. */
  outbound(id: number): OutboundStream;
  connection: Connection;
}

export type Handler<M extends MethodName> = (
  params: z.output<(typeof METHODS)[M]['params']>,
  ctx: RequestContext,
) => Promise<ResultOf<M>>;
export type Handlers = { [M in MethodName]?: Handler<M> };

export interface ConnectionOptions {
  role: Role;
  caps?: Capabilities;
  /** Largest frame this side accepts. */
  maxFrameBytes?: number;
  /** Bytes buffered per inbound stream. */
  windowBytes?: number;
  handlers?: Handlers;
  log?: Logger;
  /** Close if the peer's hello does not arrive in time. */
  handshakeTimeoutMs?: number;
  /** Protocol errors tolerated before the peer is considered broken and dropped. */
  maxProtocolErrors?: number;
  /**
   * Send our hello only in reply to the peer's. For a channel whose far end may not be
   * listening yet (a virtio-serial port drops what the guest writes while the host side
   * is unconnected), so the side that connects always speaks first.
   */
  awaitPeerHello?: boolean;
  /**
   * A hello on an established connection starts a new logical session on the same
   * transport: in-flight work fails, streams close, and we answer with our hello. A
   * VM restored from a snapshot keeps its open virtio-serial port while the broker on
   * the other side is new.
   */
  allowRehello?: boolean;
  /**
   * Resend our hello at this interval until the peer's arrives. A virtio-serial port can
   * drop bytes while the guest reopens it (after a restore the guest first sees the host
   * disconnected); a resent hello makes the handshake robust to that. Duplicate hellos
   * from the peer in answer are expected then, and ignored.
   */
  resendHelloMs?: number;
}

export interface RequestOptions {
  /** Streams (allocated with openInbound/openOutbound) the request uses. */
  streams?: number[];
  signal?: AbortSignal;
  timeoutMs?: number;
}

interface PendingRequest {
  method: MethodName;
  resolve: (r: unknown) => void;
  reject: (e: HutchError) => void;
}

interface ServedRequest {
  controller: AbortController;
  streams: Set<number>;
  /** Logical session it belongs to; answers to an earlier session are dropped. */
  generation: number;
}

/**
 * One protocol connection: handshake, RPC in both directions, pushed events and many
 * flow-controlled streams, over any byte duplex (Unix socket, virtio-serial port, vsock).
 * Both the agent and the broker's agent client are a Connection with different roles.
 *
 * Spec for bad input (tested): a frame whose length exceeds the limit gets a `notice`
 * (too_large) and the connection closes, because framing is lost; a body that is not
 * msgpack or not a valid message gets a `notice` (or an error response when it carried
 * a request id) and the connection stays up, until `maxProtocolErrors` such frames.
 * The connection ending mid-frame discards the partial frame and fails pending calls
 * with `connection_closed`.
 */
export class Connection extends EventEmitter {
  readonly role: Role;
  readonly ready: Promise<Hello>;
  /** Resolves when the connection is gone, with the reason if it was an error. */
  readonly closed: Promise<HutchError | undefined>;
  peer: Hello | undefined;

  private readonly socket: Duplex;
  private readonly decoder: FrameDecoder;
  private readonly maxFrame: number;
  private readonly window: number;
  private readonly handlers: Handlers;
  private readonly log: Logger;
  private readonly maxProtocolErrors: number;
  private protocolErrors = 0;
  private nextRequestId = 1;
  private nextStreamId: number;
  private readonly pending = new Map<number, PendingRequest>();
  private readonly served = new Map<number, ServedRequest>();
  private readonly inbound = new Map<number, InboundStream>();
  private readonly outbound = new Map<number, OutboundStream>();
  /** Peer-allocated stream ids declared by a request we serve, mapped to that request. */
  private readonly declared = new Map<number, number>();
  private drainWaiters: Array<() => void> = [];
  private isClosed = false;
  private resolveReady!: (h: Hello) => void;
  private rejectReady!: (e: HutchError) => void;
  private resolveClosed!: (e: HutchError | undefined) => void;
  private readonly transport: StreamTransport;
  private readonly helloMsg: Record<string, unknown>;
  private readonly awaitPeerHello: boolean;
  private readonly allowRehello: boolean;
  private generation = 0;

  constructor(socket: Duplex, opts: ConnectionOptions) {
    super();
    this.role = opts.role;
    this.socket = socket;
    this.maxFrame = opts.maxFrameBytes ?? DEFAULT_MAX_FRAME_BYTES;
    this.window = opts.windowBytes ?? DEFAULT_STREAM_WINDOW_BYTES;
    this.handlers = opts.handlers ?? {};
    this.log = opts.log ?? noopLogger;
    this.maxProtocolErrors = opts.maxProtocolErrors ?? 1000;
    this.decoder = new FrameDecoder(this.maxFrame);
    this.nextStreamId = this.role === 'broker' ? 1 : 2;
    this.ready = new Promise((res, rej) => {
      this.resolveReady = res;
      this.rejectReady = rej;
    });
    this.ready.catch(() => undefined); // observed via `closed` when nobody awaits it
    this.closed = new Promise((res) => {
      this.resolveClosed = res;
    });
    this.transport = {
      send: (m) => this.send(m),
      sendData: (sid, d) => this.sendData(sid, d),
      drained: () => this.drained(),
      release: (id) => this.releaseStream(id),
    };

    socket.on('data', (chunk: Buffer) => this.onData(chunk));
    socket.on('drain', () => this.flushDrainWaiters());
    socket.on('error', (err) => this.shutdown(new HutchError('connection_closed', `connection error: ${err.message}`, { cause: err.message })));
    socket.on('close', () => this.shutdown(new HutchError('connection_closed', 'connection closed by peer')));
    socket.on('end', () => this.shutdown(new HutchError('connection_closed', 'connection closed by peer')));

    const handshakeMs = opts.handshakeTimeoutMs ?? 10_000;
    const timer = setTimeout(() => {
      if (!this.peer) this.fatal(new HutchError('timeout', `no hello from the peer within ${handshakeMs} ms`));
    }, handshakeMs);
    timer.unref();
    void this.ready.then(() => clearTimeout(timer), () => clearTimeout(timer));

    this.helloMsg = { t: 'hello', v: PROTOCOL_VERSION, role: this.role, maxFrame: this.maxFrame, window: this.window, caps: opts.caps ?? {} };
    this.awaitPeerHello = opts.awaitPeerHello ?? false;
    this.allowRehello = opts.allowRehello ?? false;
    if (!this.awaitPeerHello) this.send(this.helloMsg);
    this.resendHello = opts.resendHelloMs !== undefined;
    if (opts.resendHelloMs !== undefined) {
      const every = setInterval(() => {
        if (this.peer || this.isClosed) clearInterval(every);
        else this.send(this.helloMsg);
      }, opts.resendHelloMs);
      every.unref();
    }
  }

  private readonly resendHello: boolean;

  /** Bytes this side buffers per inbound stream (announced in hello). */
  get inboundWindow(): number {
    return this.window;
  }

  get isOpen(): boolean {
    return !this.isClosed;
  }

  /** Allocates a stream this side will receive on; list its id in the request. */
  openInbound(): InboundStream {
    const id = this.allocStreamId();
    const s = new InboundStream(id, this.window, this.transport);
    this.inbound.set(id, s);
    return s;
  }

  /** Allocates a stream this side will send on; list its id in the request, then write after sending it. */
  openOutbound(): OutboundStream {
    const id = this.allocStreamId();
    const s = new OutboundStream(id, this.peerWindow(), this.dataChunk(), this.transport);
    s.hold();
    this.outbound.set(id, s);
    return s;
  }

  request<M extends MethodName>(method: M, params: ParamsOf<M>, opts: RequestOptions = {}): Promise<ResultOf<M>> {
    return this.begin(method, params, opts).result;
  }

  /** Like request(), but also returns the request id at once (to signal or cancel the call later). */
  begin<M extends MethodName>(method: M, params: ParamsOf<M>, opts: RequestOptions = {}): { id: number; result: Promise<ResultOf<M>> } {
    const id = this.nextRequestId++;
    if (this.isClosed) return { id, result: Promise.reject(new HutchError('connection_closed', `cannot call ${method}: connection is closed`)) };
    const result = this.ready.then(
      () =>
        new Promise<ResultOf<M>>((resolve, reject) => {
          let timer: NodeJS.Timeout | undefined;
          const onAbort = () => {
            this.send({ t: 'cancel', id });
            finish(new HutchError('cancelled', `${method} was cancelled`, { method }));
          };
          const finish = (err: HutchError | undefined, r?: unknown) => {
            if (!this.pending.delete(id)) return;
            if (timer) clearTimeout(timer);
            opts.signal?.removeEventListener('abort', onAbort);
            if (err) reject(err);
            else resolve(r as ResultOf<M>);
          };
          this.pending.set(id, { method, resolve: (r) => finish(undefined, r), reject: (e) => finish(e) });
          if (opts.signal?.aborted) {
            onAbort();
            return;
          }
          opts.signal?.addEventListener('abort', onAbort, { once: true });
          if (opts.timeoutMs !== undefined) {
            timer = setTimeout(() => {
              this.send({ t: 'cancel', id });
              finish(new HutchError('timeout', `${method} got no response within ${opts.timeoutMs} ms`, { method, timeoutMs: opts.timeoutMs }));
            }, opts.timeoutMs);
          }
          const msg: Record<string, unknown> = { t: 'req', id, m: method, p: params };
          if (opts.streams?.length) msg['s'] = opts.streams;
          try {
            this.send(msg, true);
          } catch (err) {
            finish(toHutchError(err, { method }));
            return;
          }
          for (const sid of opts.streams ?? []) this.outbound.get(sid)?.release();
        }),
    );
    return { id, result };
  }

  emitEvent<E extends EventName>(name: E, data: EventData<E>): void {
    this.send({ t: 'evt', n: name, d: data });
  }

  /** Closes gracefully: pending calls fail with connection_closed. */
  close(reason = 'closed by this side'): void {
    if (this.isClosed) return;
    this.socket.end();
    this.shutdown(new HutchError('connection_closed', reason));
  }

  /** Abruptly drops the connection (a peer misbehaved or the VM died). */
  destroy(err: HutchError): void {
    this.socket.destroy();
    this.shutdown(err);
  }

  /** Protocol statistics for tests and telemetry. */
  stats(): { inboundStreams: number; outboundStreams: number; pending: number; served: number; bufferedBytes: number; protocolErrors: number } {
    let buffered = this.decoder.bufferedBytes;
    for (const s of this.inbound.values()) buffered += s.bufferedBytes;
    return {
      inboundStreams: this.inbound.size,
      outboundStreams: this.outbound.size,
      pending: this.pending.size,
      served: this.served.size,
      bufferedBytes: buffered,
      protocolErrors: this.protocolErrors,
    };
  }

  // ---------------------------------------------------------------- internals

  private peerWindow(): number {
    return this.peer?.window ?? DEFAULT_STREAM_WINDOW_BYTES;
  }

  private dataChunk(): number {
    const peerMax = this.peer?.maxFrame ?? DEFAULT_MAX_FRAME_BYTES;
    return Math.min(MAX_DATA_CHUNK_BYTES, peerMax - DATA_FRAME_OVERHEAD);
  }

  private allocStreamId(): number {
    const id = this.nextStreamId;
    this.nextStreamId += 2;
    if (this.nextStreamId > 0xffffffff) this.nextStreamId = this.role === 'broker' ? 1 : 2;
    return id;
  }

  private send(msg: Record<string, unknown>, throwOnError = false): void {
    if (this.isClosed) return;
    let frame: Buffer;
    try {
      // Before the handshake we only know our own limit; hello is tiny anyway.
      frame = encodeFrame(msg, this.peer?.maxFrame ?? this.maxFrame);
    } catch (err) {
      const e = toHutchError(err, { message: String(msg['t']) });
      if (throwOnError) throw e;
      this.log.error('protocol.encode_failed', { error: e.message, t: msg['t'] });
      return;
    }
    this.socket.write(frame);
  }

  private sendData(stream: number, payload: Uint8Array): void {
    if (this.isClosed) return;
    // cork/uncork turns head + payload into one writev without copying the payload.
    this.socket.cork();
    this.socket.write(encodeDataFrameHead(stream, payload.length));
    this.socket.write(payload);
    this.socket.uncork();
  }

  private drained(): Promise<void> {
    if (this.isClosed || !this.socket.writableNeedDrain) return Promise.resolve();
    return new Promise((resolve) => this.drainWaiters.push(resolve));
  }

  private flushDrainWaiters(): void {
    const ws = this.drainWaiters;
    this.drainWaiters = [];
    for (const w of ws) w();
  }

  private releaseStream(id: number): void {
    const inb = this.inbound.get(id);
    if (inb && inb.ended && inb.bufferedBytes === 0) this.inbound.delete(id);
    const out = this.outbound.get(id);
    if (out && out.ended) this.outbound.delete(id);
  }

  private onData(chunk: Buffer): void {
    for (const res of this.decoder.push(chunk)) {
      if (this.isClosed) return;
      if (!res.ok) {
        if (res.fatal) {
          this.fatal(res.error);
          return;
        }
        this.protocolError(res.error);
        continue;
      }
      const parsed = MessageSchema.safeParse(res.value);
      if (!parsed.success) {
        this.rejectInvalid(res.value, parsed.error);
        continue;
      }
      try {
        this.dispatch(parsed.data);
      } catch (err) {
        this.protocolError(toHutchError(err));
      }
    }
  }

  private rejectInvalid(value: unknown, error: z.ZodError): void {
    const v = value as Record<string, unknown> | null;
    const summary = error.issues.slice(0, 3).map((i) => `${i.path.join('.') || '(root)'}: ${i.message}`).join('; ');
    const err = new HutchError('bad_request', `invalid message: ${summary}`);
    // A request we can identify deserves an answer to that request, not just a notice.
    if (this.peer && v && typeof v === 'object' && v['t'] === 'req' && Number.isSafeInteger(v['id'])) {
      this.send({ t: 'res', id: v['id'], e: err.toWire() });
      this.countProtocolError(err);
      return;
    }
    this.protocolError(err);
  }

  private protocolError(err: HutchError): void {
    this.send({ t: 'notice', e: err.toWire() });
    this.countProtocolError(err);
  }

  private countProtocolError(err: HutchError): void {
    this.protocolErrors++;
    this.log.warn('protocol.bad_frame', { code: err.code, error: err.message, count: this.protocolErrors });
    if (this.protocolErrors > this.maxProtocolErrors) {
      this.fatal(new HutchError('bad_request', `peer sent more than ${this.maxProtocolErrors} bad frames`));
    }
  }

  private fatal(err: HutchError): void {
    this.log.warn('protocol.fatal', { code: err.code, error: err.message });
    this.send({ t: 'notice', e: err.toWire() });
    this.socket.end();
    // Give the notice a moment to flush, then make sure the socket is gone.
    setTimeout(() => this.socket.destroy(), 100).unref();
    this.shutdown(err);
  }

  private dispatch(msg: Message): void {
    if (!this.peer) {
      if (msg.t !== 'hello') {
        this.fatal(new HutchError('bad_request', `expected hello as the first frame, got ${msg.t}`));
        return;
      }
      if (msg.v !== PROTOCOL_VERSION) {
        this.fatal(new HutchError('unsupported_version', `peer speaks protocol v${msg.v}, this side v${PROTOCOL_VERSION}`, { peer: msg.v, ours: PROTOCOL_VERSION }));
        return;
      }
      if (msg.role === this.role) {
        this.fatal(new HutchError('bad_request', `both sides claim the role ${msg.role}`));
        return;
      }
      this.peer = msg;
      if (this.awaitPeerHello) this.send(this.helloMsg);
      this.resolveReady(msg);
      this.emit('ready', msg);
      return;
    }
    switch (msg.t) {
      case 'hello':
        if (this.allowRehello && msg.v === PROTOCOL_VERSION && msg.role !== this.role) {
          this.restartSession(msg);
          return;
        }
        if (this.resendHello) return; // the answer to one of our resent hellos
        this.protocolError(new HutchError('bad_request', 'duplicate hello'));
        return;
      case 'req':
        this.serve(msg.id, msg.m, msg.p, msg.s ?? []);
        return;
      case 'res':
        this.onResponse(msg.id, msg.r, msg.e);
        return;
      case 'cancel':
        this.served.get(msg.id)?.controller.abort(new HutchError('cancelled', 'cancelled by the requester'));
        return;
      case 'evt':
        this.onEvent(msg.n, msg.d);
        return;
      case 'data':
        this.onStreamData(msg.s, msg.d);
        return;
      case 'credit':
        this.outbound.get(msg.s)?.addCredit(msg.n);
        return;
      case 'stop':
        this.outbound.get(msg.s)?.peerStopped();
        return;
      case 'end':
        this.onStreamEnd(msg.s, msg.e);
        return;
      case 'notice':
        this.log.warn('protocol.peer_notice', { code: msg.e.code, error: msg.e.message });
        this.emit('notice', HutchError.fromWire(msg.e));
        return;
    }
  }

  private isPeerStream(id: number): boolean {
    return (id % 2 === 1) === (this.role === 'agent');
  }

  private onStreamData(id: number, d: Uint8Array): void {
    let s = this.inbound.get(id);
    if (!s) {
      if (this.isPeerStream(id) && this.declared.has(id)) {
        s = new InboundStream(id, this.window, this.transport);
        this.inbound.set(id, s);
      } else {
        // Data racing a stop we sent, or for a stream never declared: drop it, but say so
        // for the latter since it points at a peer bug.
        if (this.isPeerStream(id)) this.protocolError(new HutchError('not_found', `data for undeclared stream ${id}`, { stream: id }));
        return;
      }
    }
    const err = s.push(d);
    if (err) this.countProtocolError(err);
  }

  private onStreamEnd(id: number, e: WireError | undefined): void {
    let s = this.inbound.get(id);
    if (!s && this.isPeerStream(id) && this.declared.has(id)) {
      s = new InboundStream(id, this.window, this.transport);
      this.inbound.set(id, s);
    }
    s?.end(e);
  }

  private onEvent(name: string, data: unknown): void {
    if (!isEventName(name)) {
      this.protocolError(new HutchError('not_found', `unknown event ${name}`));
      return;
    }
    const parsed = EVENTS[name].safeParse(data);
    if (!parsed.success) {
      this.protocolError(new HutchError('bad_request', `invalid ${name} event: ${parsed.error.issues[0]?.message ?? ''}`));
      return;
    }
    this.emit('event', name, parsed.data);
  }

  private onResponse(id: number, r: unknown, e: WireError | undefined): void {
    const p = this.pending.get(id);
    if (!p) return; // cancelled or timed out already
    if (e) {
      p.reject(HutchError.fromWire(e));
      return;
    }
    const parsed = METHODS[p.method].result.safeParse(r);
    if (!parsed.success) {
      const summary = parsed.error.issues.slice(0, 3).map((i) => `${i.path.join('.')}: ${i.message}`).join('; ');
      p.reject(new HutchError('internal', `invalid ${p.method} result from peer: ${summary}`, { method: p.method }));
      return;
    }
    p.resolve(parsed.data);
  }

  private serve(id: number, method: string, rawParams: unknown, streams: number[]): void {
    if (this.served.has(id)) {
      this.send({ t: 'res', id, e: new HutchError('bad_request', `request id ${id} is already in flight`).toWire() });
      return;
    }
    for (const s of streams) {
      if (!this.isPeerStream(s) || this.declared.has(s) || this.inbound.has(s) || this.outbound.has(s)) {
        this.send({ t: 'res', id, e: new HutchError('bad_request', `stream ${s} is not a fresh stream id of the requester`, { stream: s }).toWire() });
        return;
      }
    }
    if (!isMethodName(method)) {
      this.send({ t: 'res', id, e: new HutchError('not_found', `unknown method ${method}`, { method }).toWire() });
      return;
    }
    const handler = this.handlers[method] as Handler<MethodName> | undefined;
    if (!handler) {
      this.send({ t: 'res', id, e: new HutchError('not_found', `method ${method} is not served by the ${this.role}`, { method }).toWire() });
      return;
    }
    const parsed = METHODS[method].params.safeParse(rawParams);
    if (!parsed.success) {
      const summary = parsed.error.issues.slice(0, 3).map((i) => `${i.path.join('.') || '(params)'}: ${i.message}`).join('; ');
      this.send({ t: 'res', id, e: new HutchError('bad_request', `invalid ${method} params: ${summary}`, { method }).toWire() });
      return;
    }
    const entry: ServedRequest = { controller: new AbortController(), streams: new Set(streams), generation: this.generation };
    this.served.set(id, entry);
    for (const s of streams) this.declared.set(s, id);
    const ctx: RequestContext = {
      id,
      method,
      signal: entry.controller.signal,
      connection: this,
      inbound: (sid) => this.claimInbound(entry, sid),
      outbound: (sid) => this.claimOutbound(entry, sid),
    };
    let result: Promise<unknown>;
    try {
      result = handler(parsed.data as never, ctx);
    } catch (err) {
      result = Promise.reject(err);
    }
    result.then(
      (r) => this.finishServed(id, entry, { t: 'res', id, r }),
      (err) => this.finishServed(id, entry, { t: 'res', id, e: toHutchError(err, { method }).toWire() }),
    );
  }

  private claimInbound(entry: ServedRequest, sid: number): InboundStream {
    if (!entry.streams.has(sid)) throw new HutchError('bad_request', `stream ${sid} was not declared by the request`, { stream: sid });
    let s = this.inbound.get(sid);
    if (!s) {
      s = new InboundStream(sid, this.window, this.transport);
      this.inbound.set(sid, s);
    }
    return s;
  }

  private claimOutbound(entry: ServedRequest, sid: number): OutboundStream {
    if (!entry.streams.has(sid)) throw new HutchError('bad_request', `stream ${sid} was not declared by the request`, { stream: sid });
    let s = this.outbound.get(sid);
    if (!s) {
      s = new OutboundStream(sid, this.peerWindow(), this.dataChunk(), this.transport);
      this.outbound.set(sid, s);
    }
    return s;
  }

  private finishServed(id: number, entry: ServedRequest, response: Record<string, unknown>): void {
    if (entry.generation !== this.generation) return; // its requester is gone
    // Streams die with their request: unread input is refused, unfinished output ended,
    // so a handler that forgets one cannot leak it. Output ends are queued behind their
    // data, and the response behind those ends.
    const flushes: Promise<void>[] = [];
    for (const s of entry.streams) {
      this.declared.delete(s);
      const inb = this.inbound.get(s);
      if (inb && !inb.ended) inb.stop();
      const out = this.outbound.get(s);
      if (out) {
        out.end();
        flushes.push(out.flushed());
      }
    }
    this.served.delete(id);
    const respond = () => {
      try {
        this.send(response, true);
      } catch (err) {
        // A result too large for a frame must still answer the request.
        this.send({ t: 'res', id, e: toHutchError(err, { method: String(response['m'] ?? '') }).toWire() });
      }
    };
    if (flushes.length === 0) respond();
    else void Promise.all(flushes).then(() => setImmediate(respond));
  }

  /** A new peer on the same transport: everything of the old one ends, as if it had disconnected. */
  private restartSession(hello: Hello): void {
    const err = new HutchError('connection_closed', 'the peer started a new session on this channel');
    this.failEverything(err);
    this.generation++;
    this.protocolErrors = 0;
    this.peer = hello;
    this.send(this.helloMsg);
    this.log.info('protocol.rehello', { peerRole: hello.role });
    this.emit('rehello', hello);
    this.emit('ready', hello);
  }

  private failEverything(err: HutchError): void {
    for (const p of [...this.pending.values()]) p.reject(err);
    this.pending.clear();
    for (const s of this.served.values()) s.controller.abort(err);
    this.served.clear();
    this.declared.clear();
    for (const s of this.inbound.values()) s.fail(err);
    for (const s of this.outbound.values()) s.fail(err);
    this.inbound.clear();
    this.outbound.clear();
    this.flushDrainWaiters();
  }

  private shutdown(err: HutchError): void {
    if (this.isClosed) return;
    this.isClosed = true;
    this.rejectReady(err);
    this.failEverything(err);
    this.resolveClosed(err.code === 'connection_closed' ? undefined : err);
    this.emit('close', err);
  }
}
