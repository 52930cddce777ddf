/**
 * The E2B-compatible surface: what the unmodified `e2b` SDK (JS 2.x; the Python SDK speaks
 * the same wire format) calls, served on the broker's own HTTP server.
 *
 *   /e2b/api   the SDK's `apiUrl`: the control plane (sandboxes, pause, connect, timeout)
 *   /e2b/envd  the SDK's `sandboxUrl`: envd, the sandbox named by the E2b-Sandbox-Id header
 *
 * An E2B sandbox is a hutch session. The API key (X-API-KEY) is a hutch token and names a
 * principal, who sees only its own sandboxes: another principal's id answers like a missing
 * one. envd requests carry the per-sandbox access token handed out at create/connect
 * (X-Access-Token), so knowing a sandbox id is not enough to use it. Commands go through
 * the session's normal call path (the router picks the fast path or the VM); file
 * operations run in the broker on the host workspace with the session's own confinement
 * and quota. Sandbox records (template, metadata, envVars, timeouts) live in memory: after
 * a broker restart the sessions remain but are no longer E2B sandboxes.
 */
import { randomBytes, timingSafeEqual } from 'node:crypto';
import { newAccessToken } from './access-token.ts';
import { ApiError } from './api-error.ts';
import { e2bNetwork } from './network.ts';
import type { IncomingMessage, ServerResponse } from 'node:http';
import { constants, type Stats } from 'node:fs';
import type { FileHandle } from 'node:fs/promises';
import { pipeline } from 'node:stream/promises';
import type { Logger } from '../../../guest-agent/src/log.ts';
import { HutchError, toHutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { parseJsonBounded } from '../../../guest-agent/src/protocol/value-shape.ts';
import { openFileAt, readDirAt } from '../../../guest-agent/src/workspace/fd-path.ts';
import { nameFromBytes } from '../../../guest-agent/src/workspace/names.ts';
import { sortSliced } from '../../../guest-agent/src/workspace/sliced-sort.ts';
import { LoopSlicer } from '../../../guest-agent/src/workspace/work-budget.ts';
import type { Principals } from '../api/principals.ts';
import type { SessionManager } from '../sessions/session-manager.ts';
import type { Session, SignalName } from '../sessions/session.ts';
import { ConnectError, requestMessage, ServerStream, unaryError, unaryReply } from './connect-json.ts';
import { PollingWatcher, watchDir } from './watch.ts';
import { ByteBudget } from '../util/byte-budget.ts';
import { SendBudget } from '../api/send-budget.ts';
import { DEFAULT_WS_LIMITS, sendLimits } from '../api/ws-server.ts';
import { readBody as readRequestBody } from '../util/read-body.ts';

/**
 * The envd version reported to the SDK. 0.5.7 switches on octet-stream uploads (served);
 * below 0.6.2, so the SDK does not send file metadata (not kept); at or above 0.4.0, so the
 * SDK sends no default username (there is one user: the sandbox's).
 */
export const ENVD_VERSION = '0.5.7';
const API_PREFIX = '/e2b/api';
const ENVD_PREFIX = '/e2b/envd';
/** E2B's default sandbox lifetime when create names none (seconds). */
const DEFAULT_TIMEOUT_S = 300;
/** Largest timeout a create/connect/timeout may set: E2B's own (24 h, paid tier). */
const MAX_TIMEOUT_S = 24 * 3600;
/** Body limit for API JSON and uploads: the file tools' default file limit plus multipart overhead. */
const MAX_BODY_BYTES = 65 * 1024 * 1024;
/** Upload bodies held at once (ByteBudget): in all, and per principal (two of the largest). */
const BODIES_TOTAL_BYTES = 512 * 1024 * 1024;
const BODIES_PER_PRINCIPAL_BYTES = 2 * MAX_BODY_BYTES;
/** How long an upload waits, unread, for room before it is refused (429). */
const BODY_WAIT_MS = 30_000;
/** Directory watches (streamed and polling) a sandbox may hold at once. */
const MAX_WATCHES = 16;

interface Sandbox {
  id: string;
  principal: string;
  templateID: string;
  metadata: Record<string, string>;
  envVars: Record<string, string>;
  accessToken: string;
  /** The header `e2b-traffic-access-token` that reaches its ports (none when its ports are public). */
  trafficAccessToken: string | undefined;
  /** Its network as asked, echoed in its info. */
  networkEcho: Record<string, unknown>;
  startedAt: Date;
  endAt: Date;
  state: 'running' | 'paused';
  timer: NodeJS.Timeout | undefined;
  /** Commands running now, by the pid handed to the SDK. */
  procs: Map<number, Proc>;
  /** Polling watchers by id; `watches` counts these and the open WatchDir streams. */
  watchers: Map<string, PollingWatcher>;
  watches: number;
}

interface Proc {
  cmd: string;
  args: string[];
  envs: Record<string, string>;
  cwd: string | undefined;
  tag: string | undefined;
  signal: ((sig: SignalName) => Promise<boolean>) | undefined;
  abort: AbortController;
  /** The streams receiving its events: Start's and any Connect's (each leaves when its client goes). */
  watchers: Set<ServerStream>;
  /** Its stdin, when Start asked for one (SendInput writes, CloseStdin ends it). */
  stdin: InputQueue | undefined;
}

/** Bytes sent with SendInput that the command has not read yet; more is refused. */
const MAX_PENDING_STDIN_BYTES = 16 * 1024 * 1024;

/** A command's stdin as an async iterable: SendInput pushes, CloseStdin (or the command's end) ends it. */
class InputQueue implements AsyncIterable<Uint8Array> {
  private chunks: Uint8Array[] = [];
  private pending = 0;
  private ended = false;
  private wake: (() => void) | undefined;

  push(c: Uint8Array): void {
    if (this.ended) throw new ConnectError('failed_precondition', 'stdin is closed');
    if (this.pending + c.length > MAX_PENDING_STDIN_BYTES) throw new ConnectError('resource_exhausted', `more than ${MAX_PENDING_STDIN_BYTES} bytes of stdin not yet read`);
    this.chunks.push(c);
    this.pending += c.length;
    this.wake?.();
  }

  end(): void {
    this.ended = true;
    this.wake?.();
  }

  async *[Symbol.asyncIterator](): AsyncIterator<Uint8Array> {
    for (;;) {
      const c = this.chunks.shift();
      if (c) {
        this.pending -= c.length;
        yield c;
      } else if (this.ended) return;
      else await new Promise<void>((r) => (this.wake = r));
    }
  }
}

function json(res: ServerResponse, status: number, body: unknown, headers: Record<string, string> = {}): void {
  res.writeHead(status, { 'content-type': 'application/json', ...headers }).end(JSON.stringify(body));
}

/** The error body the SDK recognises (it keys "not found" on `code`, not on the status). */
function apiError(res: ServerResponse, status: number, message: string): void {
  json(res, status, { code: status, message });
}

function readBody(req: IncomingMessage, limit = MAX_BODY_BYTES): Promise<Buffer> {
  return readRequestBody(req, limit, (m) => new ApiError(413, m));
}

function stringRecord(v: unknown, what: string): Record<string, string> {
  if (v === undefined || v === null) return {};
  if (typeof v !== 'object' || Array.isArray(v)) throw new ApiError(400, `${what} must be an object of strings`);
  const out: Record<string, string> = {};
  for (const [k, x] of Object.entries(v)) {
    if (typeof x !== 'string') throw new ApiError(400, `${what}.${k} must be a string`);
    out[k] = x;
  }
  return out;
}

function timeoutSeconds(v: unknown, fallback: number): number {
  if (v === undefined || v === null) return fallback;
  if (typeof v !== 'number' || !Number.isInteger(v) || v < 0 || v > MAX_TIMEOUT_S) throw new ApiError(400, `timeout must be an integer number of seconds in 0..${MAX_TIMEOUT_S}`);
  return v;
}

function sameSecret(a: string, b: string): boolean {
  const x = Buffer.from(a);
  const y = Buffer.from(b);
  return x.length === y.length && timingSafeEqual(x, y);
}

/** POSIX single-quoting, for a ProcessConfig that is not E2B's usual `bash -l -c <cmd>`. */
function shellQuote(s: string): string {
  return /^[A-Za-z0-9_./=:@%+-]+$/.test(s) ? s : `'${s.replace(/'/g, `'\\''`)}'`;
}

export class E2bEndpoint {
  private readonly sandboxes = new Map<string, Sandbox>();
  private nextPid = 1000;
  private requestSeq = 0;
  /** Upload bodies the broker holds at once (tests read it). */
  readonly bodies = new ByteBudget(BODIES_TOTAL_BYTES, BODIES_PER_PRINCIPAL_BYTES, 'E2B upload');

  /** Bytes made for clients and not yet taken, shared with the WebSocket API's (per principal). */
  private readonly sendBudget: SendBudget;

  constructor(
    private readonly o: {
      sessions: SessionManager;
      principals: Principals;
      log: Logger;
      send?: SendBudget;
    },
  ) {
    this.sendBudget = o.send ?? new SendBudget(sendLimits(DEFAULT_WS_LIMITS));
  }

  /**
   * A server stream to one of `principal`'s clients, within its send budget: a client that
   * takes none of it for the budget's stall time is cut off (its command goes on, as in envd).
   */
  private stream(res: ServerResponse, principal: string): ServerStream {
    const closed = new AbortController();
    const sender = this.sendBudget.join(principal, {
      pause: () => undefined, // nothing more is read from a server stream's request
      resume: () => undefined,
      close: (why, queuedBytes) => {
        this.o.log.warn(`e2b.send_${why}`, { principal, queuedBytes });
        res.destroy();
      },
      closed: closed.signal,
    });
    res.once('close', () => {
      closed.abort(new HutchError('cancelled', 'the client went away'));
      sender.leave();
    });
    return new ServerStream(res, sender);
  }

  static matches(url: string | undefined): boolean {
    return url !== undefined && (url.startsWith(`${API_PREFIX}/`) || url.startsWith(`${ENVD_PREFIX}/`));
  }

  /** `authenticated` is called once the request's credentials check out (it lifts the connection's handshake deadline). */
  async handle(req: IncomingMessage, res: ServerResponse, authenticated: () => void = () => undefined): Promise<void> {
    const url = new URL(req.url ?? '/', 'http://x');
    try {
      if (url.pathname.startsWith(`${API_PREFIX}/`)) await this.api(req, res, url.pathname.slice(API_PREFIX.length), url.searchParams, authenticated);
      else await this.envd(req, res, url.pathname.slice(ENVD_PREFIX.length), url.searchParams, authenticated);
    } catch (err) {
      // One line per failed request, as the WebSocket API logs its own.
      const key = req.headers['x-api-key'];
      const sandbox = req.headers['e2b-sandbox-id'];
      this.o.log.warn('e2b.failed', {
        req: `e2b:${++this.requestSeq}`,
        route: `${req.method ?? 'GET'} ${url.pathname}`,
        ...(typeof key === 'string' ? { principal: this.o.principals.authenticate(key) ?? '(unknown key)' } : {}),
        ...(typeof sandbox === 'string' ? { session: sandbox.slice(0, 80) } : {}),
        code: err instanceof ApiError ? err.status : err instanceof HutchError ? err.code : 'internal',
        error: (err as Error).message,
      });
      if (res.headersSent) {
        res.destroy();
        return;
      }
      if (err instanceof ApiError) apiError(res, err.status, err.message);
      // A principal at its session limit is E2B's concurrent-sandbox limit: 429, as E2B answers it.
      else if (err instanceof HutchError) apiError(res, err.code === 'not_found' ? 404 : err.code === 'bad_request' ? 400 : err.code === 'quota_exceeded' ? 429 : 500, `${err.code}: ${err.message}`);
      else apiError(res, 500, 'internal error');
    }
  }

  /** Broker shutdown: the timers and watchers go (the sessions are the broker's to release). */
  close(): void {
    for (const sb of this.sandboxes.values()) {
      clearTimeout(sb.timer);
      this.dropWatchers(sb);
    }
    this.sandboxes.clear();
  }

  // ------------------------------------------------------------ control plane

  private async api(req: IncomingMessage, res: ServerResponse, path: string, q: URLSearchParams, authenticated: () => void): Promise<void> {
    const key = req.headers['x-api-key'];
    const principal = this.o.principals.authenticate(typeof key === 'string' ? key : undefined);
    if (principal === undefined) return apiError(res, 401, 'unauthorized: X-API-KEY must be a hutch token');
    authenticated();
    const m = req.method ?? 'GET';
    if (m === 'POST' && (path === '/sandboxes' || path === '/v2/sandboxes')) return this.create(req, res, principal);
    if (m === 'GET' && (path === '/sandboxes' || path === '/v2/sandboxes')) return this.list(res, principal, q, path === '/v2/sandboxes');
    const hit = /^(?:\/v2)?\/sandboxes\/([^/]+)(\/[a-z]+)?$/.exec(path);
    if (!hit) return apiError(res, 404, `not found: ${m} ${path} is not part of the E2B API hutch serves`);
    const sb = this.own(decodeURIComponent(hit[1] as string), principal);
    const action = hit[2];
    if (action === undefined && m === 'GET') return json(res, 200, this.describe(sb));
    if (action === undefined && m === 'DELETE') {
      await this.kill(sb);
      res.writeHead(204).end();
      return;
    }
    if (action === '/network' && m === 'PUT') {
      // E2B replaces the whole configuration; the sandbox's next connections use it.
      const net = e2bNetwork(await this.jsonBody(req));
      try {
        this.o.sessions.setNetwork(sb.id, net.spec ?? 'default', principal);
      } catch (err) {
        if (err instanceof HutchError && err.code === 'bad_request') throw new ApiError(400, err.message);
        throw err;
      }
      sb.networkEcho = { ...net.echo };
      res.writeHead(204).end();
      return;
    }
    if (m !== 'POST') return apiError(res, 405, `method ${m} not allowed on ${path}`);
    const body = await this.jsonBody(req);
    switch (action) {
      case '/pause': {
        if (sb.state === 'paused') return apiError(res, 409, `sandbox ${sb.id} is already paused`);
        sb.state = 'paused';
        clearTimeout(sb.timer);
        for (const p of sb.procs.values()) p.abort.abort(new HutchError('cancelled', 'the sandbox was paused'));
        // The session's lifecycle release: a dirty VM goes into its snapshot slot, the next call wakes it.
        await this.session(sb).vm.release('e2b pause');
        res.writeHead(204).end();
        return;
      }
      case '/connect':
      case '/resume': {
        const was = sb.state;
        sb.state = 'running';
        this.arm(sb, timeoutSeconds(body['timeout'], DEFAULT_TIMEOUT_S));
        // Resumed lazily (the next call wakes it); a prewarm starts the wake now.
        if (was === 'paused') this.session(sb).vm.prewarm();
        return json(res, was === 'paused' ? 201 : 200, this.created(sb));
      }
      case '/timeout':
        this.arm(sb, timeoutSeconds(body['timeout'], DEFAULT_TIMEOUT_S));
        res.writeHead(204).end();
        return;
      case '/refreshes':
        this.arm(sb, timeoutSeconds(body['duration'], DEFAULT_TIMEOUT_S));
        res.writeHead(204).end();
        return;
      default:
        return apiError(res, 404, `not found: POST ${path} is not part of the E2B API hutch serves`);
    }
  }

  private async jsonBody(req: IncomingMessage): Promise<Record<string, unknown>> {
    const raw = await readBody(req, 1024 * 1024);
    if (raw.length === 0) return {};
    try {
      const v = parseJsonBounded(raw.toString('utf8'));
      if (v && typeof v === 'object' && !Array.isArray(v)) return v as Record<string, unknown>;
    } catch (err) {
      if (err instanceof HutchError) throw new ApiError(400, err.message);
      // else answered below
    }
    throw new ApiError(400, 'the body must be a JSON object');
  }

  private async create(req: IncomingMessage, res: ServerResponse, principal: string): Promise<void> {
    const body = await this.jsonBody(req);
    const templateID = typeof body['templateID'] === 'string' && body['templateID'] ? body['templateID'] : 'base';
    const metadata = stringRecord(body['metadata'], 'metadata');
    const envVars = stringRecord(body['envVars'], 'envVars');
    const timeout = timeoutSeconds(body['timeout'], DEFAULT_TIMEOUT_S);
    // E2B's default template is `base` (hutch's own name for it, `default`, the session
    // manager knows); any other name must be a hutch template (`hutch template ls`). A sandbox
    // handed the default image in place of the one asked for would fail later, and less
    // clearly, when a tool its template had is missing.
    const template = templateID === 'base' ? undefined : templateID;
    const net = e2bNetwork(body);
    const s = await this.o.sessions.create({ ...(template ? { template } : {}), ...(net.spec ? { network: net.spec } : {}), ...(net.publicTraffic ? { publicPorts: 'all' as const } : {}) }, principal).catch((err: unknown) => {
      if (template && err instanceof HutchError && err.code === 'unavailable') throw new ApiError(400, `template ${JSON.stringify(template)}: ${err.message}; this broker serves only 'base'`);
      if (err instanceof HutchError && err.code === 'bad_request') throw new ApiError(400, err.message);
      throw err;
    });
    const now = new Date();
    const sb: Sandbox = {
      id: s.id,
      principal,
      templateID,
      metadata,
      envVars,
      accessToken: newAccessToken(principal),
      trafficAccessToken: net.publicTraffic ? undefined : randomBytes(24).toString('hex'),
      networkEcho: net.echo,
      startedAt: now,
      endAt: now,
      state: 'running',
      timer: undefined,
      procs: new Map(),
      watchers: new Map(),
      watches: 0,
    };
    this.sandboxes.set(sb.id, sb);
    this.arm(sb, timeout);
    this.o.log.info('e2b.sandbox_created', { sandbox: sb.id, principal, templateID });
    json(res, 201, this.created(sb));
  }

  private list(res: ServerResponse, principal: string, q: URLSearchParams, paged: boolean): void {
    let all = [...this.sandboxes.values()].filter((sb) => sb.principal === principal && this.alive(sb));
    const states = q.getAll('state').flatMap((s) => s.split(','));
    if (states.length) all = all.filter((sb) => states.includes(sb.state));
    const meta = q.get('metadata');
    if (meta) {
      const want = new URLSearchParams(meta);
      all = all.filter((sb) => [...want.entries()].every(([k, v]) => sb.metadata[decodeURIComponent(k)] === decodeURIComponent(v)));
    }
    all.sort((a, b) => a.startedAt.getTime() - b.startedAt.getTime() || a.id.localeCompare(b.id));
    if (!paged) return json(res, 200, all.map((sb) => this.describe(sb)));
    const limit = Math.min(Math.max(Number(q.get('limit') ?? 100) || 100, 1), 1000);
    // The token is the offset into the (stable) ordering: opaque to the SDK, cheap here.
    const from = Number(q.get('nextToken') ?? 0) || 0;
    const page = all.slice(from, from + limit);
    const headers: Record<string, string> = from + limit < all.length ? { 'x-next-token': String(from + limit) } : {};
    json(res, 200, page.map((sb) => this.describe(sb)), headers);
  }

  /** What create and connect answer. */
  private created(sb: Sandbox): Record<string, unknown> {
    return { sandboxID: sb.id, templateID: sb.templateID, clientID: 'hutch', envdVersion: ENVD_VERSION, envdAccessToken: sb.accessToken, ...(sb.trafficAccessToken ? { trafficAccessToken: sb.trafficAccessToken } : {}), domain: null };
  }

  private describe(sb: Sandbox): Record<string, unknown> {
    const s = this.session(sb);
    return {
      sandboxID: sb.id,
      templateID: sb.templateID,
      clientID: 'hutch',
      startedAt: sb.startedAt.toISOString(),
      endAt: sb.endAt.toISOString(),
      state: sb.state,
      cpuCount: s.meta.cpus,
      memoryMB: s.meta.memoryMiB,
      diskSizeMB: Math.floor(s.quota.limits.bytes / (1024 * 1024)),
      metadata: sb.metadata,
      envdVersion: ENVD_VERSION,
      ...sb.networkEcho,
    };
  }

  /**
   * The principal whose sandbox `session` is, when `token` is its E2B traffic access token
   * (the credential E2B's port traffic carries); undefined otherwise. Constant time.
   */
  trafficPrincipal(session: string, token: string): string | undefined {
    const sb = this.sandboxes.get(session);
    if (!sb?.trafficAccessToken || !this.alive(sb)) return undefined;
    const a = Buffer.from(token);
    const b = Buffer.from(sb.trafficAccessToken);
    return a.length === b.length && timingSafeEqual(a, b) ? sb.principal : undefined;
  }

  /** The sandbox as this principal may see it: another principal's answers exactly like a missing one. */
  private own(id: string, principal: string): Sandbox {
    const sb = this.sandboxes.get(id);
    if (!sb || sb.principal !== principal || !this.alive(sb)) throw new ApiError(404, `sandbox ${id} not found`);
    return sb;
  }

  /** False once its session is gone (closed over the harness API, say): the record goes too. */
  private alive(sb: Sandbox): boolean {
    try {
      this.o.sessions.get(sb.id, sb.principal);
      return true;
    } catch {
      clearTimeout(sb.timer);
      this.sandboxes.delete(sb.id);
      return false;
    }
  }

  private session(sb: Sandbox): Session {
    return this.o.sessions.get(sb.id, sb.principal);
  }

  /** E2B's lifetime: a running sandbox is killed at endAt; pause stops the clock. */
  private arm(sb: Sandbox, seconds: number): void {
    clearTimeout(sb.timer);
    sb.endAt = new Date(Date.now() + seconds * 1000);
    sb.timer = setTimeout(() => {
      if (sb.state === 'running') void this.kill(sb).catch((err: unknown) => this.o.log.warn('e2b.timeout_kill_failed', { sandbox: sb.id, error: (err as Error).message }));
    }, seconds * 1000);
    sb.timer.unref();
  }

  private async kill(sb: Sandbox): Promise<void> {
    clearTimeout(sb.timer);
    this.sandboxes.delete(sb.id);
    this.dropWatchers(sb);
    await this.o.sessions.close(sb.id, false, sb.principal);
    this.o.log.info('e2b.sandbox_killed', { sandbox: sb.id });
  }

  // ------------------------------------------------------------ envd

  private async envd(req: IncomingMessage, res: ServerResponse, path: string, q: URLSearchParams, authenticated: () => void): Promise<void> {
    const id = req.headers['e2b-sandbox-id'];
    const token = req.headers['x-access-token'];
    const sb = typeof id === 'string' ? this.sandboxes.get(id) : undefined;
    // A missing sandbox, a gone one and a wrong access token answer alike (E2B's proxy says 502
    // for a sandbox that is not running; the SDK reads that as "not running anymore").
    if (!sb || typeof token !== 'string' || !sameSecret(token, sb.accessToken) || !this.alive(sb)) return apiError(res, 502, 'sandbox not found or not running');
    authenticated();
    if (sb.state === 'paused' && path !== '/health') {
      // Used while paused: resumed, as E2B's autoResume does (hutch wakes it on the call anyway).
      sb.state = 'running';
      this.arm(sb, DEFAULT_TIMEOUT_S);
    }
    const s = this.session(sb);
    const m = req.method ?? 'GET';
    if (path === '/health') {
      res.writeHead(204).end();
      return;
    }
    if (path === '/files' && m === 'GET') return this.download(res, s, q.get('path') ?? '');
    if (path === '/files' && m === 'POST') return this.upload(req, res, s, q.get('path') ?? undefined, sb.principal);
    if (m !== 'POST') return apiError(res, 404, `not found: ${m} ${path}`);
    const rpc = path.slice(1);
    if (rpc === 'process.Process/Start') return this.start(req, res, sb, s);
    if (rpc === 'process.Process/Connect') return this.connect(req, res, sb);
    if (rpc === 'filesystem.Filesystem/WatchDir') return this.watchStream(req, res, sb, s);
    let msg: Record<string, unknown>;
    try {
      msg = requestMessage(req, await readBody(req, 1024 * 1024));
      unaryReply(res, await this.unary(rpc, msg, sb, s));
    } catch (err) {
      if (err instanceof ApiError) throw err;
      unaryError(res, err);
    }
  }

  private async unary(rpc: string, msg: Record<string, unknown>, sb: Sandbox, s: Session): Promise<unknown> {
    const path = (k = 'path'): string => {
      const v = msg[k];
      if (typeof v !== 'string' || v === '') throw new ConnectError('invalid_argument', `${k} is required`);
      return v;
    };
    switch (rpc) {
      case 'filesystem.Filesystem/Stat':
        return { entry: await this.entry(s, path()) };
      case 'filesystem.Filesystem/MakeDir': {
        await s.quota.current(); // mkdir plans its new directories against the quota
        const r = await this.changing(s, () => s.files.mkdir({ path: path(), parents: true }));
        if (!r.created) throw new ConnectError('already_exists', `${path()} already exists`);
        s.vm.hostChanges.mark(r.path);
        return { entry: await this.entry(s, path()) };
      }
      case 'filesystem.Filesystem/Move': {
        const r = await this.changing(s, () => s.files.move({ from: path('source'), to: path('destination'), overwrite: true }));
        s.vm.hostChanges.mark(r.from);
        s.vm.hostChanges.mark(r.to);
        return { entry: await this.entry(s, path('destination')) };
      }
      case 'filesystem.Filesystem/Remove': {
        const r = await this.changing(s, () => s.files.remove({ path: path(), recursive: true }));
        s.vm.hostChanges.mark(r.path);
        return {};
      }
      case 'filesystem.Filesystem/ListDir': {
        const depth = typeof msg['depth'] === 'number' && msg['depth'] > 0 ? Math.min(msg['depth'], 16) : 1;
        const entries: unknown[] = [];
        // An entry is a confined open and a stat, all synchronous: a 200,000-entry listing
        // would hold the loop for seconds without a turn between entries.
        const slicer = new LoopSlicer();
        await this.listInto(s, path(), depth, entries, () => slicer.tick());
        return { entries };
      }
      case 'filesystem.Filesystem/CreateWatcher': {
        this.reserveWatch(sb);
        try {
          const w = await PollingWatcher.start(s, path(), msg['recursive'] === true);
          const watcherId = randomBytes(8).toString('hex');
          sb.watchers.set(watcherId, w);
          return { watcherId };
        } catch (err) {
          sb.watches--;
          throw err;
        }
      }
      case 'filesystem.Filesystem/GetWatcherEvents':
        return { events: this.watcher(sb, msg).take() };
      case 'filesystem.Filesystem/RemoveWatcher': {
        const w = this.watcher(sb, msg);
        sb.watchers.delete(msg['watcherId'] as string);
        sb.watches--;
        await w.close();
        return {};
      }
      case 'process.Process/List':
        return {
          processes: [...sb.procs.entries()].map(([pid, p]) => ({ pid, config: { cmd: p.cmd, args: p.args, envs: p.envs, ...(p.cwd ? { cwd: p.cwd } : {}) }, ...(p.tag ? { tag: p.tag } : {}) })),
        };
      case 'process.Process/SendInput': {
        const p = this.proc(sb, msg);
        const data = (msg['input'] as { stdin?: unknown } | undefined)?.stdin;
        if (!p.stdin) throw new ConnectError('failed_precondition', 'the process was started without stdin (start it with stdin: true)');
        if (typeof data !== 'string') throw new ConnectError('invalid_argument', 'input.stdin (base64) is required; pty input is not supported');
        p.stdin.push(Buffer.from(data, 'base64'));
        return {};
      }
      case 'process.Process/CloseStdin': {
        const p = this.proc(sb, msg);
        p.stdin?.end();
        return {};
      }
      case 'process.Process/SendSignal': {
        const p = this.proc(sb, msg);
        const sig = msg['signal'] === 'SIGNAL_SIGTERM' || msg['signal'] === 15 ? 'SIGTERM' : 'SIGKILL';
        if (p.signal) await p.signal(sig);
        // Not started yet (queued behind another call): dropping it is the kill.
        else p.abort.abort(new HutchError('cancelled', `killed by ${sig} before it started`));
        return {};
      }
      default:
        throw new ConnectError('unimplemented', `${rpc} is not implemented by hutch's envd (see the README's E2B table)`);
    }
  }

  private reserveWatch(sb: Sandbox): void {
    if (sb.watches >= MAX_WATCHES) throw new ConnectError('resource_exhausted', `a sandbox holds at most ${MAX_WATCHES} directory watches`);
    sb.watches++;
  }

  private watcher(sb: Sandbox, msg: Record<string, unknown>): PollingWatcher {
    const w = typeof msg['watcherId'] === 'string' ? sb.watchers.get(msg['watcherId']) : undefined;
    if (!w) throw new ConnectError('not_found', `no watcher ${JSON.stringify(msg['watcherId'])}`);
    return w;
  }

  private dropWatchers(sb: Sandbox): void {
    for (const w of sb.watchers.values()) void w.close();
    sb.watchers.clear();
  }

  /** Filesystem.WatchDir: a start event, then the directory's events until the client goes. */
  private async watchStream(req: IncomingMessage, res: ServerResponse, sb: Sandbox, s: Session): Promise<void> {
    let close: (() => Promise<void>) | undefined;
    let stream: ServerStream | undefined;
    try {
      const msg = requestMessage(req, await readBody(req, 1024 * 1024));
      const path = msg['path'];
      if (typeof path !== 'string' || !path) throw new ConnectError('invalid_argument', 'path is required');
      this.reserveWatch(sb);
      try {
        close = await watchDir(
          s,
          path,
          msg['recursive'] === true,
          (e) => stream?.post({ filesystem: e }, () => this.o.log.warn('e2b.stream_full', { sandbox: sb.id, path })),
          (e) => stream?.end(e),
        );
      } catch (err) {
        sb.watches--;
        throw err;
      }
    } catch (err) {
      if (err instanceof ApiError) throw err;
      return new ServerStream(res).end(err);
    }
    const open = this.stream(res, sb.principal);
    stream = open;
    open.post({ start: {} }, () => undefined);
    const keepalive = setInterval(() => open.post({ keepalive: {} }, () => undefined), 30_000);
    keepalive.unref();
    res.on('close', () => {
      clearInterval(keepalive);
      sb.watches--;
      void close?.();
    });
  }

  private proc(sb: Sandbox, msg: Record<string, unknown>): Proc {
    const sel = (msg['process'] ?? {}) as { pid?: unknown; tag?: unknown };
    for (const [pid, p] of sb.procs) if (pid === sel.pid || (sel.tag !== undefined && p.tag === sel.tag)) return p;
    throw new ConnectError('not_found', `no process ${JSON.stringify(sel.pid ?? sel.tag)}`);
  }

  /** A file operation that changes the workspace (ordered against a fast-path git run): its usage is measured again afterwards. */
  private async changing<T>(s: Session, fn: () => Promise<T>): Promise<T> {
    try {
      return await s.writing(fn);
    } finally {
      s.quota.stale();
    }
  }

  /** E2B's EntryInfo for a workspace path (absolute paths are /work/...). */
  private async entry(s: Session, path: string): Promise<Record<string, unknown>> {
    const r = s.files.ws.open(path, { followFinal: false });
    try {
      const st = r.stat as Stats;
      const rel = r.rel;
      const abs = rel === '' ? s.files.ws.mountPoint : `${s.files.ws.mountPoint}/${rel}`;
      const type = st.isDirectory() ? 'FILE_TYPE_DIRECTORY' : st.isSymbolicLink() ? 'FILE_TYPE_SYMLINK' : 'FILE_TYPE_FILE';
      return {
        name: rel === '' ? '' : (rel.split('/').pop() as string),
        type,
        path: abs,
        size: String(st.size),
        mode: st.mode & 0o7777,
        permissions: permissions(st),
        owner: 'user',
        group: 'user',
        modifiedTime: st.mtime.toISOString(),
      };
    } catch (err) {
      throw ConnectError.from(err);
    } finally {
      r.close();
    }
  }

  private async listInto(s: Session, path: string, depth: number, out: unknown[], tick: () => Promise<void>): Promise<void> {
    const r = s.files.ws.open(path);
    let names: Iterable<string>;
    try {
      if (!r.stat?.isDirectory()) throw new ConnectError('invalid_argument', `${path} is not a directory`);
      names = await sortSliced((await readDirAt(r.openDir())).map((d) => nameFromBytes(d.name)), (n) => n, tick);
    } catch (err) {
      throw ConnectError.from(err);
    } finally {
      r.close();
    }
    for (const n of names) {
      await tick();
      const child = `${path.replace(/\/+$/, '')}/${n}`;
      const e = await this.entry(s, child);
      out.push(e);
      if (depth > 1 && e['type'] === 'FILE_TYPE_DIRECTORY') await this.listInto(s, child, depth - 1, out, tick);
    }
  }

  /**
   * Streams the file from the fd opened under confinement, at the pace the client reads it:
   * the broker holds one read buffer, not the file. (It read whole files into memory, so ten
   * concurrent downloads of a 1.9 GB workspace file would have held 19 GB, and a file above
   * 2 GiB could not be read at all.)
   */
  private async download(res: ServerResponse, s: Session, path: string): Promise<void> {
    if (!path) return apiError(res, 400, 'path is required');
    let fh: FileHandle;
    let size: number;
    let ino: number;
    try {
      const r = s.files.ws.open(path, { followFinal: true });
      try {
        if (!r.stat) throw new HutchError('not_found', `no such file: ${path}`);
        if (r.stat.isDirectory()) throw new HutchError('is_a_directory', `${path} is a directory`);
        ino = r.stat.ino;
        // O_NONBLOCK: a FIFO put there since the stat cannot hold the open; fstat refuses it.
        fh = await openFileAt(r.dirFd, r.name, constants.O_RDONLY | constants.O_NONBLOCK);
      } finally {
        r.close();
      }
      const st = await fh.stat().catch(async (err: unknown) => {
        await fh.close();
        throw err;
      });
      if (!st.isFile() || st.ino !== ino) {
        await fh.close();
        throw new HutchError('bad_request', `${path} is not a regular file (or changed while being opened)`);
      }
      size = st.size;
    } catch (err) {
      const e = err instanceof HutchError ? err : toHutchError(err, { path });
      return apiError(res, e.code === 'not_found' ? 404 : e.code === 'outside_workspace' || e.code === 'permission_denied' ? 403 : 400, `${e.code}: ${e.message}`);
    }
    res.writeHead(200, { 'content-type': 'application/octet-stream', 'content-length': String(size) });
    if (size === 0) {
      await fh.close();
      res.end();
      return;
    }
    // The length fstat gave: a file growing meanwhile does not overrun content-length.
    await pipeline(fh.createReadStream({ start: 0, end: size - 1 }), res).catch(() => res.destroy());
  }

  private async upload(req: IncomingMessage, res: ServerResponse, s: Session, path: string | undefined, principal: string): Promise<void> {
    // The body is held whole (multipart is parsed from memory): its room first, or wait unread.
    const declared = Number(req.headers['content-length'] ?? NaN);
    const release = await this.bodies
      .reserve(Number.isFinite(declared) && declared >= 0 ? Math.min(declared, MAX_BODY_BYTES) : MAX_BODY_BYTES, principal, BODY_WAIT_MS)
      .catch((err: unknown) => {
        throw new ApiError(429, (err as Error).message);
      });
    try {
      await this.uploadHeld(req, res, s, path);
    } finally {
      release();
    }
  }

  private async uploadHeld(req: IncomingMessage, res: ServerResponse, s: Session, path: string | undefined): Promise<void> {
    const body = await readBody(req);
    const type = req.headers['content-type'] ?? '';
    const files: Array<{ path: string; data: Buffer }> = [];
    if (type.startsWith('multipart/form-data')) {
      // The web platform's own multipart parser (undici's, in Node).
      const form = await new Request('http://x/', { method: 'POST', headers: { 'content-type': type }, body }).formData();
      const parts = form.getAll('file');
      for (const p of parts) {
        if (typeof p === 'string') throw new ApiError(400, 'a multipart "file" part must be a file');
        const target = parts.length === 1 && path ? path : p.name || path;
        if (!target) throw new ApiError(400, 'each file needs a path (the part filename or ?path=)');
        files.push({ path: target, data: Buffer.from(await p.arrayBuffer()) });
      }
    } else {
      if (!path) throw new ApiError(400, 'path is required');
      files.push({ path, data: body });
    }
    if (files.length === 0) throw new ApiError(400, 'no file in the request');
    const out: unknown[] = [];
    try {
      await s.quota.current(); // writes are planned against the quota
      for (const f of files) {
        const r = await this.changing(s, () => s.files.write({ path: f.path, content: f.data }));
        s.vm.hostChanges.mark(r.path);
        out.push({ name: r.path.split('/').pop(), type: 'file', path: `${s.files.ws.mountPoint}/${r.path}` });
      }
    } catch (err) {
      const e = err instanceof HutchError ? err : new HutchError('internal', (err as Error).message);
      const status = e.code === 'quota_exceeded' || e.code === 'no_space' ? 507 : e.code === 'too_large' ? 413 : e.code === 'outside_workspace' || e.code === 'permission_denied' ? 403 : 400;
      return apiError(res, status, `${e.code}: ${e.message}`);
    }
    json(res, 200, out);
  }

  /** process.Process/Start: a server stream of start, data... and end events around one call. */
  private async start(req: IncomingMessage, res: ServerResponse, sb: Sandbox, s: Session): Promise<void> {
    let msg: Record<string, unknown>;
    try {
      msg = requestMessage(req, await readBody(req, 2 * 1024 * 1024));
    } catch (err) {
      if (err instanceof ApiError) throw err;
      return unaryError(res, err);
    }
    const cfg = (msg['process'] ?? {}) as { cmd?: unknown; args?: unknown; envs?: unknown; cwd?: unknown };
    const stream = this.stream(res, sb.principal);
    if (msg['pty'] !== undefined) return stream.end(new ConnectError('unimplemented', 'pty is not supported'));
    if (typeof cfg.cmd !== 'string' || !cfg.cmd) return stream.end(new ConnectError('invalid_argument', 'process.cmd is required'));
    const args = Array.isArray(cfg.args) ? cfg.args.map(String) : [];
    const envs = (() => {
      try {
        return stringRecord(cfg.envs, 'envs');
      } catch (err) {
        return err as Error;
      }
    })();
    if (envs instanceof Error) return stream.end(new ConnectError('invalid_argument', envs.message));
    const cwd = typeof cfg.cwd === 'string' && cfg.cwd ? cfg.cwd : undefined;
    // E2B runs `bash -l -c <cmd>`: the command is <cmd>, run by hutch's own shell.
    const script = cfg.cmd.endsWith('bash') && args.length === 3 && args[0] === '-l' && args[1] === '-c' ? (args[2] as string) : [cfg.cmd, ...args].map(shellQuote).join(' ');
    // Commands start in the workspace; a cwd inside it is taken relative to it, so it means
    // the same directory on every route (the fast path and backends mount it in different places).
    const mp = s.files.ws.mountPoint;
    const dir = cwd === undefined || cwd === mp || cwd === `${mp}/` ? undefined : cwd.startsWith(`${mp}/`) ? cwd.slice(mp.length + 1) : cwd;
    const command = dir ? `cd ${shellQuote(dir)} && ${script}` : script;
    const pid = this.nextPid++;
    const proc: Proc = { cmd: cfg.cmd, args, envs, cwd, tag: typeof msg['tag'] === 'string' ? msg['tag'] : undefined, signal: undefined, abort: new AbortController(), watchers: new Set(), stdin: msg['stdin'] === true ? new InputQueue() : undefined };
    sb.procs.set(pid, proc);
    // As in envd, the client going away does not end the command (the SDK's disconnect(), then
    // commands.connect(pid)); it runs to its end, its timeout or a SendSignal.
    this.watch(proc, pid, res, stream);
    // Output waits for the slowest watcher to have room (so the command is not drained past
    // what they take); a watcher that takes nothing for the stall time is cut off.
    const fan = (ev: unknown): Promise<void> => Promise.all([...proc.watchers].map((w) => w.send(ev).catch(() => undefined))).then(() => undefined);
    const keepalive = setInterval(() => {
      for (const w of proc.watchers) w.post({ event: { keepalive: {} } }, () => this.o.log.warn('e2b.stream_full', { sandbox: sb.id, pid }));
    }, 30_000);
    keepalive.unref();
    const timeoutHeader = Number(req.headers['connect-timeout-ms'] ?? 0);
    try {
      const r = await s.call(
        'bash',
        { command, env: { ...sb.envVars, ...envs }, ...(timeoutHeader > 0 ? { timeout: timeoutHeader } : {}) },
        {
          signal: proc.abort.signal,
          onSignalable: (send) => (proc.signal = send),
          ...(proc.stdin ? { stdin: proc.stdin } : {}),
          onStdout: (c) => fan({ event: { data: { stdout: Buffer.from(c).toString('base64') } } }),
          onStderr: (c) => fan({ event: { data: { stderr: Buffer.from(c).toString('base64') } } }),
        },
      );
      const b = r.result as { exitCode: number | null; signal?: string | null; timedOut?: boolean };
      const exitCode = b.exitCode ?? -1;
      const status = b.timedOut ? 'timeout' : b.signal ? `signal: ${b.signal}` : `exit status ${exitCode}`;
      void fan({ event: { end: { exitCode, exited: b.exitCode !== null, status, ...(b.timedOut ? { error: 'command timed out' } : {}) } } });
      for (const w of proc.watchers) w.end();
    } catch (err) {
      for (const w of proc.watchers) w.end(err);
    } finally {
      clearInterval(keepalive);
      proc.stdin?.end();
      sb.procs.delete(pid);
    }
  }

  /** process.Process/Connect: a running command's events from now on (what it printed before is not replayed). */
  private async connect(req: IncomingMessage, res: ServerResponse, sb: Sandbox): Promise<void> {
    let proc: Proc;
    let pid: number;
    try {
      const msg = requestMessage(req, await readBody(req, 1024 * 1024));
      proc = this.proc(sb, msg);
      pid = [...sb.procs.entries()].find(([, p]) => p === proc)?.[0] as number;
    } catch (err) {
      if (err instanceof ApiError) throw err;
      // A server-streaming call answers its errors in the stream's end envelope.
      return new ServerStream(res).end(err);
    }
    this.watch(proc, pid, res, this.stream(res, sb.principal));
  }

  /** Opens a stream on `res` for a process's events, starting with its start event. */
  private watch(proc: Proc, pid: number, res: ServerResponse, stream: ServerStream): ServerStream {
    stream.send({ event: { start: { pid } } }).catch(() => undefined);
    proc.watchers.add(stream);
    res.on('close', () => proc.watchers.delete(stream));
    return stream;
  }
}

function permissions(st: Stats): string {
  const t = st.isDirectory() ? 'd' : st.isSymbolicLink() ? 'l' : '-';
  let p = '';
  for (let i = 8; i >= 0; i--) p += st.mode & (1 << i) ? 'rwx'[(8 - i) % 3] : '-';
  return t + p;
}
