/**
 * The E2B surface through a gateway: an HTTP reverse proxy by sandbox id. A sandbox is a
 * session, so the catalog already says which broker holds it.
 *
 *   /e2b/api    the API key (a hutch token) is checked here and names the principal; a create
 *               is placed like any session and recorded once the broker named its id; a call
 *               on one sandbox goes to its broker (another principal's answers 404, as a
 *               missing one); the list is every live broker's.
 *   /e2b/envd   routed by the E2b-Sandbox-Id header; the per-sandbox access token is checked
 *               by the broker that issued it (the gateway never sees the sandbox records).
 *
 * Requests and answers are streamed through (envd's Connect streams included); the broker
 * applies its own body limits and keys. Sandbox records live in their broker's memory, as
 * without a gateway.
 */
import { request, type IncomingMessage, type ServerResponse } from 'node:http';
import { Agent } from 'node:http';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import type { Principals } from '../api/principals.ts';
import { AttachParams } from '../api/harness-protocol.ts';
import { sessionIdOf, type BrokerRecord, type SessionEntry } from '../catalog/catalog.ts';
import { httpUrlOf } from './placement.ts';
import { principalOfAccessToken } from '../e2b/access-token.ts';

export interface E2bProxyDeps {
  principals: Principals;
  log: Logger;
  /** The placement of a principal's session (undefined: none). */
  session(principal: string, id: string): Promise<SessionEntry | undefined>;
  /** Its broker if registered, else throws `unavailable` naming it. */
  brokerFor(entry: SessionEntry, session: string): Promise<BrokerRecord>;
  /** A broker for a new session. */
  place(): Promise<BrokerRecord>;
  claim(session: string, entry: SessionEntry): Promise<boolean>;
  release(session: string, entry: SessionEntry): Promise<void>;
  liveBrokers(): Promise<BrokerRecord[]>;
  /** What each broker gets to answer the list, asked of every one, before the list goes without it. */
  fanOutMs: number;
}

const agent = new Agent({ keepAlive: true, maxSockets: 64 });
/** Largest create or list answer read whole (they are small JSON). */
const MAX_JSON_ANSWER = 4 * 1024 * 1024;

export class E2bProxy {
  constructor(private readonly d: E2bProxyDeps) {}

  async handle(req: IncomingMessage, res: ServerResponse, authenticated: () => void): Promise<void> {
    const url = new URL(req.url ?? '/', 'http://x');
    try {
      if (url.pathname.startsWith('/e2b/envd/')) await this.envd(req, res, authenticated);
      else await this.api(req, res, url, authenticated);
    } catch (err) {
      if (res.headersSent) {
        res.destroy();
        return;
      }
      const e = err instanceof HutchError ? err : new HutchError('internal', (err as Error).message);
      const status = e.code === 'not_found' ? 404 : e.code === 'bad_request' ? 400 : e.code === 'unavailable' ? 502 : 500;
      res.writeHead(status, { 'content-type': 'application/json' }).end(JSON.stringify({ code: status, message: `${e.code}: ${e.message}` }));
    }
  }

  private async envd(req: IncomingMessage, res: ServerResponse, authenticated: () => void): Promise<void> {
    // Who asks is not known until the broker checks the access token, so every miss here answers
    // as the broker does for a missing sandbox or a wrong token: which ids exist is not told.
    const notFound = () => res.writeHead(502, { 'content-type': 'application/json' }).end(JSON.stringify({ code: 502, message: 'sandbox not found or not running' }));
    const raw = req.headers['e2b-sandbox-id'];
    const id = typeof raw === 'string' && AttachParams.shape.session.safeParse(raw).success ? raw : undefined;
    // The access token says whose sandbox it claims to be (the catalog is keyed by principal);
    // a false claim routes to a broker that then refuses the token.
    const principal = principalOfAccessToken(req.headers['x-access-token']);
    const entry = id === undefined || principal === undefined ? undefined : await this.d.session(principal, id);
    const rec = entry && id ? await this.d.brokerFor(entry, id).catch(() => undefined) : undefined;
    if (!rec) return void notFound();
    // The broker checks the access token; once it accepted the request, a long stream is no stray socket.
    await this.pipe(req, res, rec, (status) => {
      if (status < 400) authenticated();
    });
  }

  private async api(req: IncomingMessage, res: ServerResponse, url: URL, authenticated: () => void): Promise<void> {
    const key = req.headers['x-api-key'];
    const principal = this.d.principals.authenticate(typeof key === 'string' ? key : undefined);
    if (principal === undefined) {
      res.writeHead(401, { 'content-type': 'application/json' }).end(JSON.stringify({ code: 401, message: 'unauthorized: X-API-KEY must be a hutch token' }));
      return;
    }
    authenticated();
    const path = url.pathname.slice('/e2b/api'.length);
    const m = req.method ?? 'GET';
    if (path === '/sandboxes' || path === '/v2/sandboxes') {
      if (m === 'POST') return this.create(req, res, principal);
      if (m === 'GET') return this.list(req, res, url);
    }
    const hit = /^(?:\/v2)?\/sandboxes\/([^/]+)(\/[a-z]+)?$/.exec(path);
    if (!hit) {
      // Not a sandbox's path: any broker answers it (404 for what hutch does not serve).
      await this.pipe(req, res, (await this.d.liveBrokers())[0] ?? noBroker());
      return;
    }
    const id = sessionIdOf(decodeURIComponent(hit[1] as string));
    const entry = await this.d.session(principal, id);
    // Another principal's sandbox answers exactly like a missing one.
    if (!entry) throw new HutchError('not_found', `no sandbox ${id}`);
    const rec = await this.d.brokerFor(entry, id);
    if (m === 'DELETE' && hit[2] === undefined) {
      // A kill: the placement is forgotten before the client hears it is done.
      const answer = await this.exchange(req, rec, req);
      if (answer.status < 300) await this.d.release(id, entry);
      res.writeHead(answer.status, answer.headers).end(answer.body);
      return;
    }
    await this.pipe(req, res, rec);
  }

