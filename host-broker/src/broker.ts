import type { Server, ServerResponse } from 'node:http';
import { readFileSync, realpathSync } from 'node:fs';
import { join, resolve } from 'node:path';
import type { z } from 'zod';
import { HutchError } from '../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../guest-agent/src/log.ts';
import { HARNESS_API_VERSION, opParams, TELEMETRY_SAMPLE_TIMEOUT_MS, type OpName, type SessionTelemetry, type TelemetryEvent, type TelemetryParams } from './api/harness-protocol.ts';
import { Principals } from './api/principals.ts';
import { DEFAULT_WS_LIMITS, WsServer, bearer, sendLimits, type OpContext, type WsLimits } from './api/ws-server.ts';
import { SendBudget } from './api/send-budget.ts';
import { loopbackUrl, McpHttpEndpoint } from './mcp/http.ts';
import { ownHostNames, type McpHttpAllowed } from './mcp/http-origin.ts';
import { E2bEndpoint } from './e2b/endpoint.ts';
import type { VmBackend } from './backends/backend.ts';
import { initRouter } from './router/index.ts';
import { privateDir, SessionManager } from './sessions/session-manager.ts';
import type { FastPathRunner } from './tools/fastpath-runner.ts';
import { FileStreams, isStreamOp } from './tools/file-stream.ts';
import { Admission, DEFAULT_FASTPATH_RUNS, type AdmissionOptions } from './admission.ts';
import { watchBudget } from './sync/watch-budget.ts';
import { BrokerMetrics, listenMetrics } from './metrics.ts';
import { availableParallelism, totalmem } from 'node:os';
import { DEFAULT_POLICY, type SandboxPolicy } from './policy/sandbox-policy.ts';
import { ClusterMember, drainingError, type ClusterOptions } from './catalog/member.ts';
import { validateSessionSizes, type SessionSizes } from './sessions/session-sizes.ts';
import { MAX_OUTPUT_BYTES } from './sessions/session.ts';
import { ByteBudget } from './util/byte-budget.ts';
import { defaultSlotDisk, SlotDiskBudget, type SlotDiskOptions } from './lifecycle/slot-disk-budget.ts';
import { DEFAULT_NETWORK, Networks, type NetworkDefaults } from './network/networks.ts';
import { PortProxy, portTarget } from './network/port-proxy.ts';

export interface BrokerOptions {
  port: number;
  host?: string;
  /** The simple case: one bearer token, the principal `default`. */
  token?: string;
  /** Named principals (name -> token); with `token`, both apply. */
  tokens?: Record<string, string>;
  dataDir: string;
  /** Host directories sessions may be created from (`workspace: { dir }`); none = refused. */
  workspaceRoots?: readonly string[];
  /** The VM sizes sessions may ask for (default DEFAULT_SESSION_SIZES: 256-2048 MiB, 1-2 vCPUs). */
  sessionSizes?: SessionSizes;
  /** Sessions plus kept workspaces one principal may hold (default 128). */
  maxSessionsPerPrincipal?: number;
  /** Connection limits (frame size, handshake timeout, connection caps, back-pressure). */
  limits?: Partial<WsLimits>;
  /** Also serve /metrics without a token on this separate address (e.g. a scrape-only interface). */
  metricsListen?: { host: string; port: number };
  /** The published level the policy came from, reported in the hello frame. */
  policyLevel?: string;
  backend: VmBackend;
  fastPath: FastPathRunner;
  log: Logger;
  /** Largest file the file tools read or write (default 64 MiB). */
  maxFileBytes?: number;
  /** How long a command the router sent to the fast path may run before it fails `timeout` (default 30 s, FASTPATH_MAX_RUN_MS). */
  fastPathMaxMs?: number;
  /** Workspace quota per session (default 2 GiB and 200,000 entries); a create may ask less. */
  quota?: { bytes: number; files: number };
  /** Release a session's VM after this long without a VM call (default 5 s); overrides policy.idleMs. */
  idleMs?: number;
  /** Routing, wake and release policy (default: level 4 with the cost model). */
  policy?: Partial<SandboxPolicy>;
  admission?: Partial<AdmissionOptions>;
  /** Disk the snapshot slots may take (default: half the data dir's filesystem; half of that per principal with several). */
  slotDisk?: Partial<Omit<SlotDiskOptions, 'dir'>>;
  /** Member of a cluster behind gateways: catalog registration with a lease, /load, the gateway credential. */
  cluster?: ClusterOptions;
  /** /mcp's browser origins (none by default) and Host names beyond the broker's own (mcp/http-origin.ts). */
  mcpHttp?: McpHttpAllowed;
  /** Sandboxes' networks: the default egress, the most a sandbox may ask, limits (README "Network"). Only for backends whose guests serve it. */
  network?: Partial<NetworkDefaults>;
}

