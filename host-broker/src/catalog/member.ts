/**
 * A broker as a member of a cluster behind gateways: it registers in the catalog with a
 * lease it keeps renewing, serves its load to gateways at /load, and trusts the gateway
 * credential to name the principal a forwarded connection acts for.
 */
import { readFileSync } from 'node:fs';
import { hostname } from 'node:os';
import type { IncomingMessage, ServerResponse } from 'node:http';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import { DEFAULT_PRINCIPAL, type Principals } from '../api/principals.ts';
import { bearer } from '../api/ws-server.ts';
import type { Admission } from '../admission.ts';
import type { BrokerMetrics } from '../metrics.ts';
import { GatewayCredential } from '../gateway/credential.ts';
import { Catalog, checkBrokerId, type BrokerRecord } from './catalog.ts';

export interface ClusterOptions {
  /** redis://host:port (or rediss:// for TLS) of the catalog. */
  catalogUrl: string;
  /** Stable across restarts on one node (its sessions' workspaces live there): default the host name. */
  brokerId?: string;
  /** Where gateways reach this broker (ws://host:port); default ws://<host name>:<port>. */
  advertiseUrl?: string;
  /** Registration TTL; renewed every third of it (default 10 s). */
  leaseMs?: number;
  /** Templates this broker can create from (placement honours a create's `template`). */
  templates?: string[];
  /** The gateway-to-broker credential. */
  gatewayToken: string;
  /** Key prefix in the catalog (default `hutch:`), so clusters can share one Redis. */
  prefix?: string;
}

/** What a broker reports to a gateway sampling it for a placement. */
export interface BrokerLoad {
  broker: string;
  sessions: number;
  liveVms: number;
  /** Host MemAvailable, MiB (what the kernel could give new VMs now). */
  memAvailableMiB: number;
  /** What a wake can have of the admission memory budget now (live VMs hold theirs; standbys give theirs up), MiB. */
  budgetFreeMiB: number;
  /** Wakes waiting for admission. */
  wakeQueue: number;
  /** VM calls waiting for admission. */
  vmCallQueue: number;
  /** Calls refused with `busy` (admission) over the last minute. */
  admissionRefusals: number;
  templates: string[];
}

/** What the broker exposes for its load (structural, so this module does not import the Broker). */
export interface LoadSource {
  sessions: { all(): Array<{ id: string; vm: { vmState: string } }>; ownerOf(id: string): string | undefined };
  admission: Admission;
  metrics: BrokerMetrics;
}

const REFUSAL_WINDOW_MS = 60_000;

export class ClusterMember {
  readonly id: string;
  readonly leaseMs: number;
  private readonly catalog: Catalog;
  private readonly credential: GatewayCredential;
  private record: BrokerRecord | undefined;
  private timer: NodeJS.Timeout | undefined;
  private renewing: Promise<void> | undefined;
  /** Cumulative `busy` refusals with when they were seen: the last minute's increase is the load signal. */
  private readonly refusalSamples: Array<{ at: number; total: number }> = [];

  constructor(
    private readonly o: ClusterOptions,
    private readonly source: LoadSource,
    principals: Principals,
    private readonly log: Logger,
  ) {
    this.id = checkBrokerId(o.brokerId ?? hostname());
    this.leaseMs = o.leaseMs ?? 10_000;
    this.credential = new GatewayCredential(o.gatewayToken);
    // The credential must not also be some tenant's token: that tenant would then be a gateway.
    if (principals.authenticate(o.gatewayToken) !== undefined) throw new HutchError('bad_request', 'the gateway credential equals a tenant token; give it its own secret');
    principals.trustGateway(this.credential);
    this.catalog = new Catalog(o.catalogUrl, o.prefix);
  }

