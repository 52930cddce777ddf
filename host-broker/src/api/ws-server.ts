import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import { timingSafeEqual } from 'node:crypto';
import type { AddressInfo } from 'node:net';
import { Packr } from 'msgpackr';
import { WebSocketServer, type WebSocket, type RawData } from 'ws';
import { HutchError, toHutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import { ClientMessageSchema, HARNESS_API_VERSION, OPS, type OpName } from './harness-protocol.ts';

const packr = new Packr({ useRecords: false });

export interface OpContext {
  /** Request id, which also names a call for `signal`. */
  id: number;
  /** Aborted when the client disconnects or signals the call. */
  signal: AbortSignal;
  /** Sends streamed output of this call to the client, with backpressure. */
  out(fd: 1 | 2, chunk: Uint8Array): Promise<void>;
  /** Pushes an event belonging to this request (a subscription's samples). */
  event(data: unknown): void;
}

export type OpHandler = (op: OpName, params: unknown, ctx: OpContext) => Promise<unknown>;

export interface WsServerOptions {
  port: number;
  host?: string;
  token: string;
  handle: OpHandler;
  log: Logger;
  hello: { backend: string; accel?: string };
  /** Plain-HTTP routes served beside the WebSocket (e.g. /metrics, /healthz). */
  http?: (req: IncomingMessage, res: ServerResponse) => boolean | Promise<boolean>;
  maxPayloadBytes?: number;
}

/** Bytes queued on a socket before streamed output waits for the client. */
const OUT_HIGH_WATER = 4 * 1024 * 1024;

/**
 * The broker's WebSocket endpoint: token auth on upgrade, JSON text frames or msgpack
 * binary frames (answered in kind), zod validation of every request, typed errors.
 */
export class WsServer {
  private readonly http: Server;
  private readonly wss: WebSocketServer;
  private readonly token: Buffer;

  constructor(private readonly opts: WsServerOptions) {
    this.token = Buffer.from(opts.token);
    this.http = createServer((req, res) => void this.onHttp(req, res));
    this.wss = new WebSocketServer({
      server: this.http,
      maxPayload: opts.maxPayloadBytes ?? 256 * 1024 * 1024,
      verifyClient: (info, cb) => {
        if (this.authorized(info.req)) cb(true);
        else {
          opts.log.warn('ws.unauthorized', { remote: info.req.socket.remoteAddress });
          cb(false, 401, 'Unauthorized: missing or wrong token');
        }
      },
    });
    this.wss.on('connection', (ws, req) => this.onConnection(ws, req));
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
    await new Promise<void>((r) => this.wss.close(() => r()));
    await new Promise<void>((r) => this.http.close(() => r()));
  }

  private authorized(req: IncomingMessage): boolean {
    const header = req.headers['authorization'];
    let given: string | undefined;
    if (typeof header === 'string' && header.startsWith('Bearer ')) given = header.slice(7);
    else {
      const url = new URL(req.url ?? '/', 'http://x');
      given = url.searchParams.get('token') ?? undefined;
    }
    if (given === undefined) return false;
    const g = Buffer.from(given);
    return g.length === this.token.length && timingSafeEqual(g, this.token);
  }

  private async onHttp(req: IncomingMessage, res: ServerResponse): Promise<void> {
    try {
      if (this.opts.http && (await this.opts.http(req, res))) return;
      res.writeHead(404, { 'content-type': 'text/plain' }).end('not found: connect a WebSocket to this address\n');
    } catch (err) {
      res.writeHead(500, { 'content-type': 'text/plain' }).end(`internal error: ${(err as Error).message}\n`);
    }
  }

  private onConnection(ws: WebSocket, req: IncomingMessage): void {
    const log = this.opts.log.child({ remote: `${req.socket.remoteAddress}:${req.socket.remotePort}` });
    const inflight = new Map<number, AbortController>();
    log.info('ws.connected');
    const send = (value: unknown, binary: boolean) => {
      if (ws.readyState !== ws.OPEN) return;
      ws.send(binary ? packr.pack(value) : JSON.stringify(value, jsonBytes));
    };
    send({ t: 'hello', v: HARNESS_API_VERSION, broker: 'hutch', ...this.opts.hello }, false);

    ws.on('message', (data: RawData, isBinary: boolean) => {
      let msg: unknown;
      try {
        const buf = Array.isArray(data) ? Buffer.concat(data) : Buffer.from(data as ArrayBuffer);
        msg = isBinary ? packr.unpack(buf) : JSON.parse(buf.toString('utf8'));
      } catch (err) {
        send({ t: 'res', id: -1, e: new HutchError('bad_request', `undecodable ${isBinary ? 'msgpack' : 'JSON'} frame: ${(err as Error).message}`).toWire() }, isBinary);
        return;
      }
      const parsed = ClientMessageSchema.safeParse(msg);
      if (!parsed.success) {
        const id = typeof (msg as { id?: unknown })?.id === 'number' ? (msg as { id: number }).id : -1;
        send({ t: 'res', id, e: new HutchError('bad_request', `invalid request: ${parsed.error.issues[0]?.path.join('.')}: ${parsed.error.issues[0]?.message}`).toWire() }, isBinary);
        return;
      }
      const { id, op, p } = parsed.data;
      if (!(op in OPS)) {
        send({ t: 'res', id, e: new HutchError('not_found', `unknown op ${op}`, { op }).toWire() }, isBinary);
        return;
      }
      if (inflight.has(id)) {
        send({ t: 'res', id, e: new HutchError('bad_request', `request id ${id} is already in flight`).toWire() }, isBinary);
        return;
      }
      const ac = new AbortController();
      inflight.set(id, ac);
      const ctx: OpContext = {
        id,
        signal: ac.signal,
        out: async (fd, chunk) => {
          if (ws.readyState !== ws.OPEN) return;
          const frame = { t: 'out', call: id, fd, d: isBinary ? chunk : Buffer.from(chunk).toString('utf8') };
          if (ws.bufferedAmount < OUT_HIGH_WATER) send(frame, isBinary);
          else await new Promise<void>((r) => ws.send(isBinary ? packr.pack(frame) : JSON.stringify(frame), () => r()));
        },
        event: (d) => send({ t: 'evt', call: id, d }, isBinary),
      };
      const signalOf = (callId: number) => inflight.get(callId);
      const handled = op === 'signal' ? this.signal(p, signalOf) : this.opts.handle(op as OpName, p, ctx);
      handled.then(
        (r) => send({ t: 'res', id, r }, isBinary),
        (err: unknown) => {
          const e = toHutchError(err);
          if (e.code === 'internal') log.error('op.failed', { op, error: e.message, stack: (err as Error).stack });
          send({ t: 'res', id, e: e.toWire() }, isBinary);
        },
      ).finally(() => inflight.delete(id));
    });
    ws.on('close', () => {
      log.info('ws.closed', { inflight: inflight.size });
      for (const ac of inflight.values()) ac.abort(new HutchError('cancelled', 'client disconnected'));
    });
    ws.on('error', (err) => log.warn('ws.error', { error: err.message }));
  }

  private async signal(p: unknown, find: (id: number) => AbortController | undefined): Promise<{ delivered: boolean }> {
    const parsed = OPS.signal.safeParse(p);
    if (!parsed.success) throw new HutchError('bad_request', `invalid signal params: ${parsed.error.issues[0]?.message}`);
    const ac = find(parsed.data.call);
    if (!ac) throw new HutchError('not_found', `no call ${parsed.data.call} in flight on this connection`, { call: parsed.data.call });
    // Any signal ends the call: the process group is killed, and the call resolves as cancelled.
    ac.abort(new HutchError('cancelled', `call cancelled by ${parsed.data.signal}`));
    return { delivered: true };
  }
}

/** JSON cannot carry bytes: text frames get them as UTF-8 strings. */
function jsonBytes(_k: string, v: unknown): unknown {
  if (v && typeof v === 'object' && (v as { type?: string }).type === 'Buffer' && Array.isArray((v as { data?: unknown }).data)) {
    return Buffer.from((v as { data: number[] }).data).toString('utf8');
  }
  if (v instanceof Uint8Array) return Buffer.from(v).toString('utf8');
  return v;
}