/** Host locations an answer must not name: the data dir (as given and resolved) and the cache under HOME. */
function hostPaths(dataDir: string): Array<{ path: string; as: string }> {
  const out = new Map<string, string>();
  for (const p of [dataDir, resolve(dataDir), realpathSync(dataDir)]) if (p.length > 1) out.set(p.replace(/\/+$/, ''), '<data-dir>');
  const cache = process.env['HUTCH_CACHE'] ?? (process.env['HOME'] ? join(process.env['HOME'], '.cache', 'hutch') : undefined);
  if (cache) out.set(cache, '<cache>');
  // Longest first, so a data dir inside the cache (or the reverse) is replaced whole.
  return [...out.entries()].sort((a, b) => b[0].length - a[0].length).map(([path, as]) => ({ path, as }));
}

/** The broker's version (package.json), told to clients in the hello frame. */
const BROKER_VERSION = (JSON.parse(readFileSync(new URL('../../package.json', import.meta.url), 'utf8')) as { version: string }).version;

function withTimeout<T>(p: Promise<T>, ms: number, fallback: T): Promise<T> {
  return new Promise((resolve, reject) => {
    const t = setTimeout(() => resolve(fallback), ms);
    p.then(
      (v) => {
        clearTimeout(t);
        resolve(v);
      },
      (e: unknown) => {
        clearTimeout(t);
        reject(e as Error);
      },
    );
  });
}

function sleepUnlessAborted(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const t = setTimeout(done, ms);
    function done(): void {
      clearTimeout(t);
      signal.removeEventListener('abort', done);
      resolve();
    }
    signal.addEventListener('abort', done, { once: true });
  });
}

/** Defaults sized to the host: wakes and VM calls by CPU count, memory by what the host has. */
export function defaultAdmission(): AdmissionOptions {
  const cpus = availableParallelism();
  return {
    maxConcurrentWakes: Math.max(1, cpus),
    maxConcurrentVmCalls: Math.max(2, cpus * 2),
    memoryBudgetMiB: Math.floor((totalmem() / 1024 / 1024) * 0.75),
    queueTimeoutMs: 120_000,
  };
}

/** The host daemon: sessions behind a WebSocket, calls routed per tool. */
export class Broker {
  readonly sessions: SessionManager;
  readonly metrics = new BrokerMetrics();
  readonly admission: Admission;
  /**
   * File bytes the in-process read and edit hold at once (each loads its file, up to 64 MiB):
   * 1 GiB in all, 256 MiB per principal. A principal's 128 sessions reading 64 MiB files at
   * once would otherwise hold 8 GiB of the broker's memory.
   */
  /** The data dir's disk the sessions' snapshot slots may take. */
  readonly slotDisk: SlotDiskBudget;
  readonly fileBytes = new ByteBudget(1024 * 1024 * 1024, 256 * 1024 * 1024, 'in-process file reads');
  /** Bytes made for clients and not yet taken by their sockets: the WebSocket API's and E2B streams', per principal together. */
  readonly sendBudget: SendBudget;
  readonly policy: SandboxPolicy;
  private server: WsServer | undefined;
  /** Streamed uploads and downloads (made with the server, which holds their limits). */
  private streams: FileStreams | undefined;
  private metricsServer: Server | undefined;
  /** MCP over Streamable HTTP at /mcp: the same tokens, reaching the WebSocket API through the SDK. */
  private readonly mcp: McpHttpEndpoint;
  private readonly principals: Principals;
  /** The E2B-compatible API (/e2b/api) and envd (/e2b/envd): the same tokens as X-API-KEY. */
  private readonly e2b: E2bEndpoint;
  /** The last guest sample per session, from subscriptions: what /metrics reports without asking any guest. */
  private readonly lastSamples = new Map<string, SessionTelemetry>();
  readonly cluster: ClusterMember | undefined;
  /** Every sandbox's network (undefined: the backend's guests have none). */
  readonly networks: Networks | undefined;
  private readonly ports: PortProxy;
  /** Set by drain(): new work is refused with `unavailable`, calls in flight finish. */
  private draining = false;
  /** Until start() has finished (listening, registered), and again once stopping: /readyz says not ready. */
  private started = false;
  port = 0;
  metricsPort = 0;