  /**
   * Registers once listening, then renews every third of the lease. A failed renewal is retried
   * next tick (the lease covers two misses). At the start and whenever the record was missing,
   * the broker's sessions are put back in the map (SET NX: a placement made meanwhile wins), so
   * a catalog that lost its data is rebuilt by the brokers, and a restarted broker's sessions
   * are found. Each under its owner's key: a broker holding an id another principal also
   * holds elsewhere puts back its own principal's entry, never the other's.
   */
  async register(port: number, host?: string): Promise<void> {
    // A broker bound to one address is reached there; one bound to all addresses by its host name.
    const at = host && host !== '0.0.0.0' && host !== '::' ? (host.includes(':') ? `[${host}]` : host) : hostname();
    this.record = { id: this.id, url: this.o.advertiseUrl ?? `ws://${at}:${port}`, templates: this.o.templates ?? [], startedAt: new Date().toISOString() };
    await this.catalog.putBroker(this.record, this.leaseMs);
    await this.publishSessions();
    this.log.info('cluster.registered', { broker: this.id, url: this.record.url, leaseMs: this.leaseMs });
    this.timer = setInterval(() => {
      if (this.renewing || !this.record) return;
      this.renewing = this.catalog
        .putBroker(this.record, this.leaseMs)
        .then((fresh) => (fresh ? this.publishSessions() : undefined))
        .catch((err: unknown) => this.log.warn('cluster.renew_failed', { broker: this.id, error: (err as Error).message }))
        .finally(() => (this.renewing = undefined));
    }, Math.max(50, Math.floor(this.leaseMs / 3)));
    this.timer.unref();
  }

  /** Puts every session this broker holds into the session map, unless the id is placed already. */
  private async publishSessions(): Promise<void> {
    const all = this.source.sessions.all();
    const put = await Promise.all(all.map((s) => this.catalog.claimSession(s.id, { broker: this.id, principal: this.source.sessions.ownerOf(s.id) ?? DEFAULT_PRINCIPAL })));
    this.log.info('cluster.sessions_published', { broker: this.id, sessions: all.length, added: put.filter(Boolean).length });
  }

  /** Stops renewing and removes the registration now: gateways place nothing new here from the next read on. */
  async deregister(): Promise<void> {
    if (this.timer) clearInterval(this.timer);
    this.timer = undefined;
    await this.renewing;
    if (!this.record) return;
    this.record = undefined;
    await this.catalog.removeBroker(this.id).catch((err: unknown) => this.log.warn('cluster.deregister_failed', { broker: this.id, error: (err as Error).message }));
    this.log.info('cluster.deregistered', { broker: this.id });
  }

  close(): void {
    if (this.timer) clearInterval(this.timer);
    this.catalog.close();
  }

  static serves(url: string | undefined): boolean {
    return url === '/load';
  }

  /** GET /load, for gateways only (it tells how busy the host is, which tenants need not know). */
  async handleHttp(req: IncomingMessage, res: ServerResponse): Promise<void> {
    if (!this.credential.matches(bearer(req))) {
      res.writeHead(401, { 'content-type': 'text/plain' }).end('unauthorized: /load is for gateways\n');
      return;
    }
    res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify(await this.load()));
  }

  async load(): Promise<BrokerLoad> {
    const all = this.source.sessions.all();
    const a = this.source.admission;
    return {
      broker: this.id,
      sessions: all.length,
      liveVms: all.filter((s) => s.vm.vmState === 'live').length,
      memAvailableMiB: memAvailableMiB(),
      budgetFreeMiB: a.freeMiB,
      wakeQueue: a.wakes.waiting,
      vmCallQueue: a.vmCalls.waiting,
      admissionRefusals: await this.recentRefusals(),
      templates: this.o.templates ?? [],
    };
  }

  private async recentRefusals(): Promise<number> {
    const m = await this.source.metrics.errors.get();
    const total = m.values.filter((v) => v.labels['code'] === 'busy').reduce((s, v) => s + v.value, 0);
    const now = Date.now();
    this.refusalSamples.push({ at: now, total });
    while (this.refusalSamples.length > 1 && (this.refusalSamples[0] as { at: number }).at < now - REFUSAL_WINDOW_MS) this.refusalSamples.shift();
    return total - (this.refusalSamples[0] as { total: number }).total;
  }
}

/** The answer for new work on a draining broker: typed, naming the broker. */
export function drainingError(broker: string | undefined): HutchError {
  return new HutchError('unavailable', `broker ${broker ?? '(single host)'} is draining: its sessions come back when it restarts`, { ...(broker ? { broker } : {}), reason: 'draining' });
}

function memAvailableMiB(): number {
  try {
    const m = /^MemAvailable:\s+(\d+) kB/m.exec(readFileSync('/proc/meminfo', 'utf8'));
    if (m) return Math.floor(Number(m[1]) / 1024);
  } catch {
    // not Linux: fall through
  }
  return 0;
}
