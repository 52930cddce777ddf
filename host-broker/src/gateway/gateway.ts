/**
 * `hutch gateway`: a stateless front for many brokers. It serves the same harness WebSocket
 * API (the same WsServer: token check, connection caps, back-pressure, frame parsing) and
 * forwards each request to the broker that owns its session, found in the catalog.
 *
 * Routing is by the `session` field of a request's params, whatever the op: an op added to
 * the protocol later is forwarded without a change here. `create` is placed (sampled load,
 * template); `sessions` and `telemetry` without a session are asked of every live broker; any
 * other op without a session has no broker to go to and is refused. The E2B surface is
 * proxied by sandbox id (e2b-proxy.ts).
 *
 * Failure semantics:
 * - a gateway dies: it held nothing; a client reconnects to another and attaches by id.
 * - a broker dies: calls to its sessions answer `unavailable` naming it (their workspaces
 *   lived on that node); new sessions stop going there once its lease has expired.
 * - a broker drains: it deregisters at once and answers new work with `unavailable`
 *   (reason `draining`); when it starts again with the same id its sessions answer again.
 */
import { readFileSync } from 'node:fs';
import type { IncomingMessage, Server, ServerResponse } from 'node:http';
import { Counter, Gauge, Registry } from 'prom-client';
import { HutchError, toHutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import { HARNESS_API_VERSION, opParams, TELEMETRY_SAMPLE_TIMEOUT_MS, type OpName, type SessionsResult, type SignalResult, type TelemetryResult } from '../api/harness-protocol.ts';
import type { SignalSchema } from '../../../guest-agent/src/protocol/methods.ts';
import type { z } from 'zod';
import type { Principals } from '../api/principals.ts';
import { WsServer, bearer, DEFAULT_WS_LIMITS, type OpContext, type WsLimits } from '../api/ws-server.ts';
import { loopbackUrl, McpHttpEndpoint } from '../mcp/http.ts';
import { ownHostNames, type McpHttpAllowed } from '../mcp/http-origin.ts';
import { E2bEndpoint } from '../e2b/endpoint.ts';
import { listenMetrics } from '../metrics.ts';
import { Catalog, sessionIdOf, type BrokerRecord, type SessionEntry } from '../catalog/catalog.ts';
import { GatewayCredential } from './credential.ts';
import { E2bProxy } from './e2b-proxy.ts';
import { place } from './placement.ts';
import { Upstream, type Deadline } from './upstream.ts';
import { newSessionId } from '../sessions/session-manager.ts';

export interface GatewayOptions {
  port: number;
  host?: string;
  principals: Principals;
  /** redis://host:port (or rediss:// for TLS) of the catalog. */
  catalogUrl: string;
  catalogPrefix?: string;
  /** The gateway-to-broker credential. */
  credential: string;
  /** Brokers sampled per placement (default 2). */
  sampleK?: number;
  log: Logger;
  limits?: Partial<WsLimits>;
  /** /metrics without a token on this address (a scrape-only interface). */
  metricsListen?: { host: string; port: number };
  /** How long a broker list read from the catalog is reused for routing (default 1000 ms). */
  brokerCacheMs?: number;
  /** Deadline for reaching a broker (connect, hello, /load). */
  brokerTimeoutMs?: number;
  /**
   * What each broker gets to answer a request asked of every one (`sessions`, E2B's list, a
   * signal passed on) before the answer goes without it, naming it (default 5000 ms); a
   * telemetry subscription gets this past its interval and the sampling bound between events.
   */
  fanOutMs?: number;
  /** /mcp's browser origins (none by default) and Host names beyond the gateway's own (mcp/http-origin.ts). */
  mcpHttp?: McpHttpAllowed;
}

const VERSION = (JSON.parse(readFileSync(new URL('../../../package.json', import.meta.url), 'utf8')) as { version: string }).version;

/** How long a cached session placement is used before the catalog is read again, and how many are kept. */
const ENTRY_CACHE_MS = 30_000;
const ENTRY_CACHE_MAX = 100_000;

/** An upstream idle this long (no request in flight) is closed. */
const UPSTREAM_IDLE_MS = 60_000;

const DEFAULT_FAN_OUT_MS = 5000;

export class Gateway {
  private server: WsServer | undefined;
  private metricsServer: Server | undefined;
  private readonly catalog: Catalog;
  private readonly mcp: McpHttpEndpoint;
  private readonly e2b: E2bProxy;
  /**
   * Upstream connections: one per client connection and broker, so what a broker keys by
   * connection (a stream id, in-flight and stream limits) means the same behind a gateway.
   */
  private readonly upstreams = new Map<string, Promise<Upstream>>();
  private brokers: { at: number; list: BrokerRecord[] } | undefined;
  /** Session placements read from the catalog, by principal and session (bounded, short-lived; see placement()). */
  private readonly entries = new Map<string, SessionEntry & { at: number }>();
  private readonly sweeper: NodeJS.Timeout;
  readonly registry = new Registry();
  private readonly requests = new Counter({ name: 'hutch_gateway_requests_total', help: 'Requests forwarded, by op and outcome', labelNames: ['op', 'outcome'], registers: [this.registry] });
  private readonly placements = new Counter({ name: 'hutch_gateway_placements_total', help: 'Sessions placed, by broker', labelNames: ['broker'], registers: [this.registry] });
  private readonly upstreamGauge = new Gauge({ name: 'hutch_gateway_upstreams', help: 'Open gateway-to-broker connections', registers: [this.registry] });
  port = 0;
  metricsPort = 0;
  private draining = false;

  constructor(private readonly o: GatewayOptions) {
    new GatewayCredential(o.credential); // its length and shape, checked as the brokers check it
    // A tenant holding the credential as its token could go round the gateway and act as anyone.
    if (o.principals.authenticate(o.credential) !== undefined) throw new HutchError('bad_request', 'the gateway credential equals a tenant token; give it its own secret');
    this.catalog = new Catalog(o.catalogUrl, o.catalogPrefix);
    // MCP over HTTP on the gateway reaches the gateway's own WebSocket API, so its tool calls are routed like any harness's.
    this.mcp = new McpHttpEndpoint({
      brokerUrl: () => loopbackUrl(o.host, this.port),
      log: o.log,
      origins: { allowedOrigins: o.mcpHttp?.allowedOrigins ?? [], allowedHosts: ownHostNames({ listenHost: o.host, extra: o.mcpHttp?.allowedHosts }) },
    });
    this.e2b = new E2bProxy({
      principals: o.principals,
      log: o.log,
      session: (principal, id) => this.catalog.session(principal, id),
      brokerFor: (entry, id) => this.brokerFor(entry, id),
      place: async () => (await place(await this.liveBrokers(true), { memoryMiB: 512, k: o.sampleK ?? 2, credential: o.credential, timeoutMs: this.timeoutMs })).broker,
      claim: (id, entry) => this.catalog.claimSession(id, entry),
      release: async (id, entry) => {
        this.entries.delete(entryKey(entry.principal, id));
        await this.catalog.releaseSession(id, { broker: entry.broker, principal: entry.principal });
      },
      liveBrokers: () => this.liveBrokers(true),
      fanOutMs: this.fanOutMs,
    });
    this.sweeper = setInterval(() => this.sweep(), 10_000);
    this.sweeper.unref();
  }

  private get timeoutMs(): number {
    return this.o.brokerTimeoutMs ?? 3000;
  }

  private get fanOutMs(): number {
    return this.o.fanOutMs ?? DEFAULT_FAN_OUT_MS;
  }

  async start(): Promise<number> {
    this.server = new WsServer({
      port: this.o.port,
      ...(this.o.host ? { host: this.o.host } : {}),
      principals: this.o.principals,
      log: this.o.log,
      ...(this.o.limits ? { limits: this.o.limits } : {}),
      hello: { backend: 'gateway', versions: { api: HARNESS_API_VERSION, broker: `gateway ${VERSION}`, node: process.versions.node } },
      handle: (op, p, ctx) => this.handle(op, p, ctx),
      http: (req, res, principal, authenticated) => this.onHttp(req, res, principal, authenticated ?? (() => undefined)),
    });
    this.port = await this.server.listen();
    if (this.o.metricsListen) {
      const m = await listenMetrics(this.o.metricsListen, (res) => this.serveMetrics(res));
      this.metricsServer = m.server;
      this.metricsPort = m.port;
    }
    this.o.log.info('gateway.listening', { port: this.port, principals: this.o.principals.names });
    return this.port;
  }

  /**
   * SIGTERM: /readyz turns 503 (a readiness probe takes the gateway out of its Service) and
   * requests in flight get up to `timeoutMs` to finish before stop() closes the connections;
   * their clients then reconnect to another gateway. Nothing else needs saving: a gateway holds
   * no state of its own.
   */
  async drain(timeoutMs = 10_000): Promise<void> {
    this.draining = true;
    const until = Date.now() + timeoutMs;
    while ((this.server?.inflight ?? 0) > 0 && Date.now() < until) await new Promise((r) => setTimeout(r, 25));
  }

  async stop(): Promise<void> {
    clearInterval(this.sweeper);
    await new Promise<void>((r) => (this.metricsServer ? this.metricsServer.close(() => r()) : r()));
    await this.mcp.close();
    await this.server?.close();
    for (const u of this.upstreams.values()) void u.then((x) => x.close(), () => undefined);
    this.upstreams.clear();
    this.catalog.close();
  }

  private async onHttp(req: IncomingMessage, res: ServerResponse, principal: string | undefined, authenticated: () => void): Promise<boolean> {
    if (req.url === '/healthz') {
      // Liveness only: a draining gateway is alive (restarting it would cut the calls it lets finish).
      res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify({ ok: true }));
      return true;
    }
    if (req.url === '/readyz') {
      // Draining: not ready, so the Service stops sending new clients here.
      res.writeHead(this.draining ? 503 : 200, { 'content-type': 'application/json' }).end(JSON.stringify(this.draining ? { ready: false, reason: 'draining' } : { ready: true }));
      return true;
    }
    if (McpHttpEndpoint.matches(req.url)) return this.mcp.handle(req, res, principal, bearer(req)).then(() => true);
    if (E2bEndpoint.matches(req.url)) return this.e2b.handle(req, res, authenticated).then(() => true);
    if (req.url === '/metrics') {
      if (principal === undefined) {
        res.writeHead(401, { 'content-type': 'text/plain', 'www-authenticate': 'Bearer' }).end('unauthorized: /metrics needs a bearer token (or --metrics-port)\n');
        return true;
      }
      return this.serveMetrics(res);
    }
    return false;
  }

  private async serveMetrics(res: ServerResponse): Promise<boolean> {
    this.upstreamGauge.set(this.upstreams.size);
    res.writeHead(200, { 'content-type': this.registry.contentType }).end(await this.registry.metrics());
    return true;
  }

  private async handle(op: OpName, raw: unknown, ctx: OpContext): Promise<unknown> {
    const p = raw !== null && typeof raw === 'object' ? (raw as Record<string, unknown>) : {};
    try {
      let r: unknown;
      if (op === 'create') r = await this.create(p, ctx);
      else if (p['session'] !== undefined) r = await this.forwardToSession(sessionIdOf(p['session']), op, raw, ctx);
      else if (op === 'sessions') r = await this.listSessions(raw, ctx);
      else if (op === 'telemetry') r = await this.telemetryAll(raw, ctx);
      else throw new HutchError('bad_request', `op ${op} without a session cannot be routed by the gateway (give a session, or use a broker directly)`, { op });
      this.requests.inc({ op, outcome: 'ok' });
      return r;
    } catch (err) {
      this.requests.inc({ op, outcome: toHutchError(err).code });
      throw err;
    }
  }

  /** Live brokers, read from the catalog at most every brokerCacheMs (or now, when `fresh`). */
  private async liveBrokers(fresh = false): Promise<BrokerRecord[]> {
    const maxAge = this.o.brokerCacheMs ?? 1000;
    if (!fresh && this.brokers && Date.now() - this.brokers.at < maxAge) return this.brokers.list;
    let list: BrokerRecord[];
    try {
      list = await this.catalog.liveBrokers();
    } catch (err) {
      // The catalog is unreachable: route by what was last known (placing needs the catalog and fails anyway).
      if (this.brokers) return this.brokers.list;
      throw err;
    }
    this.brokers = { at: Date.now(), list };
    return list;
  }

  private async brokerFor(entry: SessionEntry, session: string): Promise<BrokerRecord> {
    let rec = (await this.liveBrokers()).find((b) => b.id === entry.broker);
    // A broker just (re)started may be newer than our cached list: look again before saying it is gone.
    rec ??= (await this.liveBrokers(true)).find((b) => b.id === entry.broker);
    if (!rec) {
      throw new HutchError('unavailable', `session ${session} lives on broker ${entry.broker}, which is not registered (stopped, draining or its lease expired); its workspace lives on that node`, {
        session,
        broker: entry.broker,
        reason: 'not_registered',
      });
    }
    return rec;
  }

  private upstream(ctx: OpContext, rec: BrokerRecord): Promise<Upstream> {
    const conn = ctx.connection;
    const binary = ctx.binary;
    const key = `${conn.id}\n${binary ? 'b' : 't'}\n${rec.id}\n${rec.url}`;
    const have = this.upstreams.get(key);
    if (have) {
      return have.then((u) => {
        if (u.open) return u;
        if (this.upstreams.get(key) === have) this.upstreams.delete(key);
        return this.upstream(ctx, rec);
      });
    }
    const opening = Upstream.open({
      broker: rec.id,
      url: rec.url,
      credential: this.o.credential,
      principal: ctx.principal,
      binary,
      timeoutMs: this.timeoutMs,
      maxPayload: (this.o.limits?.maxPayloadBytes ?? DEFAULT_WS_LIMITS.maxPayloadBytes) * 2,
    });
    this.upstreams.set(key, opening);
    opening.then(
      (u) => {
        // The client went away: its upstreams go too (the broker then cancels what it still runs).
        if (conn.closed.aborted) u.close();
        else
          conn.closed.addEventListener('abort', () => {
            if (this.upstreams.get(key) === opening) this.upstreams.delete(key);
            u.close();
          });
      },
      () => {
        if (this.upstreams.get(key) === opening) this.upstreams.delete(key);
      },
    );
    return opening;
  }

  /** Closes upstreams idle for a while, so a gateway does not hold a connection per principal per broker forever. */
  private sweep(): void {
    for (const [key, p] of this.upstreams) {
      void p.then(
        (u) => {
          if (!u.open || (u.inflight === 0 && Date.now() - u.lastUsed > UPSTREAM_IDLE_MS)) {
            if (this.upstreams.get(key) === p) this.upstreams.delete(key);
            u.close();
          }
        },
        () => undefined,
      );
    }
  }

  /** Forwards one request and relays its streamed output, events and signals. */
  private async forward(u: Upstream, op: string, raw: unknown, ctx: OpContext): Promise<unknown> {
    return this.forwardAll([u], op, raw, ctx).then(([r]) => {
      if (r?.e) throw r.e;
      return r?.r;
    });
  }

  /**
   * Sends one request to several brokers (one, usually) as a single call of the client's: output
   * and events are relayed as they come, a signal goes to every part, and each part's answer
   * (or error) is returned in order. With a deadline (a fan-out), a part past it is failed
   * `unavailable` (reason `timeout`) and cancelled at its broker. Signals passed on always
   * have one: a stopped broker cannot hold the client's `signal` answer.
   */
  private async forwardAll(ups: Upstream[], op: string, raw: unknown, ctx: OpContext, deadline?: Deadline): Promise<Array<{ r?: unknown; e?: unknown }>> {
    const parts = ups.map((u) => ({ u, ...u.request(op, raw, { out: (fd, d) => ctx.out(fd, d), event: (d) => ctx.event(d) }, deadline) }));
    const signal = (u: Upstream, id: number, sig: SignalName) => u.request('signal', { call: id, signal: sig }, {}, { ms: this.fanOutMs }).result;
    ctx.onSignal(async (sig) => {
      const answers = await Promise.all(parts.map(({ u, id }) => signal(u, id, sig).then((r) => ({ delivered: (r as SignalResult).delivered, missing: undefined }), () => ({ delivered: false, missing: u.broker }))));
      const unavailable = answers.flatMap((a) => (a.missing ? [a.missing] : []));
      return { delivered: answers.some((a) => a.delivered), ...(unavailable.length ? { unavailable } : {}) };
    });
    // SIGKILL, or the client going away, cancels the call on the broker; its answer still comes back through here.
    const cancel = () => {
      for (const { u, id } of parts) void signal(u, id, 'SIGKILL').catch(() => undefined);
    };
    if (ctx.signal.aborted) cancel();
    else ctx.signal.addEventListener('abort', cancel, { once: true });
    try {
      return await Promise.all(
        parts.map(({ u, id, result }) =>
          result.then(
            (r) => ({ r }),
            (e: unknown) => {
              // Given up on: the broker, if it comes back, stops what it was doing for us.
              if (toHutchError(e).context?.['reason'] === 'timeout') void signal(u, id, 'SIGKILL').catch(() => undefined);
              return { e };
            },
          ),
        ),
      );
    } finally {
      ctx.signal.removeEventListener('abort', cancel);
    }
  }

  /**
   * A session's placement, from this gateway's cache when it has it (a catalog round trip
   * per call otherwise). A cached entry can only be stale after the session was closed
   * elsewhere; an answer that could come from that (not_found from the broker) is checked
   * against the catalog before it stands. Placements are the principal's own: another
   * principal's session of the same id is not looked at, and answers like a missing one.
   */
  private async placement(session: string, principal: string, fresh: boolean): Promise<{ entry: SessionEntry; cached: boolean }> {
    const key = entryKey(principal, session);
    const hit = fresh ? undefined : this.entries.get(key);
    if (hit && Date.now() - hit.at < ENTRY_CACHE_MS) return { entry: hit, cached: true };
    let entry: SessionEntry | undefined;
    try {
      entry = await this.catalog.session(principal, session);
    } catch (err) {
      // The catalog is unreachable: a placement seen before still routes (its broker still checks the owner).
      const known = this.entries.get(key);
      if (known) return { entry: known, cached: true };
      throw err;
    }
    if (!entry) {
      this.entries.delete(key);
      throw new HutchError('not_found', `no session ${session}`, { session });
    }
    this.remember(key, entry);
    return { entry, cached: false };
  }

  private remember(key: string, entry: SessionEntry): void {
    this.entries.delete(key);
    this.entries.set(key, { ...entry, at: Date.now() });
    // Oldest first in insertion order: drop from the front past the bound.
    for (const k of this.entries.keys()) {
      if (this.entries.size <= ENTRY_CACHE_MAX) break;
      this.entries.delete(k);
    }
  }

  private async forwardToSession(session: string, op: string, raw: unknown, ctx: OpContext, fresh = false): Promise<unknown> {
    const { entry, cached } = await this.placement(session, ctx.principal, fresh);
    try {
      return await this.forwardPlaced(session, entry, op, raw, ctx);
    } catch (err) {
      // The broker does not have it: nothing ran there. A stale cache entry gets one retry from the catalog.
      if (cached && toHutchError(err).code === 'not_found' && toHutchError(err).context?.['session'] === session) {
        this.entries.delete(entryKey(ctx.principal, session));
        return this.forwardToSession(session, op, raw, ctx, true);
      }
      throw err;
    }
  }

  private async forwardPlaced(session: string, entry: SessionEntry, op: string, raw: unknown, ctx: OpContext): Promise<unknown> {
    const rec = await this.brokerFor(entry, session);
    const u = await this.upstream(ctx, rec).catch((err: unknown) => {
      throw new HutchError('unavailable', `session ${session} lives on broker ${rec.id}, which cannot be reached: ${(err as Error).message}`, { session, broker: rec.id, reason: 'unreachable' });
    });
    const r = await this.forward(u, op, raw, ctx);
    // The session is gone from its broker: forget the placement (only ours, compare-and-delete).
    if (op === 'close') {
      this.entries.delete(entryKey(entry.principal, session));
      await this.catalog.releaseSession(session, { broker: entry.broker, principal: entry.principal });
    }
    return r;
  }

  private async create(p: Record<string, unknown>, ctx: OpContext): Promise<unknown> {
    // The gateway names every id (random, so nobody can guess another principal's), as a broker does for a tenant.
    if (p['id'] !== undefined) throw new HutchError('bad_request', 'a session id is chosen by the broker: create without id and keep the id it answers', { op: 'create' });
    const template = typeof p['template'] === 'string' ? p['template'] : undefined;
    const memoryMiB = typeof p['memoryMiB'] === 'number' ? p['memoryMiB'] : 512;
    const placed = await place(await this.liveBrokers(true), {
      template,
      memoryMiB,
      k: this.o.sampleK ?? 2,
      credential: this.o.credential,
      timeoutMs: this.timeoutMs,
    });
    const session = newSessionId();
    const entry: SessionEntry = { broker: placed.broker.id, principal: ctx.principal };
    // First writer wins: two gateways placing one id cannot both succeed.
    if (!(await this.catalog.claimSession(session, entry))) throw new HutchError('already_exists', `session ${session} already exists`, { session });
    this.o.log.debug('gateway.placed', { session, broker: placed.broker.id, considered: placed.considered });
    let u: Upstream;
    try {
      u = await this.upstream(ctx, placed.broker);
    } catch (err) {
      await this.catalog.releaseSession(session, entry);
      throw err;
    }
    try {
      const r = await this.forward(u, 'create', { ...p, id: session }, ctx);
      this.placements.inc({ broker: placed.broker.id });
      return r;
    } catch (err) {
      // The broker answered no: nothing was made there. (A lost connection keeps the claim: the
      // session may exist, and an id pointing at a broker without it answers not_found, never twice.)
      const e = toHutchError(err);
      if (!(e.code === 'unavailable' && e.context?.['reason'] === 'connection_lost')) await this.catalog.releaseSession(session, entry);
      throw err;
    }
  }

  /**
   * Asks every live broker, each within `deadline` (connecting has its own); the answers of
   * those that answered, and the ids of those that did not.
   */
  private async fanOut(op: string, raw: unknown, ctx: OpContext, deadline: Deadline): Promise<{ answers: unknown[]; unavailable: string[] }> {
    const brokers = await this.liveBrokers(true);
    const reached = await Promise.all(brokers.map((b) => this.upstream(ctx, b).then((u) => ({ b, u }), () => ({ b, u: undefined }))));
    const ups = reached.filter((x): x is { b: BrokerRecord; u: Upstream } => x.u !== undefined);
    const results = await this.forwardAll(
      ups.map((x) => x.u),
      op,
      raw,
      ctx,
      deadline,
    );
    const unavailable = [...reached.filter((x) => !x.u).map((x) => x.b.id), ...ups.filter((_, i) => results[i]?.e !== undefined).map((x) => x.b.id)];
    if (unavailable.length) this.o.log.warn('gateway.fan_out_partial', { op, unavailable, errors: results.flatMap((x) => (x.e === undefined ? [] : [toHutchError(x.e).message])) });
    return { answers: results.filter((x) => x.e === undefined).map((x) => x.r), unavailable };
  }

  /** Every live broker's list of this principal's sessions; brokers that did not answer in time are named. */
  private async listSessions(raw: unknown, ctx: OpContext): Promise<SessionsResult> {
    const { answers, unavailable } = await this.fanOut('sessions', opParams('sessions', raw ?? {}), ctx, { ms: this.fanOutMs });
    return { sessions: answers.flatMap((a) => (a as SessionsResult).sessions), ...(unavailable.length ? { unavailable } : {}) };
  }

  /**
   * Telemetry of all the principal's sessions: a subscription on every live broker, each
   * broker's events relayed as they come (so one event per broker per interval, each with
   * that broker's sessions); cancelling the call cancels them all. A broker that sends no
   * event for an interval, the sampling bound and the fan-out deadline is given up and named.
   */
  private async telemetryAll(raw: unknown, ctx: OpContext): Promise<TelemetryResult> {
    const p = opParams('telemetry', raw ?? {});
    const { answers, unavailable } = await this.fanOut('telemetry', p, ctx, { ms: (p.intervalMs ?? 1000) + TELEMETRY_SAMPLE_TIMEOUT_MS + this.fanOutMs, whileFrames: true });
    const rs = answers as TelemetryResult[];
    return { samples: rs.reduce((n, r) => n + r.samples, 0), cancelled: rs.some((r) => r.cancelled), ...(unavailable.length ? { unavailable } : {}) };
  }
}

type SignalName = z.infer<typeof SignalSchema>;

/** The entry cache's key: placements are per principal, as in the catalog. */
function entryKey(principal: string, session: string): string {
  return `${principal}\n${session}`;
}
