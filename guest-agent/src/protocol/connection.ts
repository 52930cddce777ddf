import { EventEmitter } from 'node:events';
import { randomInt } from 'node:crypto';
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
import { LoopShare, type LoopShareOptions } from './loop-share.ts';
import type { ShapeLimits } from './value-shape.ts';
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
   * A device channel (a virtio-serial port): the far side can change under us without the
   * transport closing. As the agent: frames that arrive before a hello, or stamped with
   * another epoch, are refused with `stale_epoch` instead of closing the channel, and a
   * broker hello with a new nonce starts a new session. As the broker: see resendHelloMs.
   */
  channel?: boolean;
  /**
   * Broker: resend hello at this interval until it is answered (a virtio-serial port drops
   * what is written while the guest has it closed or is reopening it).
   */
  resendHelloMs?: number;
  /** Broker: ping the agent when nothing arrived for this long while requests wait. */
  heartbeatMs?: number;
  /** Broker: give up on the agent (`guest_unresponsive`) when nothing arrived for this long while requests wait. */
  deadAfterMs?: number;
  /** A deadline for every request that names none itself (the broker's guest RPC deadlines). */
  defaultDeadline?: (method: MethodName, params: unknown, streams: number) => number | undefined;
  /** The error a default deadline raises. */
  defaultDeadlineCode?: 'timeout' | 'guest_unresponsive';
  /**
   * Pace reading the peer to this share of the event loop (loop-share.ts): for a peer that
   * is not trusted with the loop, such as a guest agent as seen by the broker. Unset: unpaced.
   */
  loopShare?: LoopShareOptions;
  /** Check each frame's shape before decoding it (value-shape.ts), for a peer that picks costly content. Unset: unchecked. */
  frameShape?: ShapeLimits;
  /**
   * Stop reading the peer while this many bytes we wrote wait for it to read them: answers
   * to a peer that sends requests or pings and never reads would otherwise pile up in this
   * process without bound. Only for one side of a connection (the broker's, facing a guest
   * it does not trust): were both sides to stop reading while their writes wait, neither
   * would drain. The agent always reads. Unset: reading never waits on writes.
   */
  maxOutputBacklogBytes?: number;
}

/** The broker's backlog limit for a guest: far above what flow-controlled streams and 1 MiB frames leave queued. */
export const OUTPUT_BACKLOG_BYTES = 16 * 1024 * 1024;

export interface RequestOptions {
  /** Streams (allocated with openInbound/openOutbound) the request uses. */
  streams?: number[];
  signal?: AbortSignal;
  /** The request's deadline: past it, the request fails with `deadlineCode` (default `timeout`). */
  timeoutMs?: number;
  deadlineCode?: 'timeout' | 'guest_unresponsive';
}

interface PendingRequest {
  method: MethodName;
  resolve: (r: unknown) => void;
  reject: (e: HutchError) => void;
  /** The request frame, kept to send it (again) once a session is up. */
  msg: Record<string, unknown>;
  streams: number[];
  /** Epoch it was sent under; undefined while it waits for a handshake. */
  epoch: number | undefined;
  /** The agent said it never started it (it reached another epoch). */
  refused: boolean;
  resent: boolean;
  /** Only requests that send no stream data can be sent again: that data went to the old epoch. */
  resendable: boolean;
}

interface ServedRequest {
  controller: AbortController;
  streams: Set<number>;
  /** Session it belongs to; answers to an earlier session are dropped. */
  epoch: number;
}

/** Notices from the peer logged in full before only every 1,000th is (logPeerNotice). */
const PEER_NOTICES_LOGGED = 20;

/**
 * Epochs are per agent process and only ever grow (from a random start), so a session
 * started after a snapshot restore never reuses the epoch of the session that was live
 * when the snapshot was taken.
 */
let lastEpoch = randomInt(1, 0x40000000);
function nextEpoch(): number {
  lastEpoch = lastEpoch >= 0xfffffff0 ? 1 : lastEpoch + 1;
  return lastEpoch;
}

