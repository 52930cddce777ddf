import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo, Socket } from 'node:net';
import type { Duplex } from 'node:stream';
import { StringDecoder } from 'node:string_decoder';
import { Packr } from 'msgpackr';
import type { z } from 'zod';
import type { SignalSchema } from '../../../guest-agent/src/protocol/methods.ts';
import { ReceiveBudget } from './receive-budget.ts';
import { SendBudget, type SendLimits } from './send-budget.ts';
import { WebSocketServer, type WebSocket, type RawData } from 'ws';
import { HutchError, toHutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { checkMsgpackShape, parseJsonBounded } from '../../../guest-agent/src/protocol/value-shape.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import { ClientMessageSchema, HARNESS_API_VERSION, OPS, type OpName, type SignalResult } from './harness-protocol.ts';
import type { Principals } from './principals.ts';
import { claimedPrincipal } from '../gateway/credential.ts';

const packr = new Packr({ useRecords: false });

export interface OpContext {
  /** Request id, which also names a call for `signal`. */
  id: number;
  /** Who is asking: the principal whose token opened this connection. */
  principal: string;
  /** The connection is a gateway's, acting for `principal` with the gateway credential. */
  viaGateway: boolean;
  /** Aborted when the client disconnects or signals the call. */
  signal: AbortSignal;
  /** Sends streamed output of this call to the client, with backpressure. */
  out(fd: 1 | 2, chunk: Uint8Array): Promise<void>;
  /** Pushes an event belonging to this request (a subscription's samples). */
  event(data: unknown): void;
  /** A call that runs a command registers how to send it a signal; the `signal` op then delivers the one asked (a gateway's answer names brokers it lacks). */
  onSignal(send: (sig: SignalName) => Promise<boolean | SignalResult>): void;
  /** The request came in a binary (msgpack) frame: bytes travel as bytes (JSON frames need base64). */
  binary: boolean;
  /** The connection: an id for state that outlives one request (a streamed upload), aborted when it closes. */
  connection: { id: number; closed: AbortSignal };
  /** What the handler learnt that the request's log line should say (a call's route). */
  logFields: { route?: string };
}

type SignalName = z.infer<typeof SignalSchema>;

export type OpHandler = (op: OpName, params: unknown, ctx: OpContext) => Promise<unknown>;

/** Connection-level limits: what one client (or a flood of them) can hold of the broker. */
export interface WsLimits {
  /** Largest WebSocket message; a bigger one closes the connection (1009). */
  maxPayloadBytes: number;
  /** A connection must finish its HTTP request or upgrade within this, or it is dropped. */
  handshakeTimeoutMs: number;
  /** Connections not yet upgraded to an authenticated WebSocket; past this the oldest is dropped. */
  maxUnauthenticated: number;
  /** Open WebSockets per principal; more are refused with HTTP 429. */
  maxConnectionsPerPrincipal: number;
  /** Unfinished requests per connection before the broker stops reading that socket. */
  maxInflightPerConnection: number;
  /**
   * Streamed uploads and downloads open at once on one connection (file-stream.ts). With the
   * window, it bounds what one connection's downloads can have queued (8 x 8 MiB, the size of
   * one largest frame); uploads are bounded by maxInflightPerConnection chunks of 1 MiB.
   */
  maxStreamsPerConnection: number;
  /** Credit of one stream: bytes sent and not yet acknowledged, at most. */
  streamWindowBytes: number;
  /** A stream with no chunk (upload) or acknowledgement (download) for this long is dropped. */
  streamIdleMs: number;
  /** Largest streamed file (also capped by the session's workspace quota). */
  maxStreamedFileBytes: number;
  /**
   * What one principal's messages may hold in the broker: messages arriving (past it, its
   * other connections wait while one finishes) plus requests not yet answered (past it, a
   * large request is answered busy). See receive-budget.ts.
   */
  principalReceiveBytes: number;
  /** Requests not yet answered, all principals together (past it, a large request is answered busy). */
  receiveTotalBytes: number;
  /**
   * Bytes made for one connection and not yet taken by its socket (answers, streamed output,
   * events): past it the connection's frames wait, its calls' output is no longer drained,
   * and it is neither read nor are its requests started. See send-budget.ts.
   */
  connectionSendBytes: number;
  /** The same for one principal's connections (and E2B streams) together. */
  principalSendBytes: number;
  /** The same for every client together. */
  sendTotalBytes: number;
  /** A connection none of whose queued bytes its socket took for this long is closed. */
  sendStallMs: number;
}

export const DEFAULT_WS_LIMITS: WsLimits = {
  maxPayloadBytes: 64 * 1024 * 1024,
  handshakeTimeoutMs: 10_000,
  maxUnauthenticated: 256,
  maxConnectionsPerPrincipal: 32,
  maxInflightPerConnection: 64,
  maxStreamsPerConnection: 8,
  streamWindowBytes: 8 * 1024 * 1024,
  streamIdleMs: 60_000,
  maxStreamedFileBytes: 4 * 1024 * 1024 * 1024,
  principalReceiveBytes: 256 * 1024 * 1024,
  receiveTotalBytes: 1024 * 1024 * 1024,
  connectionSendBytes: 16 * 1024 * 1024,
  principalSendBytes: 64 * 1024 * 1024,
  sendTotalBytes: 1024 * 1024 * 1024,
  sendStallMs: 30_000,
};

/** The send budget's limits out of the connection limits. */
export function sendLimits(l: WsLimits): SendLimits {
  return { connectionBytes: l.connectionSendBytes, principalBytes: l.principalSendBytes, totalBytes: l.sendTotalBytes, stallMs: l.sendStallMs };
}

export interface WsServerOptions {
  port: number;
  host?: string;
  principals: Principals;
  handle: OpHandler;
  log: Logger;
  /** Sent in every hello frame, beside the API version and the connection's principal. */
  hello: { backend: string; accel?: string; [k: string]: unknown };
  /** Plain-HTTP routes served beside the WebSocket (e.g. /metrics, /healthz); `principal` when the request carried a valid token. */
  http?: (req: IncomingMessage, res: ServerResponse, principal: string | undefined, authenticated?: () => void) => boolean | Promise<boolean>;
  /** An upgrade that is not the harness API (a WebSocket to a sandbox's port): true when taken. Checked before the harness's. */
  upgrade?: (req: IncomingMessage, socket: Duplex, head: Buffer) => boolean;
  limits?: Partial<WsLimits>;
  /**
   * Host directories whose paths must not reach clients (the data dir, the cache): in error
   * answers they are replaced by a placeholder, wherever the error came from.
   */
  redactPaths?: ReadonlyArray<{ path: string; as: string }>;
  /** The budget of bytes queued for clients, when shared with other surfaces (E2B); else one from `limits`. */
  send?: SendBudget;
}

/**
 * The broker's WebSocket endpoint: token auth on upgrade (each token names a principal),
 * JSON text frames or msgpack binary frames (answered in kind), zod validation of every
 * request, typed errors.
 *
 * Connection-level limits keep one client from starving the rest: sockets that have not
 * completed an authenticated upgrade are few (the oldest is dropped past the cap) and
 * short-lived (handshake timeout), each principal holds a bounded number of connections,
 * and a connection with many unfinished requests is not read until some finish, so its
 * frames queue in its own TCP window instead of the broker's memory. What the broker sends
 * is bounded the same way (send-budget.ts): a client that does not read its socket is not
 * read either, its calls' output waits, and it is closed when it takes nothing for a while.
 */
export class WsServer {
  private readonly http: Server;
  private readonly wss: WebSocketServer;
  readonly limits: WsLimits;
  /** Sockets without an authenticated WebSocket yet, oldest first, with their deadline timers. */
  private readonly pending = new Map<Socket, NodeJS.Timeout>();
  /**
   * Every connection the server accepted, upgraded ones included: a socket handed to an
   * upgrade handler (a sandbox port's WebSocket) is no longer the HTTP server's to close,
   * and one its far end never closes would hold close() for ever.
   */
  private readonly sockets = new Set<Socket>();
  private readonly perPrincipal = new Map<string, number>();
  private readonly principalOf = new WeakMap<IncomingMessage, { principal: string; viaGateway: boolean }>();
  private connectionSeq = 0;
  /** Bytes each principal's messages hold (arriving, and received but not answered). */
  readonly receive: ReceiveBudget;
  /** Bytes made for each connection and principal that their sockets have not taken. */
  readonly send: SendBudget;

  constructor(private readonly opts: WsServerOptions) {
    this.limits = { ...DEFAULT_WS_LIMITS, ...opts.limits };
    this.receive = new ReceiveBudget(this.limits.principalReceiveBytes, this.limits.receiveTotalBytes);
    this.send = opts.send ?? new SendBudget(sendLimits(this.limits));
    this.http = createServer((req, res) => void this.onHttp(req, res));
    // Node's own request timers as a second line (its checker runs on an interval).
    this.http.headersTimeout = this.limits.handshakeTimeoutMs;
    this.http.requestTimeout = this.limits.handshakeTimeoutMs;
    this.http.on('connection', (socket: Socket) => this.onSocket(socket));
    // Upgrades are routed here: a sandbox port's (opts.upgrade) first, then the harness API.
    this.http.on('upgrade', (req: IncomingMessage, socket: Duplex, head: Buffer) => {
      if (opts.upgrade?.(req, socket, head)) {
        this.forget(socket as Socket);
        return;
      }
      this.wss.handleUpgrade(req, socket, head, (ws) => this.wss.emit('connection', ws, req));
    });
    this.wss = new WebSocketServer({
      noServer: true,
      maxPayload: this.limits.maxPayloadBytes,
      verifyClient: (info, cb) => {
        const who = opts.principals.identify(upgradeBearer(info.req), claimedPrincipal(info.req));
        if (who === undefined) {
          opts.log.warn('ws.unauthorized', { remote: info.req.socket.remoteAddress });
          cb(false, 401, 'Unauthorized: missing or wrong token');
          return;
        }
        const { principal } = who;
        if ((this.perPrincipal.get(principal) ?? 0) >= this.limits.maxConnectionsPerPrincipal) {
          opts.log.warn('ws.too_many_connections', { principal, limit: this.limits.maxConnectionsPerPrincipal });
          cb(false, 429, `Too many connections: principal ${principal} already holds ${this.limits.maxConnectionsPerPrincipal}`);
          return;
        }
        this.principalOf.set(info.req, who);
        cb(true);
      },
    });
    this.wss.on('connection', (ws, req) => this.onConnection(ws, req));
  }

  /** Unfinished requests over all connections. */
  private inflightTotal = 0;

  /** Sockets not (yet) an authenticated WebSocket, for tests and metrics. */
  get unauthenticated(): number {
    return this.pending.size;
  }

  /** Open authenticated WebSockets. */
  get connections(): number {
    let n = 0;
    for (const c of this.perPrincipal.values()) n += c;
    return n;
  }

  /** Requests received and not yet answered, over all connections. */
  get inflight(): number {
    return this.inflightTotal;
  }

  /** An error as the client may see it: host paths replaced (logs keep them). */
  private redact<T>(value: T): T {
    const rules = this.opts.redactPaths;
    if (!rules?.length) return value;
    const scrub = (v: unknown): unknown => {
      if (typeof v === 'string') {
        let out = v;
        for (const r of rules) out = out.split(r.path).join(r.as);
        return out;
      }
      if (Array.isArray(v)) return v.map(scrub);
      if (v && typeof v === 'object' && !(v instanceof Uint8Array)) return Object.fromEntries(Object.entries(v).map(([k, x]) => [k, scrub(x)]));
      return v;
    };
    return scrub(value) as T;
  }

  private onSocket(socket: Socket): void {
    this.sockets.add(socket);
    socket.once('close', () => this.sockets.delete(socket));
    if (this.pending.size >= this.limits.maxUnauthenticated) {
      // Drop the oldest: a flood of idle sockets then cannot lock out a client that
      // completes its handshake promptly, and the broker's descriptors stay bounded.
      const [oldest] = this.pending.keys();
      if (oldest) this.forget(oldest)?.destroy();
    }
    const timer = setTimeout(() => {
      this.pending.delete(socket);
      socket.destroy();
    }, this.limits.handshakeTimeoutMs);
    timer.unref();
    this.pending.set(socket, timer);
    socket.once('close', () => this.forget(socket));
  }

  /** Stops tracking a socket as unauthenticated; returns it if it was. */
  private forget(socket: Socket): Socket | undefined {
    const t = this.pending.get(socket);
    if (t === undefined) return undefined;
    clearTimeout(t);
    this.pending.delete(socket);
    return socket;
  }

  async listen(): Promise<number> {
    await new Promise<void>((resolve, reject) => {
      this.http.once('error', reject);
      this.http.listen(this.opts.port, this.opts.host ?? '127.0.0.1', () => resolve());
    });
    return (this.http.address() as AddressInfo).port;
  }

  async close(): Promise<void> {
    for (const c of this.wss.clients) c.terminate();
    for (const s of [...this.pending.keys()]) this.forget(s)?.destroy();
    await new Promise<void>((r) => this.wss.close(() => r()));
    this.http.closeAllConnections();
    for (const s of this.sockets) s.destroy();
    await new Promise<void>((r) => this.http.close(() => r()));
  }

  private async onHttp(req: IncomingMessage, res: ServerResponse): Promise<void> {
    try {
      const principal = this.opts.principals.authenticate(bearer(req));
      // An authenticated request (e.g. a long /mcp call or its event stream) is no longer a
      // stray unauthenticated socket: the handshake deadline does not cut it off.
      if (principal !== undefined) this.forget(req.socket);
      // `authenticated`: a route with its own credentials (the E2B API key) lifts the handshake deadline the same way.
      if (this.opts.http && (await this.opts.http(req, res, principal, () => this.forget(req.socket)))) return;
      res.writeHead(404, { 'content-type': 'text/plain' }).end('not found: connect a WebSocket to this address\n');
    } catch (err) {
      res.writeHead(500, { 'content-type': 'text/plain' }).end(`internal error: ${(err as Error).message}\n`);
    }
  }

  private onConnection(ws: WebSocket, req: IncomingMessage): void {
    const { principal, viaGateway } = this.principalOf.get(req) as { principal: string; viaGateway: boolean };
    this.forget(req.socket);
    this.perPrincipal.set(principal, (this.perPrincipal.get(principal) ?? 0) + 1);
    const log = this.opts.log.child({ remote: `${req.socket.remoteAddress}:${req.socket.remotePort}`, principal });
    const inflight = new Map<number, AbortController>();
    const signallers = new Map<number, (sig: SignalName) => Promise<boolean | SignalResult>>();
    const maxInflight = this.limits.maxInflightPerConnection;
    const connection = { id: ++this.connectionSeq, ac: new AbortController() };
    log.info('ws.connected');
    // Three reasons to stop reading this socket (too many unfinished requests; the principal's
    // messages over its share; what was made for it and not taken over its bound): it reads
    // again only when none holds.
    const paused = { inflight: false, budget: false, send: false };
    const applyPause = () => {
      if (paused.inflight || paused.budget || paused.send) {
        if (!ws.isPaused) ws.pause();
      } else if (ws.isPaused) ws.resume();
    };
    /** A budget's pause and resume of this socket, as one of the reasons. */
    const holds = (why: 'budget' | 'send') => ({
      pause: () => {
        paused[why] = true;
        applyPause();
      },
      resume: () => {
        paused[why] = false;
        applyPause();
      },
    });
    const sender = this.send.join(principal, {
      ...holds('send'),
      close: (why, queuedBytes) => {
        log.warn(`ws.send_${why}`, { queuedBytes, ...(why === 'stalled' ? { stallMs: this.limits.sendStallMs } : { principalQueuedBytes: this.send.queuedBytes(principal) }) });
        ws.terminate();
      },
      closed: connection.ac.signal,
    });
    /** Sends a frame once it fits the send budget; resolves when the socket has it (rejects if the connection closed first). */
    const send = async (value: unknown, binary: boolean): Promise<void> => {
      if (ws.readyState !== ws.OPEN) return;
      const data = binary ? packr.pack(value) : Buffer.from(JSON.stringify(value, jsonBytes));
      await sender.send(data.length, (taken) => ws.send(data, { binary }, () => taken()));
    };
    const post = (value: unknown, binary: boolean) => void send(value, binary).catch(() => undefined);
    post({ t: 'hello', v: HARNESS_API_VERSION, broker: 'hutch', principal, ...this.opts.hello, limits: { ...(this.opts.hello['limits'] as object | undefined), ...this.limits } }, false);
    // A message is buffered whole by ws before 'message': what was read since the last one is
    // the message arriving now (within a chunk of it).
    let readAtMessage = req.socket.bytesRead;
    const receiving = this.receive.join(principal, {
      pending: () => req.socket.bytesRead - readAtMessage,
      ...holds('budget'),
    });
    req.socket.on('data', () => receiving.onData());

    ws.on('message', (data: RawData, isBinary: boolean) => {
      readAtMessage = req.socket.bytesRead;
      receiving.onMessage();
      // ws hands over what it had read when the socket closes: nobody is left to answer, and
      // with the connection's queue given back those requests would all start at once.
      if (ws.readyState !== ws.OPEN) return;
      const size = Array.isArray(data) ? data.reduce((n, b) => n + b.length, 0) : (data as ArrayBuffer).byteLength;
      let msg: unknown;
      try {
        const buf = Array.isArray(data) ? Buffer.concat(data) : Buffer.from(data as ArrayBuffer);
        if (isBinary) {
          checkMsgpackShape(buf);
          msg = packr.unpack(buf);
        } else msg = parseJsonBounded(buf.toString('utf8'));
      } catch (err) {
        // A shape past the limits keeps its own code (too_large, bad_request) and says which.
        const e = err instanceof HutchError ? err : new HutchError('bad_request', `undecodable ${isBinary ? 'msgpack' : 'JSON'} frame: ${(err as Error).message}`);
        post({ t: 'res', id: -1, e: e.toWire() }, isBinary);
        return;
      }
      const parsed = ClientMessageSchema.safeParse(msg);
      if (!parsed.success) {
        const id = typeof (msg as { id?: unknown })?.id === 'number' ? (msg as { id: number }).id : -1;
        post({ t: 'res', id, e: new HutchError('bad_request', `invalid request: ${parsed.error.issues[0]?.path.join('.')}: ${parsed.error.issues[0]?.message}`).toWire() }, isBinary);
        return;
      }
      const { id, op, p } = parsed.data;
      // Own properties only: `toString`, `constructor` and `__proto__` are `in` every object.
      if (!Object.hasOwn(OPS, op)) {
        post({ t: 'res', id, e: new HutchError('not_found', `unknown op ${op}`, { op }).toWire() }, isBinary);
        return;
      }
      if (inflight.has(id)) {
        post({ t: 'res', id, e: new HutchError('bad_request', `request id ${id} is already in flight`).toWire() }, isBinary);
        return;
      }
      const held = this.receive.admit(principal, size);
      if (!held) {
        log.warn('ws.receive_budget', { op, bytes: size, held: this.receive.heldBytes(principal) });
        const msg = `principal ${principal}'s requests already hold ${this.receive.heldBytes(principal)} bytes in the broker (its share is ${this.limits.principalReceiveBytes}, ${this.limits.receiveTotalBytes} in all); this ${size}-byte request was dropped: retry once some are answered (large files go best by upload streams)`;
        post({ t: 'res', id, e: new HutchError('busy', msg, { bytes: size, limit: 'receive' }).toWire() }, isBinary);
        return;
      }
      const ac = new AbortController();
      inflight.set(id, ac);
      this.inflightTotal++;
      // JSON text frames carry output as strings: one decoder per stream, so a character
      // split across two chunks is decoded whole, never as two replacement characters.
      const text = isBinary ? undefined : { 1: new StringDecoder('utf8'), 2: new StringDecoder('utf8') };
      // Back-pressure: stop reading this socket while it has many unfinished requests (its
      // sender then waits on TCP), so its traffic queues there, not in the broker.
      if (inflight.size >= maxInflight && !paused.inflight) {
        log.debug('ws.paused', { inflight: inflight.size });
        paused.inflight = true;
        applyPause();
      }
      const ctx: OpContext = {
        id,
        principal,
        viaGateway,
        signal: ac.signal,
        out: async (fd, chunk) => {
          if (ws.readyState !== ws.OPEN) return;
          const d = text ? text[fd].write(Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength)) : chunk;
          if (text && d === '') return; // only the start of a character so far
          // Waits for room: the call's output is not drained meanwhile. A closed connection
          // takes nothing more, and the call is cancelled with it.
          await send({ t: 'out', call: id, fd, d }, isBinary).catch(() => undefined);
        },
        event: (d) => post({ t: 'evt', call: id, d }, isBinary),
        onSignal: (deliver) => void signallers.set(id, deliver),
        binary: isBinary,
        connection: { id: connection.id, closed: connection.ac.signal },
        logFields: {},
      };
      const signalOf = (callId: number) => {
        const ac = inflight.get(callId);
        return ac ? { ac, deliver: signallers.get(callId) } : undefined;
      };
      // A request starts once what was made for this client fits its bounds again (a signal
      // at once: it makes little and may stop a call that makes much).
      const handled = op === 'signal' ? this.signal(p, signalOf) : sender.room().then(() => this.opts.handle(op as OpName, p, ctx));
      // One line per request, on the connection's logger (remote, principal): a failure at
      // warn (error when internal), a success at debug, with what an operator looks up by.
      const started = performance.now();
      const about = () => {
        const session = (p as { session?: unknown } | undefined)?.session;
        return { req: `${connection.id}:${id}`, op, ...(typeof session === 'string' ? { session } : {}), ...ctx.logFields, ms: Math.round(performance.now() - started) };
      };
      handled
        .then(
          (r) => {
            log.debug('op.done', about());
            return { t: 'res', id, r };
          },
          (err: unknown) => {
            const e = toHutchError(err);
            if (e.code === 'internal') log.error('op.failed', { ...about(), code: e.code, error: e.message, stack: (err as Error).stack });
            else log.warn('op.failed', { ...about(), code: e.code, error: e.message });
            return { t: 'res', id, e: this.redact(e.toWire()) };
          },
        )
        .then((answer) => {
          held(); // the request's bytes are done with; its answer holds its place until written
          return send(answer, isBinary);
        })
        .catch(() => undefined) // the connection closed: nobody to answer
        .finally(() => {
          inflight.delete(id);
          this.inflightTotal--;
          signallers.delete(id);
          held();
          if (paused.inflight && inflight.size <= maxInflight / 2) {
            paused.inflight = false;
            applyPause();
          }
        });
    });
    ws.on('close', () => {
      receiving.leave();
      connection.ac.abort(new HutchError('cancelled', 'client disconnected'));
      sender.leave();
      const left = (this.perPrincipal.get(principal) ?? 1) - 1;
      if (left > 0) this.perPrincipal.set(principal, left);
      else this.perPrincipal.delete(principal);
      log.info('ws.closed', { inflight: inflight.size });
      for (const ac of inflight.values()) ac.abort(new HutchError('cancelled', 'client disconnected'));
    });
    ws.on('error', (err) => log.warn('ws.error', { error: err.message }));
  }

  private async signal(p: unknown, find: (id: number) => { ac: AbortController; deliver: ((sig: SignalName) => Promise<boolean | SignalResult>) | undefined } | undefined): Promise<SignalResult> {
    const parsed = OPS.signal.safeParse(p);
    if (!parsed.success) throw new HutchError('bad_request', `invalid signal params: ${parsed.error.issues[0]?.message}`);
    const call = find(parsed.data.call);
    if (!call) throw new HutchError('not_found', `no call ${parsed.data.call} in flight on this connection`, { call: parsed.data.call });
    // A running command gets the signal asked (a trap may handle SIGINT and go on); SIGKILL,
    // or a call whose command is not running yet, cancels the call (its group is killed).
    if (call.deliver && parsed.data.signal !== 'SIGKILL') {
      const r = await call.deliver(parsed.data.signal);
      return typeof r === 'boolean' ? { delivered: r } : r;
    }
    call.ac.abort(new HutchError('cancelled', `call cancelled by ${parsed.data.signal}`));
    return { delivered: true };
  }
}

/**
 * The bearer token of a plain HTTP request (/mcp, /metrics, /load): the Authorization header
 * only. A token in the query string lands in proxies' access logs and shells' histories.
 */
export function bearer(req: IncomingMessage): string | undefined {
  const header = req.headers['authorization'];
  return typeof header === 'string' && header.startsWith('Bearer ') ? header.slice(7) : undefined;
}

/** The bearer token of a WebSocket upgrade: the Authorization header, else a `token` query parameter (browsers cannot set headers on WebSockets). */
function upgradeBearer(req: IncomingMessage): string | undefined {
  return bearer(req) ?? new URL(req.url ?? '/', 'http://x').searchParams.get('token') ?? undefined;
}

/** JSON cannot carry bytes: text frames get them as UTF-8 strings. */
function jsonBytes(_k: string, v: unknown): unknown {
  if (v && typeof v === 'object' && (v as { type?: string }).type === 'Buffer' && Array.isArray((v as { data?: unknown }).data)) {
    return Buffer.from((v as { data: number[] }).data).toString('utf8');
  }
  if (v instanceof Uint8Array) return Buffer.from(v).toString('utf8');
  return v;
}