  constructor(private readonly opts: BrokerOptions) {
    this.principals = new Principals({ ...(opts.token !== undefined ? { default: opts.token } : {}), ...opts.tokens });
    this.mcp = new McpHttpEndpoint({
      brokerUrl: () => loopbackUrl(opts.host, this.port),
      log: opts.log,
      origins: { allowedOrigins: opts.mcpHttp?.allowedOrigins ?? [], allowedHosts: ownHostNames({ listenHost: opts.host, advertiseUrl: opts.cluster?.advertiseUrl, extra: opts.mcpHttp?.allowedHosts }) },
    });
    privateDir(opts.dataDir);
    this.policy = { ...DEFAULT_POLICY, ...opts.policy, ...(opts.idleMs !== undefined ? { idleMs: opts.idleMs } : {}) };
    const admission = { ...defaultAdmission(), ...opts.admission };
    // With several principals, none may hold more than half the VM memory unless the operator says so.
    const principals = Object.keys({ ...(opts.token !== undefined ? { default: true } : {}), ...opts.tokens }).length;
    // Fast-path runs: as many at once as the fast path's pool cgroup holds, each counted at its limit; half of them per principal with several.
    const runs = opts.fastPath.runLimits;
    const maxConcurrentFastPath = admission.maxConcurrentFastPath ?? runs?.maxConcurrentRuns ?? DEFAULT_FASTPATH_RUNS;
    this.admission = new Admission({
      ...admission,
      principalMemoryMiB: admission.principalMemoryMiB ?? (principals > 1 ? Math.floor(admission.memoryBudgetMiB / 2) : admission.memoryBudgetMiB),
      maxConcurrentFastPath,
      principalFastPath: admission.principalFastPath ?? (principals > 1 ? Math.max(1, Math.floor(maxConcurrentFastPath / 2)) : maxConcurrentFastPath),
      ...(runs && admission.fastPathRunMiB === undefined ? { fastPathRunMiB: Math.ceil(runs.memoryBytes / 2 ** 20) } : {}),
    });
    opts.backend.attachMemoryBudget?.(this.admission);
    const slotDisk = { ...defaultSlotDisk(opts.dataDir, principals), ...opts.slotDisk };
    // A total given alone: one principal's share follows it, as the default's does.
    if (opts.slotDisk?.totalBytes !== undefined && opts.slotDisk.principalBytes === undefined) slotDisk.principalBytes = principals > 1 ? Math.floor(slotDisk.totalBytes / 2) : slotDisk.totalBytes;
    this.slotDisk = new SlotDiskBudget(slotDisk);
    this.networks = opts.backend.guestNetwork
      ? new Networks({ ...DEFAULT_NETWORK, ...opts.network }, {
          onEvent: (e) => {
            this.metrics.egressConnections.inc({ outcome: e.outcome });
            if (e.outcome !== 'allowed') opts.log.info('network.refused', { session: e.session, principal: e.principal, host: e.host, port: e.port, reason: e.reason, rule: e.rule });
          },
          onBytes: (principal, bytesIn, bytesOut) => {
            if (bytesIn) this.metrics.egressBytes.inc({ direction: 'in', principal }, bytesIn);
            if (bytesOut) this.metrics.egressBytes.inc({ direction: 'out', principal }, bytesOut);
          },
        })
      : undefined;
    this.sessions = new SessionManager(
      opts.dataDir,
      {
        ...(this.networks ? { networks: this.networks } : {}),
        backend: opts.backend,
        fastPath: opts.fastPath,
        admission: this.admission,
        metrics: this.metrics,
        log: opts.log,
        policy: this.policy,
        ...(opts.maxFileBytes ? { maxFileBytes: opts.maxFileBytes } : {}),
        ...(opts.fastPathMaxMs ? { fastPathMaxMs: opts.fastPathMaxMs } : {}),
        ...(opts.quota ? { quota: opts.quota } : {}),
        fileBytes: this.fileBytes,
        slotDisk: this.slotDisk,
      },
      opts.log,
      { ...(opts.workspaceRoots ? { workspaceRoots: opts.workspaceRoots } : {}), ...(opts.sessionSizes ? { sizes: validateSessionSizes(opts.sessionSizes) } : {}), ...(opts.maxSessionsPerPrincipal !== undefined ? { maxSessionsPerPrincipal: opts.maxSessionsPerPrincipal } : {}) },
    );
    this.sendBudget = new SendBudget(sendLimits({ ...DEFAULT_WS_LIMITS, ...opts.limits }));
    this.e2b = new E2bEndpoint({ sessions: this.sessions, principals: this.principals, log: opts.log, send: this.sendBudget });
    this.metrics.buildInfo.set({ version: BROKER_VERSION, backend: opts.backend.name, accel: opts.backend.accel ?? 'none' }, 1);
    this.cluster = opts.cluster ? new ClusterMember(opts.cluster, this, this.principals, opts.log) : undefined;
    this.ports = new PortProxy(
      {
        authenticate: (token) => this.principals.authenticate(token),
        trafficPrincipal: (session, token) => this.e2b.trafficPrincipal(session, token),
        open: async (id, port, principal) => {
          if (this.draining) throw drainingError(this.cluster?.id);
          const session = principal !== undefined ? this.sessions.get(id, principal) : this.sessions.find(id);
          // Without a token only a port its creator made public; anything else looks the same whether or not the sandbox exists.
          if (principal === undefined && !session?.isPublicPort(port)) throw new HutchError('unauthorized', 'a token is required (X-Hutch-Token or Authorization: Bearer) unless the port is public');
          if (!session) throw new HutchError('not_found', `session ${id} not found`, { session: id });
          if (!this.networks) throw new HutchError('unavailable', `the ${opts.backend.name} backend's sandboxes have no ports to reach`);
          return session.vm.openPort(port);
        },
      },
      opts.log,
    );
  }