/**
 * One protocol connection: handshake, RPC in both directions, pushed events and many
 * flow-controlled streams, over any byte duplex (Unix socket, virtio-serial port, vsock).
 * Both the agent and the broker's agent client are a Connection with different roles.
 *
 * Handshake: the broker speaks first (`hello` with a fresh nonce); the agent answers with
 * its hello echoing the nonce and naming the epoch of the session it starts. From then on
 * both sides stamp that epoch on every frame and act on no frame of another epoch. On a
 * device channel the agent's end can be reopened under the broker (a snapshot restore, an
 * agent restart): the new agent session refuses what was meant for the old one with
 * `stale_epoch`, the broker re-handshakes, sends again (once) each request the agent
 * refused, and fails those that reached the old session with `interrupted` (they may have
 * run). While requests wait, the broker pings; no frame for `deadAfterMs` closes the
 * connection with `guest_unresponsive`, so nothing waits forever on a dead guest.
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
  /** Resolves at the first completed handshake. */
  readonly ready: Promise<Hello>;
  /** Resolves when the connection is gone, with the reason if it was an error. */
  readonly closed: Promise<HutchError | undefined>;
  peer: Hello | undefined;

  private readonly socket: Duplex;
  private decoder: FrameDecoder;
  private readonly maxFrame: number;
  private readonly window: number;
  private readonly handlers: Handlers;
  private readonly log: Logger;
  private readonly maxProtocolErrors: number;
  private readonly channel: boolean;
  private protocolErrors = 0;
  private peerNotices = 0;
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
  private readonly caps: Capabilities;
  /** The session's epoch once a handshake completed. */
  private epoch: number | undefined;
  /** Broker: the nonce of the hello we wait an answer to; agent: of the hello we answered. */
  private nonce: number | undefined;
  /** Broker: a (re-)handshake is under way; requests queue until it completes. */
  private handshaking = false;
  private helloTimer: NodeJS.Timeout | undefined;
  private handshakeDeadline: NodeJS.Timeout | undefined;
  private heartbeat: NodeJS.Timeout | undefined;
  private lastHeard = Date.now();
  private pingSeq = 0;
  /** Agent: a stale-epoch notice was sent since the last frame of the current epoch. */
  private staleNoticeSent = false;
  private readonly opts: ConnectionOptions;
  /** Loop time the peer's input may take, when paced. */
  private readonly loopShare: LoopShare | undefined;
  /** Set while reading is stopped because the peer ran out of loop time. */
  private resumeTimer: NodeJS.Timeout | undefined;
  /** Set while reading is stopped because the peer is not reading what we sent. */
  private backlogged = false;
  private readonly maxBacklog: number | undefined;
  /** Times reading stopped for an output backlog. */
  backlogPauses = 0;

  constructor(socket: Duplex, opts: ConnectionOptions) {
    super();
    this.opts = opts;
    this.role = opts.role;
    this.socket = socket;
    this.maxFrame = opts.maxFrameBytes ?? DEFAULT_MAX_FRAME_BYTES;
    this.window = opts.windowBytes ?? DEFAULT_STREAM_WINDOW_BYTES;
    this.handlers = opts.handlers ?? {};
    this.log = opts.log ?? noopLogger;
    this.maxProtocolErrors = opts.maxProtocolErrors ?? 1000;
    this.channel = opts.channel ?? false;
    this.caps = opts.caps ?? {};
    this.decoder = new FrameDecoder(this.maxFrame, opts.frameShape);
    this.loopShare = opts.loopShare ? new LoopShare(opts.loopShare) : undefined;
    this.maxBacklog = opts.maxOutputBacklogBytes;
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
    socket.on('drain', () => {
      if (this.backlogged) {
        this.backlogged = false;
        this.updateReading();
      }
      this.flushDrainWaiters();
    });
    socket.on('error', (err) => this.shutdown(new HutchError('connection_closed', `connection error: ${err.message}`, { cause: err.message })));
    socket.on('close', () => this.shutdown(new HutchError('connection_closed', 'connection closed by peer')));
    socket.on('end', () => this.shutdown(new HutchError('connection_closed', 'connection closed by peer')));

    const handshakeMs = opts.handshakeTimeoutMs ?? 10_000;
    const timer = setTimeout(() => {
      if (!this.peer) this.fatal(new HutchError('timeout', `no hello from the peer within ${handshakeMs} ms`));
    }, handshakeMs);
    timer.unref();
    void this.ready.then(() => clearTimeout(timer), () => clearTimeout(timer));

    if (this.role === 'broker') {
      this.startHandshake();
      if (opts.heartbeatMs !== undefined) {
        const every = opts.heartbeatMs;
        this.heartbeat = setInterval(() => this.checkLiveness(every), Math.max(50, Math.floor(every / 2)));
        this.heartbeat.unref();
      }
    }
  }

  /** Bytes this side buffers per inbound stream (announced in hello). */
  get inboundWindow(): number {
    return this.window;
  }

  get isOpen(): boolean {
    return !this.isClosed;
  }

  /** The current session's epoch (undefined before the first handshake). */
  get currentEpoch(): number | undefined {
    return this.epoch;
  }

  /** Allocates a stream this side will receive on; list its id in the request. */
  openInbound(): InboundStream {
    const id = this.allocStreamId();
    const s = new InboundStream(id, this.window, this.transport);
    // On a closed connection nothing will ever arrive: the stream fails at once, so a
    // consumer that reads it before awaiting its request cannot wait forever.
    if (this.closeError) s.fail(this.closeError);
    else this.inbound.set(id, s);
    return s;
  }

  /** Allocates a stream this side will send on; list its id in the request, then write after sending it. */
  openOutbound(): OutboundStream {
    const id = this.allocStreamId();
    const s = new OutboundStream(id, this.peerWindow(), this.dataChunk(), this.transport);
    s.hold();
    if (this.closeError) s.fail(this.closeError);
    else this.outbound.set(id, s);
    return s;
  }

  request<M extends MethodName>(method: M, params: ParamsOf<M>, opts: RequestOptions = {}): Promise<ResultOf<M>> {
    return this.begin(method, params, opts).result;
  }

  /** Like request(), but also returns the request id at once (to signal or cancel the call later). */
  begin<M extends MethodName>(method: M, params: ParamsOf<M>, opts: RequestOptions = {}): { id: number; result: Promise<ResultOf<M>> } {
    const id = this.nextRequestId++;
    if (this.isClosed) return { id, result: Promise.reject(new HutchError('connection_closed', `cannot call ${method}: connection is closed`)) };
    const result = new Promise<ResultOf<M>>((resolve, reject) => {
      let timer: NodeJS.Timeout | undefined;
      const started = Date.now();
      const onAbort = () => {
        this.sendCancel(id);
        finish(new HutchError('cancelled', `${method} was cancelled`, { method }));
      };
      const finish = (err: HutchError | undefined, r?: unknown) => {
        if (!this.pending.delete(id)) return;
        if (timer) clearTimeout(timer);
        opts.signal?.removeEventListener('abort', onAbort);
        if (err) reject(err);
        else resolve(r as ResultOf<M>);
      };
      const msg: Record<string, unknown> = { t: 'req', id, m: method, p: params };
      const streams = opts.streams ?? [];
      if (streams.length) msg['s'] = streams;
      const entry: PendingRequest = {
        method,
        resolve: (r) => finish(undefined, r),
        reject: (e) => finish(e),
        msg,
        streams,
        epoch: undefined,
        refused: false,
        resent: false,
        resendable: !streams.some((sid) => this.outbound.has(sid)),
      };
      this.pending.set(id, entry);
      if (opts.signal?.aborted) {
        onAbort();
        return;
      }
      opts.signal?.addEventListener('abort', onAbort, { once: true });
      const fallback = opts.timeoutMs === undefined ? this.opts.defaultDeadline?.(method, params, streams.length) : undefined;
      const deadline = opts.timeoutMs ?? fallback;
      if (deadline !== undefined) {
        const code = opts.deadlineCode ?? (fallback !== undefined ? this.opts.defaultDeadlineCode : undefined) ?? 'timeout';
        timer = setTimeout(() => {
          this.sendCancel(id);
          const waited = Date.now() - started;
          const what = code === 'guest_unresponsive' ? `the guest did not answer ${method} within its deadline (waited ${waited} ms)` : `${method} got no response within ${deadline} ms`;
          finish(new HutchError(code, what, { method, deadlineMs: deadline, waitedMs: waited }));
        }, deadline);
        timer.unref();
      }
      if (this.peer && !this.handshaking) this.transmit(id, entry);
      // else: sent when the handshake completes (see onHandshake)
    });
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

  /** Abruptly drops the connection (a peer misbehaved or the VM died); pending calls fail with `err`. */
  destroy(err: HutchError): void {
    this.socket.destroy();
    this.shutdown(err);
  }

  /** Protocol statistics for tests and telemetry. */
  stats(): { inboundStreams: number; outboundStreams: number; pending: number; served: number; bufferedBytes: number; protocolErrors: number; epoch: number | undefined } {
    let buffered = this.decoder.bufferedBytes;
    for (const s of this.inbound.values()) buffered += s.bufferedBytes;
    return {
      inboundStreams: this.inbound.size,
      outboundStreams: this.outbound.size,
      pending: this.pending.size,
      served: this.served.size,
      bufferedBytes: buffered,
      protocolErrors: this.protocolErrors,
      epoch: this.epoch,
    };
  }

  // ---------------------------------------------------------------- handshake

  private helloMsg(extra: Record<string, unknown>): Record<string, unknown> {
    return { t: 'hello', v: PROTOCOL_VERSION, role: this.role, maxFrame: this.maxFrame, window: this.window, caps: this.caps, ...extra };
  }

  /** Broker: (re)starts the handshake with a fresh nonce; requests queue until it completes. */
  private startHandshake(): void {
    this.handshaking = true;
    this.nonce = randomInt(0, 0xffffffff);
    const hello = this.helloMsg({ nonce: this.nonce });
    this.send(hello);
    if (this.helloTimer) clearInterval(this.helloTimer);
    if (this.opts.resendHelloMs !== undefined) {
      this.helloTimer = setInterval(() => {
        if (!this.handshaking || this.isClosed) {
          clearInterval(this.helloTimer);
          this.helloTimer = undefined;
        } else this.send(hello);
      }, this.opts.resendHelloMs);
      this.helloTimer.unref();
    }
    if (this.peer) {
      // A re-handshake has its own deadline; the first one is bounded by handshakeTimeoutMs.
      const ms = this.opts.handshakeTimeoutMs ?? 10_000;
      if (this.handshakeDeadline) clearTimeout(this.handshakeDeadline);
      this.handshakeDeadline = setTimeout(() => {
        if (this.handshaking) this.fatal(new HutchError('guest_unresponsive', `the agent did not answer a re-handshake within ${ms} ms`, { deadlineMs: ms }));
      }, ms);
      this.handshakeDeadline.unref();
    }
  }

  /** Broker: the agent answered our current hello: a session with its epoch begins. */
  private onHandshake(hello: Hello): void {
    const first = this.peer === undefined;
    const previous = this.epoch;
    this.peer = hello;
    this.epoch = hello.ep ?? 0;
    this.handshaking = false;
    if (this.helloTimer) clearInterval(this.helloTimer);
    this.helloTimer = undefined;
    if (this.handshakeDeadline) clearTimeout(this.handshakeDeadline);
    this.handshakeDeadline = undefined;
    if (!first) this.log.info('protocol.rehandshake', { from: previous, to: this.epoch });
    for (const [id, p] of [...this.pending]) {
      if (p.epoch === undefined) {
        this.transmit(id, p);
      } else if (p.epoch !== this.epoch) {
        if (p.refused && !p.resent && p.resendable) {
          p.resent = true;
          p.refused = false;
          this.transmit(id, p);
        } else {
          p.reject(
            new HutchError('interrupted', `${p.method} was in flight when the agent's side of the channel started over; it may or may not have run`, {
              method: p.method,
              refused: p.refused,
            }),
          );
          for (const sid of p.streams) this.failStream(sid, new HutchError('interrupted', `the request of stream ${sid} was interrupted`));
        }
      }
    }
    if (first) this.resolveReady(hello);
    this.emit('ready', hello);
  }

  /** Agent: a broker hello: start a session (or answer a resent hello of the current one again). */
  private onBrokerHello(hello: Hello): void {
    if (this.peer && hello.nonce !== undefined && hello.nonce === this.nonce) {
      this.send(this.helloMsg({ echo: this.nonce, ep: this.epoch })); // a resent hello: same answer
      return;
    }
    const restarting = this.peer !== undefined;
    if (restarting) {
      if (!this.channel) {
        this.protocolError(new HutchError('bad_request', 'duplicate hello'));
        return;
      }
      this.failEverything(new HutchError('interrupted', 'a new broker session started on this channel'));
      this.protocolErrors = 0;
    }
    this.peer = hello;
    this.nonce = hello.nonce;
    this.epoch = nextEpoch();
    this.staleNoticeSent = false;
    this.send(this.helloMsg({ ...(hello.nonce !== undefined ? { echo: hello.nonce } : {}), ep: this.epoch }));
    if (restarting) this.log.info('protocol.new_session', { epoch: this.epoch });
    else this.resolveReady(hello);
    this.emit('ready', hello);
  }

  /** Agent: a frame that belongs to no session of ours: refuse it so the broker re-handshakes. */
  private refuseStale(msg: Message): void {
    const why = this.peer ? `frame of epoch ${String(msg.ep)} reached epoch ${this.epoch}` : 'frame before any hello on this channel';
    if (msg.t === 'req') {
      this.send({ t: 'res', id: msg.id, e: new HutchError('stale_epoch', `request not started: ${why}`, { id: msg.id }).toWire() });
      return;
    }
    if (!this.staleNoticeSent || msg.t === 'ping') {
      this.staleNoticeSent = true;
      this.send({ t: 'notice', e: new HutchError('stale_epoch', why).toWire() });
    }
  }

  /** Broker: the agent said a request of ours reached another session: it never started. */
  private onStale(id: number | undefined): void {
    if (id !== undefined) {
      const p = this.pending.get(id);
      if (p) p.refused = true;
    }
    if (!this.handshaking) {
      this.log.warn('protocol.stale_epoch', { epoch: this.epoch, request: id });
      this.startHandshake();
    }
  }

  private transmit(id: number, p: PendingRequest): void {
    p.epoch = this.epoch;
    try {
      this.send(p.msg, true);
    } catch (err) {
      p.reject(toHutchError(err, { method: p.method }));
      return;
    }
    for (const sid of p.streams) this.outbound.get(sid)?.release();
  }

  private sendCancel(id: number): void {
    const p = this.pending.get(id);
    if (p && p.epoch !== undefined && p.epoch === this.epoch && !this.handshaking) this.send({ t: 'cancel', id });
  }

  /** Broker: ping while requests wait; nothing heard for deadAfterMs means the guest is gone. */
  private checkLiveness(every: number): void {
    if (this.isClosed) return;
    // Handshakes have deadlines of their own (a restore from a big snapshot slot under a
    // loaded TCG host takes a while before the guest can say anything).
    if (this.pending.size === 0 || this.handshaking) {
      this.lastHeard = Date.now();
      return;
    }
    const silent = Date.now() - this.lastHeard;
    const dead = this.opts.deadAfterMs;
    if (dead !== undefined && silent > dead) {
      const methods = [...new Set([...this.pending.values()].map((p) => p.method))].join(', ');
      this.fatal(new HutchError('guest_unresponsive', `the agent sent nothing for ${silent} ms while ${this.pending.size} call(s) waited (${methods || 'handshake'})`, { silentMs: silent, methods }));
      return;
    }
    if (silent >= every && this.peer && !this.handshaking) this.send({ t: 'ping', n: ++this.pingSeq });
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
    if (msg['t'] !== 'hello' && this.epoch !== undefined) msg = { ...msg, ep: this.epoch };
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
    this.socket.write(encodeDataFrameHead(stream, payload.length, this.epoch ?? 0));
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

  private failStream(id: number, err: HutchError): void {
    this.inbound.get(id)?.fail(err);
    this.outbound.get(id)?.fail(err);
    this.inbound.delete(id);
    this.outbound.delete(id);
  }

  /** Times reading the peer was stopped for taking more than its loop share, and for how long in all (ms). */
  get pacing(): { paused: number; pausedMs: number; chargedMs: number; maxChargeMs: number } {
    const s = this.loopShare;
    return { paused: s?.paused ?? 0, pausedMs: s?.pausedMs ?? 0, chargedMs: s?.chargedMs ?? 0, maxChargeMs: s?.maxChargeMs ?? 0 };
  }

  private onData(chunk: Buffer): void {
    const started = this.loopShare ? performance.now() : 0;
    try {
      this.readChunk(chunk);
    } finally {
      if (this.loopShare) this.chargeLoop(performance.now() - started);
      // What we answered is still queued for a peer that does not read it: take nothing
      // more from it until the queue drains ('drain' resumes).
      if (this.maxBacklog !== undefined && !this.backlogged && this.socket.writableLength > this.maxBacklog) {
        this.backlogged = true;
        this.backlogPauses++;
        if (this.backlogPauses === 1 || this.backlogPauses % 100 === 0) this.log.warn('protocol.peer_not_reading', { queuedBytes: this.socket.writableLength, pauses: this.backlogPauses });
        this.updateReading();
      }
    }
  }

  /** Reading goes on only while the peer is within its loop share and reads what we send. */
  private updateReading(): void {
    if (this.isClosed) return;
    if (this.resumeTimer || this.backlogged) this.socket.pause();
    else this.socket.resume();
  }

  /**
   * Charges loop time spent on the peer's input outside the frame reader (records decoded
   * from one of its streams) to its share: past it, reading the peer stops for a while.
   */
  chargeLoop(ms: number): void {
    const wait = this.loopShare?.charge(ms) ?? 0;
    if (wait > 0) this.pauseReading(wait);
  }

  private pauseReading(ms: number): void {
    if (this.isClosed || this.resumeTimer) return;
    const { paused, pausedMs } = this.pacing;
    // The first time, then now and then: a hostile peer would otherwise fill the log instead.
    if (paused === 1 || paused % 100 === 0) this.log.warn('protocol.peer_paced', { waitMs: Math.round(ms), paused, pausedMs: Math.round(pausedMs) });
    this.resumeTimer = setTimeout(() => {
      this.resumeTimer = undefined;
      this.updateReading();
    }, Math.ceil(ms));
    this.resumeTimer.unref();
    this.updateReading();
  }

  private readChunk(chunk: Buffer): void {
    this.lastHeard = Date.now();
    for (const res of this.decoder.push(chunk)) {
      if (this.isClosed) return;
      if (!res.ok) {
        if (res.fatal) {
          if (this.channel && this.role === 'agent' && !this.peer) {
            // Bytes meant for an earlier reader of the port (framing lost mid-stream): start
            // over at the next write; the broker's resent hello begins on a frame boundary.
            this.decoder = new FrameDecoder(this.maxFrame, this.opts.frameShape);
            this.refuseStaleRaw();
            return;
          }
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

  /**
   * A peer's notices go to our log, but the peer decides how many and how long: past the
   * first few only every 1,000th is logged (with the count), and messages are cut to 1 KiB,
   * so a broken or hostile guest cannot fill the broker's disk with its words.
   */
  private logPeerNotice(e: WireError): void {
    const n = ++this.peerNotices;
    if (n > PEER_NOTICES_LOGGED && n % 1000 !== 0) return;
    const error = e.message.length > 1024 ? `${e.message.slice(0, 1024)}... (${e.message.length} characters)` : e.message;
    this.log.warn('protocol.peer_notice', { code: e.code, error, ...(n > PEER_NOTICES_LOGGED ? { notices: n } : {}) });
  }

  private refuseStaleRaw(): void {
    if (this.staleNoticeSent) return;
    this.staleNoticeSent = true;
    this.send({ t: 'notice', e: new HutchError('stale_epoch', 'undecodable bytes before any hello on this channel').toWire() });
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
    if (msg.t === 'hello') {
      this.onHello(msg);
      return;
    }
    if (this.role === 'agent') {
      if (!this.peer) {
        if (this.channel) this.refuseStale(msg);
        else this.fatal(new HutchError('bad_request', `expected hello as the first frame, got ${msg.t}`));
        return;
      }
      if (msg.ep !== this.epoch) {
        this.refuseStale(msg);
        return;
      }
      this.staleNoticeSent = false;
    } else {
      // The agent refusing what reached the wrong session carries its own (new) epoch.
      if (msg.t === 'res' && msg.e?.code === 'stale_epoch') {
        this.onStale(msg.id);
        return;
      }
      if (msg.t === 'notice' && msg.e.code === 'stale_epoch') {
        this.onStale(undefined);
        return;
      }
      if (!this.peer) {
        this.fatal(new HutchError('bad_request', `expected hello as the first frame, got ${msg.t}`));
        return;
      }
      if (msg.ep !== this.epoch) {
        this.log.debug('protocol.other_epoch_dropped', { t: msg.t, ep: msg.ep, epoch: this.epoch });
        return;
      }
    }
    switch (msg.t) {
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
      case 'ping':
        this.send({ t: 'pong', n: msg.n });
        return;
      case 'pong':
        return; // onData noted that the peer is alive
      case 'notice':
        this.logPeerNotice(msg.e);
        this.emit('notice', HutchError.fromWire(msg.e));
        return;
    }
  }

  private onHello(msg: Hello): void {
    if (msg.v !== PROTOCOL_VERSION) {
      this.fatal(new HutchError('unsupported_version', `peer speaks protocol v${msg.v}, this side v${PROTOCOL_VERSION}`, { peer: msg.v, ours: PROTOCOL_VERSION }));
      return;
    }
    if (msg.role === this.role) {
      this.fatal(new HutchError('bad_request', `both sides claim the role ${msg.role}`));
      return;
    }
    if (this.role === 'agent') {
      this.onBrokerHello(msg);
      return;
    }
    // Broker: only the answer to our current hello counts; answers to earlier (resent or
    // pre-restart) hellos, and repeats of the current answer, are expected and ignored.
    if (msg.echo !== this.nonce || !this.handshaking) return;
    this.onHandshake(msg);
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
    const entry: ServedRequest = { controller: new AbortController(), streams: new Set(streams), epoch: this.epoch ?? 0 };
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
    if (entry.epoch !== this.epoch || this.served.get(id) !== entry) return; // its session is gone
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
      if (entry.epoch !== this.epoch) return;
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

  private closeError: HutchError | undefined;

  private shutdown(err: HutchError): void {
    if (this.isClosed) return;
    this.isClosed = true;
    this.closeError = err;
    if (this.helloTimer) clearInterval(this.helloTimer);
    if (this.handshakeDeadline) clearTimeout(this.handshakeDeadline);
    if (this.heartbeat) clearInterval(this.heartbeat);
    if (this.resumeTimer) clearTimeout(this.resumeTimer);
    this.rejectReady(err);
    this.failEverything(err);
    this.resolveClosed(err.code === 'connection_closed' ? undefined : err);
    this.emit('close', err);
  }
}