  /** Placed like a harness's create; the broker names the id, which is then recorded (SET NX: ids are random, never reused). */
  private async create(req: IncomingMessage, res: ServerResponse, principal: string): Promise<void> {
    const rec = await this.d.place();
    const { status, headers, body } = await this.exchange(req, rec, req);
    if (status < 300) {
      const id = (JSON.parse(body.toString('utf8')) as { sandboxID?: unknown }).sandboxID;
      if (typeof id !== 'string' || !(await this.d.claim(sessionIdOf(id), { broker: rec.id, principal }))) {
        throw new HutchError('internal', `broker ${rec.id} answered a create without a new sandbox id`);
      }
    }
    res.writeHead(status, headers).end(body);
  }

  /**
   * Every live broker's list (each broker's first page; the gateway does not page across
   * brokers), each within the fan-out deadline; brokers missing from it are named in the
   * `x-hutch-unavailable` header (E2B's answer is a bare array).
   */
  private async list(req: IncomingMessage, res: ServerResponse, url: URL): Promise<void> {
    const brokers = await this.d.liveBrokers();
    const answers = await Promise.all(brokers.map((b) => this.exchange(req, b, undefined, this.d.fanOutMs).catch(() => undefined)));
    const items: unknown[] = [];
    const missing: string[] = [];
    answers.forEach((a, i) => {
      if (a && a.status === 200) items.push(...(JSON.parse(a.body.toString('utf8')) as unknown[]));
      else missing.push((brokers[i] as BrokerRecord).id);
    });
    const limit = Number(url.searchParams.get('limit') ?? 0);
    const out = limit > 0 ? items.slice(0, limit) : items;
    res.writeHead(200, { 'content-type': 'application/json', ...(missing.length ? { 'x-hutch-unavailable': missing.join(',') } : {}) }).end(JSON.stringify(out));
  }

  /** Streams one request to a broker and its answer back; resolves with the status. */
  private pipe(req: IncomingMessage, res: ServerResponse, rec: BrokerRecord, onStatus?: (status: number) => void): Promise<number> {
    return new Promise((resolve, reject) => {
      const up = request(`${httpUrlOf(rec.url)}${req.url ?? '/'}`, { method: req.method ?? 'GET', headers: forwardHeaders(req), agent }, (ur) => {
        const status = ur.statusCode ?? 502;
        onStatus?.(status);
        res.writeHead(status, ur.headers);
        ur.pipe(res);
        ur.once('end', () => resolve(status));
        ur.once('error', reject);
      });
      up.once('error', (err) => reject(unreachable(rec, err)));
      // The client went away: so does the broker's side of it.
      res.once('close', () => up.destroy());
      req.pipe(up);
    });
  }

  /** One request answered whole (small JSON answers), its body from `body` if given; within `deadlineMs` if given. */
  private exchange(req: IncomingMessage, rec: BrokerRecord, body?: IncomingMessage, deadlineMs?: number): Promise<{ status: number; headers: Record<string, string | string[] | undefined>; body: Buffer }> {
    return new Promise((resolve, reject) => {
      const timer = deadlineMs === undefined ? undefined : setTimeout(() => up.destroy(new Error(`no answer within ${deadlineMs} ms`)), deadlineMs);
      const up = request(`${httpUrlOf(rec.url)}${req.url ?? '/'}`, { method: req.method ?? 'GET', headers: forwardHeaders(req), agent }, (ur) => {
        const chunks: Buffer[] = [];
        let size = 0;
        ur.on('data', (c: Buffer) => {
          size += c.length;
          if (size > MAX_JSON_ANSWER) up.destroy(new Error('answer too large'));
          else chunks.push(c);
        });
        ur.once('end', () => {
          clearTimeout(timer);
          const headers = { ...ur.headers };
          delete headers['content-length'];
          delete headers['transfer-encoding'];
          resolve({ status: ur.statusCode ?? 502, headers, body: Buffer.concat(chunks) });
        });
        ur.once('error', reject);
      });
      up.once('error', (err) => {
        clearTimeout(timer);
        reject(unreachable(rec, err));
      });
      if (body) body.pipe(up);
      else up.end();
    });
  }
}

function forwardHeaders(req: IncomingMessage): Record<string, string | string[]> {
  const out: Record<string, string | string[]> = {};
  for (const [k, v] of Object.entries(req.headers)) if (v !== undefined && k !== 'host' && k !== 'connection') out[k] = v;
  return out;
}

function unreachable(rec: BrokerRecord, err: Error): HutchError {
  return new HutchError('unavailable', `broker ${rec.id} cannot be reached: ${err.message}`, { broker: rec.id });
}

function noBroker(): never {
  throw new HutchError('unavailable', 'no live broker');
}
