import { Counter, Gauge, Histogram, Registry, collectDefaultMetrics } from 'prom-client';

/** Seconds; call latencies span sub-millisecond file tools to multi-second cold wakes. */
const LATENCY_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 1.5, 2.5, 5, 10, 30];

/** One call as the broker saw it; exported as metrics and logged. */
export interface CallRecord {
  tool: string;
  route: 'inprocess' | 'fastpath' | 'vm';
  ok: boolean;
  woke: boolean;
  wakeHow?: string;
  totalMs: number;
  addedMs: number;
  wakeMs: number;
  queuedMs: number;
  pushedBytes: number;
  pulledBytes: number;
}

/**
 * The broker's Prometheus metrics. Label sets are bounded (tool, route, decision names),
 * never session ids, so the series count does not grow with tenants.
 */
export class BrokerMetrics {
  readonly registry = new Registry();
  private readonly calls = new Counter({ name: 'hutch_calls_total', help: 'Tool calls by tool, route and outcome', labelNames: ['tool', 'route', 'outcome'], registers: [this.registry] });
  private readonly added = new Histogram({ name: 'hutch_call_added_seconds', help: 'Latency hutch added to a call (broker time minus the command run time)', labelNames: ['route'], buckets: LATENCY_BUCKETS, registers: [this.registry] });
  private readonly total = new Histogram({ name: 'hutch_call_seconds', help: 'Broker time per call', labelNames: ['route'], buckets: LATENCY_BUCKETS, registers: [this.registry] });
  private readonly queued = new Histogram({ name: 'hutch_call_queued_seconds', help: 'Time a VM call waited for admission', buckets: LATENCY_BUCKETS, registers: [this.registry] });
  readonly wakes = new Counter({ name: 'hutch_wakes_total', help: 'Sandbox wakes by how they came up', labelNames: ['how'], registers: [this.registry] });
  readonly wakeSeconds = new Histogram({ name: 'hutch_wake_seconds', help: 'Call arrival to a ready agent with the workspace pushed', labelNames: ['how'], buckets: LATENCY_BUCKETS, registers: [this.registry] });
  readonly releases = new Counter({ name: 'hutch_releases_total', help: 'Idle releases by decision', labelNames: ['decision'], registers: [this.registry] });
  readonly releaseSeconds = new Histogram({ name: 'hutch_release_seconds', help: 'Time to release an idle VM', labelNames: ['decision'], buckets: LATENCY_BUCKETS, registers: [this.registry] });
  readonly releaseBytes = new Counter({ name: 'hutch_release_written_bytes_total', help: 'Bytes written by releases (snapshot slots)', labelNames: ['decision'], registers: [this.registry] });
  readonly syncBytes = new Counter({ name: 'hutch_sync_bytes_total', help: 'Workspace bytes moved between host and guests', labelNames: ['direction'], registers: [this.registry] });
  readonly liveVms = new Gauge({ name: 'hutch_live_vms', help: 'VMs running now', registers: [this.registry] });
  readonly sessions = new Gauge({ name: 'hutch_sessions', help: 'Open sessions', registers: [this.registry] });
  readonly admissionWaiting = new Gauge({ name: 'hutch_admission_waiting', help: 'Wakes and VM calls waiting for admission', labelNames: ['kind'], registers: [this.registry] });
  readonly errors = new Counter({ name: 'hutch_errors_total', help: 'Failed calls by error code', labelNames: ['code'], registers: [this.registry] });

  constructor(opts: { processMetrics?: boolean } = {}) {
    if (opts.processMetrics ?? true) collectDefaultMetrics({ register: this.registry, prefix: 'hutch_broker_' });
  }

  recordCall(r: CallRecord): void {
    this.calls.inc({ tool: r.tool, route: r.route, outcome: r.ok ? 'ok' : 'error' });
    if (!r.ok) return;
    this.added.observe({ route: r.route }, r.addedMs / 1000);
    this.total.observe({ route: r.route }, r.totalMs / 1000);
    if (r.route === 'vm') this.queued.observe(r.queuedMs / 1000);
    if (r.woke) {
      this.wakes.inc({ how: r.wakeHow ?? 'unknown' });
      this.wakeSeconds.observe({ how: r.wakeHow ?? 'unknown' }, r.wakeMs / 1000);
    }
    if (r.pushedBytes) this.syncBytes.inc({ direction: 'push' }, r.pushedBytes);
    if (r.pulledBytes) this.syncBytes.inc({ direction: 'pull' }, r.pulledBytes);
  }

  text(): Promise<string> {
    return this.registry.metrics();
  }

  get contentType(): string {
    return this.registry.contentType;
  }
}