  async start(): Promise<number> {
    await initRouter();
    const adopted = this.sessions.loadExisting();
    this.server = new WsServer({
      port: this.opts.port,
      ...(this.opts.host ? { host: this.opts.host } : {}),
      principals: this.principals,
      log: this.opts.log,
      ...(this.opts.limits ? { limits: this.opts.limits } : {}),
      send: this.sendBudget,
      redactPaths: hostPaths(this.opts.dataDir),
      hello: {
        backend: this.opts.backend.name,
        ...(this.opts.backend.accel ? { accel: this.opts.backend.accel } : {}),
        isolation: this.opts.backend.isolation,
        policy: { ...(this.opts.policyLevel ? { level: this.opts.policyLevel } : {}), idleMs: this.policy.idleMs, routing: this.policy.routing, idlePolicy: this.policy.idlePolicy },
        limits: { ...(this.opts.maxFileBytes ? { maxFileBytes: this.opts.maxFileBytes } : {}), maxOutputBytes: MAX_OUTPUT_BYTES },
        versions: { api: HARNESS_API_VERSION, broker: BROKER_VERSION, node: process.versions.node },
      },
      handle: (op, p, ctx) => this.handle(op, p, ctx),
      upgrade: (req, socket, head) => {
        const t = portTarget(req);
        if (!t) return false;
        void this.ports.handleUpgrade(req, socket, head, t);
        return true;
      },
      http: (req, res, principal, authenticated) => {
        const port = portTarget(req);
        if (port) {
          authenticated?.();
          return this.ports.handleHttp(req, res, port).then(() => true);
        }
        if (this.cluster && ClusterMember.serves(req.url)) return this.cluster.handleHttp(req, res).then(() => true);
        if (req.url === '/healthz') {
          // Liveness only: how many sessions exist is not for anonymous callers.
          res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify({ ok: true }));
          return true;
        }
        if (req.url === '/readyz') {
          // Readiness: whether new work should come here (a Service's endpoints, a gateway's placements).
          const why = this.notReady();
          res.writeHead(why ? 503 : 200, { 'content-type': 'application/json' }).end(JSON.stringify(why ? { ready: false, reason: why } : { ready: true }));
          return true;
        }
        if (McpHttpEndpoint.matches(req.url)) return this.mcp.handle(req, res, principal, bearer(req)).then(() => true);
        if (E2bEndpoint.matches(req.url)) return this.e2b.handle(req, res, authenticated).then(() => true);
        if (req.url === '/metrics' || req.url?.startsWith('/metrics?')) {
          if (principal === undefined) {
            res.writeHead(401, { 'content-type': 'text/plain', 'www-authenticate': 'Bearer' }).end('unauthorized: /metrics needs a bearer token (or --metrics-port)\n');
            return true;
          }
          return this.serveMetrics(res);
        }
        return false;
      },
    });
    this.port = await this.server.listen();
    await this.cluster?.register(this.port, this.opts.host);
    if (this.opts.metricsListen) {
      const m = await listenMetrics(this.opts.metricsListen, (res) => this.serveMetrics(res));
      this.metricsServer = m.server;
      this.metricsPort = m.port;
    }
    this.started = true;
    this.opts.log.info('broker.listening', { port: this.port, ...(this.metricsServer ? { metricsPort: this.metricsPort } : {}), backend: this.opts.backend.name, isolation: this.opts.backend.isolation, policy: this.policy, principals: this.principals.names, adoptedSessions: adopted, ...(this.networks ? { network: { default: this.networks.defaults.mode, max: this.networks.defaults.max, allowlist: this.networks.defaultAllowlist, from: this.networks.registries.sources } } : {}) });
    return this.port;
  }

  /** Why the broker should get no new work now, or undefined when it should. */
  notReady(): string | undefined {
    if (this.draining) return 'draining';
    if (!this.started) return 'starting';
    return this.opts.backend.notReady?.();
  }

  /**
   * Prometheus text from what the broker already knows: no guest is asked anything per
   * scrape (a scrape loop must not wake, fault in or slow down tenants' VMs). Guest gauges
   * come from the last sample a telemetry subscription took.
   */
  private async serveMetrics(res: ServerResponse): Promise<boolean> {
    const all = this.sessions.all();
    this.metrics.sessions.set(all.length);
    this.metrics.admissionWaiting.set({ kind: 'wake' }, this.admission.wakes.waiting);
    this.metrics.admissionWaiting.set({ kind: 'vm_call' }, this.admission.vmCalls.waiting);
    this.metrics.admissionWaiting.set({ kind: 'fastpath' }, this.admission.fastPathRuns.waiting);
    this.metrics.memoryBudget.set(this.admission.opts.memoryBudgetMiB);
    this.metrics.watchedDirs.set({ state: 'used' }, watchBudget.used);
    this.metrics.watchedDirs.set({ state: 'max' }, watchBudget.maxDirs);
    this.metrics.memoryReserved.set({ holder: 'vm' }, this.admission.memoryReservedMiB - this.admission.yieldingMiB - this.admission.fastPathReservedMiB);
    this.metrics.memoryReserved.set({ holder: 'standby' }, this.admission.yieldingMiB);
    this.metrics.memoryReserved.set({ holder: 'fastpath' }, this.admission.fastPathReservedMiB);
    this.metrics.slotDisk.set({ state: 'held' }, this.slotDisk.heldBytes());
    this.metrics.slotDisk.set({ state: 'limit' }, this.slotDisk.opts.totalBytes);
    const standby = this.opts.backend.standbyStats?.();
    if (standby) {
      this.metrics.standbyVms.set({ state: 'ready' }, standby.ready);
      this.metrics.standbyVms.set({ state: 'filling' }, standby.filling);
    }
    this.metrics.setGuestGauges(
      all.map((s) => {
        const vm = s.vm.vmState;
        // A reclaimed VM's last sample is stale (its memory has moved since): state only.
        return vm === 'live' ? { vm, sample: this.lastSamples.get(s.id)?.sample } : { vm };
      }),
    );
    const text = await this.metrics.text();
    res.writeHead(200, { 'content-type': this.metrics.contentType }).end(text);
    return true;
  }

  /**
   * SIGTERM: deregister (gateways place nothing new here), refuse new work with a typed
   * `unavailable`, and let calls in flight finish, bounded by `timeoutMs`. stop() then
   * releases the VMs into their snapshot slots; sessions stay on disk for the next start.
   */
  async drain(timeoutMs = 60_000): Promise<void> {
    this.draining = true;
    await this.cluster?.deregister();
    const until = Date.now() + timeoutMs;
    while ((this.server?.inflight ?? 0) > 0 && Date.now() < until) await new Promise((r) => setTimeout(r, 25));
    this.opts.log.info('broker.drained', { inflight: this.server?.inflight ?? 0 });
  }

  async stop(): Promise<void> {
    this.started = false;
    await this.cluster?.deregister();
    this.cluster?.close();
    await new Promise<void>((r) => (this.metricsServer ? this.metricsServer.close(() => r()) : r()));
    await this.mcp.close();
    this.e2b.close();
    await this.server?.close();
    await this.sessions.shutdown();
    await this.opts.backend.shutdown();
    await this.opts.fastPath.close?.();
    this.opts.log.info('broker.stopped');
  }

  /**
   * Samples every live, awake VM (or one session's), each bounded by a timeout; with a
   * principal, only that principal's sessions.
   */
  async telemetry(session?: string, principal?: string): Promise<TelemetryEvent> {
    const targets = session ? [this.sessions.get(session, principal)] : this.sessions.all(principal);
    const sessions = await Promise.all(
      targets.map((s) => withTimeout(s.telemetry(), TELEMETRY_SAMPLE_TIMEOUT_MS, { session: s.id, vm: 'live' as const, error: `no sample within ${TELEMETRY_SAMPLE_TIMEOUT_MS} ms` })),
    );
    for (const t of sessions) if (t.sample || t.vm !== 'live') this.lastSamples.set(t.session, t);
    return { atMs: Date.now(), sessions };
  }

  /** A live subscription: one event per interval until the client cancels it or `count` is reached. */
  private async subscribe(p: z.infer<typeof TelemetryParams>, ctx: OpContext): Promise<{ samples: number; cancelled: boolean }> {
    if (p.session) this.sessions.get(p.session, ctx.principal); // unknown session: not_found now, not later
    const interval = p.intervalMs ?? 1000;
    let samples = 0;
    while (!ctx.signal.aborted && (p.count === undefined || samples < p.count)) {
      const started = Date.now();
      ctx.event(await this.telemetry(p.session, ctx.principal));
      samples++;
      if (p.count !== undefined && samples >= p.count) break;
      await sleepUnlessAborted(Math.max(0, interval - (Date.now() - started)), ctx.signal);
    }
    return { samples, cancelled: ctx.signal.aborted };
  }

  /** Every op acts as the connection's principal: sessions of other principals do not exist for it. */
  private async handle(op: OpName, raw: unknown, ctx: OpContext): Promise<unknown> {
    if (this.draining) throw drainingError(this.cluster?.id);
    const who = ctx.principal;
    if (isStreamOp(op)) {
      this.streams ??= new FileStreams((this.server as WsServer).limits, this.opts.log);
      return this.streams.handle(op, raw, ctx, (id) => this.sessions.get(id, who));
    }
    switch (op) {
      case 'create': {
        const p = opParams('create', raw);
        // An id of the tenant's choosing could be another principal's (planted, then handed
        // out by a catalog rebuilt first come, first served): only a gateway names one.
        if (p.id !== undefined && !ctx.viaGateway) throw new HutchError('bad_request', 'a session id is chosen by the broker: create without id and keep the id it answers', { op: 'create' });
        const s = await this.sessions.create(p, who);
        return s.info();
      }
      case 'attach':
        return this.sessions.get(opParams('attach', raw).session, who).info();
      case 'close': {
        const p = opParams('close', raw);
        const r = await this.sessions.close(p.session, p.keepWorkspace ?? false, who);
        this.lastSamples.delete(p.session);
        return r;
      }
      case 'sessions':
        return { sessions: this.sessions.list(who) };
      case 'call': {
        const p = opParams('call', raw);
        const stream = p.stream ?? false;
        return this.sessions.get(p.session, who).call(p.tool, p.args, {
          signal: ctx.signal,
          routed: ctx.logFields,
          onSignalable: (send) => ctx.onSignal(send),
          ...(stream ? { onStdout: (c: Uint8Array) => ctx.out(1, c), onStderr: (c: Uint8Array) => ctx.out(2, c) } : {}),
        });
      }
      case 'hint': {
        const p = opParams('hint', raw);
        this.sessions.get(p.session, who).hint(p.hint);
        return { accepted: true };
      }
      case 'telemetry':
        return this.subscribe(opParams('telemetry', raw), ctx);
      case 'network': {
        const p = opParams('network', raw);
        return this.sessions.setNetwork(p.session, p.network, who).info();
      }
      case 'signal':
        throw new HutchError('internal', 'signal is handled by the transport');
    }
  }
}
