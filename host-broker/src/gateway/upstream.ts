/**
 * One gateway-to-broker connection: the gateway credential plus the principal header, frames
 * in the client's own encoding (msgpack or JSON: what the broker answers, e.g. a chunk as raw
 * bytes or base64, depends on it), request ids of our own. Frames are the shared protocol's
 * (ServerMessageSchema); nothing here reads a frame any other way.
 */
import { Packr } from 'msgpackr';
import WebSocket from 'ws';
import { HutchError, type WireError } from '../../../guest-agent/src/protocol/errors.ts';
import { ServerMessageSchema } from '../api/harness-protocol.ts';
import { PRINCIPAL_HEADER } from './credential.ts';

const packr = new Packr({ useRecords: false });

export interface UpstreamSinks {
  out?: (fd: 1 | 2, d: Uint8Array) => void | Promise<void>;
  event?: (d: unknown) => void;
}

/**
 * How long a request may go without an answer before it is given up (failed `unavailable`,
 * reason `timeout`, its late answer dropped): `ms` from sending it, or, with `whileFrames`,
 * from its last output or event frame (a subscription shows it is alive by its events).
 */
export interface Deadline {
  ms: number;
  whileFrames?: boolean;
}

interface Pending extends UpstreamSinks {
  resolve: (r: unknown) => void;
  reject: (e: HutchError) => void;
  /** Armed when the request has a deadline; refreshed by its frames with `whileFrames`. */
  timer?: NodeJS.Timeout;
  whileFrames?: boolean;
}

export class Upstream {
  private nextId = 1;
  private readonly pending = new Map<number, Pending>();
  private closedError: HutchError | undefined;
  /** Output chunks handed to clients that have not been flushed to them yet. */
  private waitingSinks = 0;
  /** When the last request finished (an idle connection is closed by the pool). */
  lastUsed = Date.now();

  private constructor(
    private readonly ws: WebSocket,
    readonly broker: string,
    private readonly binary: boolean,
  ) {
    ws.on('message', (data: WebSocket.RawData, isBinary: boolean) => this.onMessage(data, isBinary));
    ws.on('close', () => this.fail(lost(broker, 'its connection closed')));
    ws.on('error', (err) => this.fail(lost(broker, err.message)));
  }

  static async open(o: { broker: string; url: string; credential: string; principal: string; binary: boolean; timeoutMs: number; maxPayload: number }): Promise<Upstream> {
    const ws = new WebSocket(o.url, {
      headers: { authorization: `Bearer ${o.credential}`, [PRINCIPAL_HEADER]: o.principal },
      maxPayload: o.maxPayload,
      handshakeTimeout: o.timeoutMs,
      perMessageDeflate: false,
    });
    await new Promise<void>((resolve, reject) => {
      // handshakeTimeout bounds the upgrade only: a broker that stops after it would hold the hello forever.
      const timer = setTimeout(() => fail(`no hello within ${o.timeoutMs} ms`), o.timeoutMs);
      const fail = (why: string) => {
        clearTimeout(timer);
        ws.terminate();
        reject(new HutchError('unavailable', `broker ${o.broker} unreachable: ${why}`, { broker: o.broker, reason: 'unreachable' }));
      };
      ws.once('unexpected-response', (_req, res) => fail(`it answered HTTP ${res.statusCode}`));
      ws.once('error', (err) => fail(err.message));
      ws.once('message', (data: WebSocket.RawData) => {
        try {
          const m = ServerMessageSchema.parse(JSON.parse(String(data)));
          // The broker says whom it took us for: anything but the principal we named is a misconfigured trust.
          if (m.t !== 'hello' || m.principal !== o.principal) throw new Error(`hello for ${m.t === 'hello' ? m.principal : m.t}, not ${o.principal}`);
          clearTimeout(timer);
          ws.removeAllListeners('error');
          resolve();
        } catch (err) {
          fail((err as Error).message);
        }
      });
    });
    ws.binaryType = 'nodebuffer';
    return new Upstream(ws, o.broker, o.binary);
  }

  get open(): boolean {
    return this.closedError === undefined && this.ws.readyState === WebSocket.OPEN;
  }

  get inflight(): number {
    return this.pending.size;
  }

  /** Sends one request; `id` names it for a later signal. Without a deadline it waits as long as the broker takes. */
  request(op: string, p: unknown, sinks: UpstreamSinks = {}, deadline?: Deadline): { id: number; result: Promise<unknown> } {
    const id = this.nextId++;
    if (this.closedError) return { id, result: Promise.reject(this.closedError) };
    const result = new Promise<unknown>((resolve, reject) => {
      const pending: Pending = { resolve, reject, ...sinks };
      if (deadline) {
        const giveUp = () => this.settle(id, new HutchError('unavailable', `broker ${this.broker} did not answer ${op} within ${deadline.ms} ms`, { broker: this.broker, reason: 'timeout', op }));
        pending.timer = setTimeout(giveUp, deadline.ms);
        pending.whileFrames = deadline.whileFrames === true;
      }
      this.pending.set(id, pending);
      const frame = { t: 'req', id, op, p };
      this.ws.send(this.binary ? packr.pack(frame) : JSON.stringify(frame));
    });
    return { id, result };
  }

  /** Ends a request: its answer or error to its caller, its timer stopped; a later frame for it is dropped. */
  private settle(id: number, outcome: { r: unknown } | HutchError): void {
    const p = this.pending.get(id);
    if (!p) return;
    this.pending.delete(id);
    clearTimeout(p.timer);
    this.lastUsed = Date.now();
    if (outcome instanceof HutchError) p.reject(outcome);
    else p.resolve(outcome.r);
  }

  /** A frame of a request with a deadline that runs while it shows life. */
  private alive(p: Pending): void {
    if (p.whileFrames) p.timer?.refresh();
  }

  close(): void {
    this.ws.close();
  }

  private onMessage(data: WebSocket.RawData, isBinary: boolean): void {
    let m;
    try {
      const buf = Array.isArray(data) ? Buffer.concat(data) : Buffer.from(data as ArrayBuffer);
      m = ServerMessageSchema.parse(isBinary ? packr.unpack(buf) : JSON.parse(buf.toString('utf8')));
    } catch {
      return; // a broker bug; the request it belonged to times out with the client
    }
    if (m.t === 'out') {
      const p = this.pending.get(m.call);
      if (p) this.alive(p);
      const sent = p?.out?.(m.fd, typeof m.d === 'string' ? Buffer.from(m.d) : m.d);
      // A client reading slowly: stop reading the broker until it catches up, so its output
      // waits in the broker's socket (which the broker bounds), not in the gateway's memory.
      if (sent instanceof Promise) {
        if (this.waitingSinks++ === 0) this.ws.pause();
        const done = () => {
          if (--this.waitingSinks === 0) this.ws.resume();
        };
        sent.then(done, done);
      }
      return;
    }
    if (m.t === 'evt') {
      const p = this.pending.get(m.call);
      if (p) this.alive(p);
      p?.event?.(m.d);
      return;
    }
    if (m.t !== 'res') return;
    this.settle(m.id, m.e ? HutchError.fromWire(m.e as WireError) : { r: m.r });
  }

  private fail(err: HutchError): void {
    this.closedError ??= err;
    for (const id of [...this.pending.keys()]) this.settle(id, err);
  }
}

/** A broker gone mid-call: the call may or may not have run there; its sessions lived on that node. */
function lost(broker: string, why: string): HutchError {
  return new HutchError('unavailable', `broker ${broker} is unavailable (${why}); its sessions' workspaces live on that node`, { broker, reason: 'connection_lost' });
}
