import { createServer, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { Counter, Gauge, Histogram, Registry, collectDefaultMetrics } from 'prom-client';
import type { CallUsage, TelemetrySample } from '../../guest-agent/src/protocol/methods-telemetry.ts';

/** Seconds; call latencies span sub-millisecond file tools to multi-second cold wakes. */
const LATENCY_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 1.5, 2.5, 5, 10, 30];

/** One call as the broker saw it; exported as metrics and logged. */
export interface CallRecord {
  tool: string;
  /** `none`: the call failed before a route was chosen (bad arguments). */
  route: 'inprocess' | 'fastpath' | 'vm' | 'none';
  ok: boolean;
  woke: boolean;
  wakeHow?: string;
  /** Ms from the wake's start to the end of each phase. */
  wakePhases?: Record<string, number>;
  totalMs: number;
  addedMs: number;
  wakeMs: number;
  queuedMs: number;
  pushedBytes: number;
  pulledBytes: number;
  /** Memory cost of a VM call as the guest measured it. */
  usage?: CallUsage;
}

/** Guest processes exported by command name, at most this many names (the rest is "other"). */
const MAX_COMM_LABELS = 12;

/**
 * The broker's Prometheus metrics. Label sets are bounded (tool, route, decision names),
 * never session ids, so the series count does not grow with tenants.
 */
/** Wake phases in the order they end (resume overlaps the push). */
const WAKE_PHASES = ['standby', 'restore', 'channel', 'push', 'resume', 'mark', 'exec'] as const;

export class BrokerMetrics {
  readonly registry = new Registry();
  private readonly calls = new Counter({ name: 'hutch_calls_total', help: 'Tool calls by tool, route and outcome', labelNames: ['tool', 'route', 'outcome'], registers: [this.registry] });
  private readonly added = new Histogram({ name: 'hutch_call_added_seconds', help: 'Latency hutch added to a call (broker time minus the command run time)', labelNames: ['route'], buckets: LATENCY_BUCKETS, registers: [this.registry] });
  private readonly total = new Histogram({ name: 'hutch_call_seconds', help: 'Broker time per call', labelNames: ['route'], buckets: LATENCY_BUCKETS, registers: [this.registry] });
  private readonly queued = new Histogram({ name: 'hutch_call_queued_seconds', help: 'Time a VM call waited for admission', buckets: LATENCY_BUCKETS, registers: [this.registry] });
  readonly wakes = new Counter({ name: 'hutch_wakes_total', help: 'Sandbox wakes by how they came up', labelNames: ['how'], registers: [this.registry] });
  readonly wakePhase = new Histogram({ name: 'hutch_wake_phase_seconds', help: 'Time in each phase of a wake (standby taken, or restore and channel; push, mark, exec: the call handed to the guest; resume runs beside the push and is measured from the wake start)', labelNames: ['phase'], buckets: LATENCY_BUCKETS, registers: [this.registry] });
  readonly wakeSeconds = new Histogram({ name: 'hutch_wake_seconds', help: 'Call arrival to a ready agent with the workspace pushed', labelNames: ['how'], buckets: LATENCY_BUCKETS, registers: [this.registry] });
  readonly releases = new Counter({ name: 'hutch_releases_total', help: 'Idle releases by decision', labelNames: ['decision'], registers: [this.registry] });
  readonly releaseSeconds = new Histogram({ name: 'hutch_release_seconds', help: 'Time to release an idle VM', labelNames: ['decision'], buckets: LATENCY_BUCKETS, registers: [this.registry] });
  readonly releaseBytes = new Counter({ name: 'hutch_release_written_bytes_total', help: 'Bytes written by releases (snapshot slots)', labelNames: ['decision'], registers: [this.registry] });
  readonly syncBytes = new Counter({ name: 'hutch_sync_bytes_total', help: 'Workspace bytes moved between host and guests', labelNames: ['direction'], registers: [this.registry] });
  readonly liveVms = new Gauge({ name: 'hutch_live_vms', help: 'VMs running now', registers: [this.registry] });
  readonly sessions = new Gauge({ name: 'hutch_sessions', help: 'Open sessions', registers: [this.registry] });
  readonly buildInfo = new Gauge({ name: 'hutch_build_info', help: "Always 1: this broker's version, backend and accelerator (kvm, tcg, or none)", labelNames: ['version', 'backend', 'accel'], registers: [this.registry] });
  readonly standbyVms = new Gauge({ name: 'hutch_standby_vms', help: 'Standby VMs ready to take, and being prepared', labelNames: ['state'], registers: [this.registry] });
  readonly memoryBudget = new Gauge({ name: 'hutch_memory_budget_mib', help: 'Host memory the broker lets its VMs reserve (--memory-budget-mib)', registers: [this.registry] });
  readonly memoryReserved = new Gauge({ name: 'hutch_memory_reserved_mib', help: 'Memory budget reserved, by live VMs, by standby VMs (which give theirs up to a wake) and by running fast-path commands', labelNames: ['holder'], registers: [this.registry] });
  readonly slotDisk = new Gauge({ name: 'hutch_slot_disk_bytes', help: "Data dir disk held by snapshot slots, and the most they may take (--slot-disk-gib)", labelNames: ['state'], registers: [this.registry] });
  readonly watchedDirs = new Gauge({ name: 'hutch_watched_dirs', help: "Directories the broker's file watchers hold (inotify watches of its user), and the most it allows", labelNames: ['state'], registers: [this.registry] });
  readonly admissionWaiting = new Gauge({ name: 'hutch_admission_waiting', help: 'Wakes, VM calls and fast-path runs waiting for admission', labelNames: ['kind'], registers: [this.registry] });
  private readonly callFaults = new Histogram({ name: 'hutch_call_major_faults', help: 'Major page faults in the guest during a VM call', buckets: [0, 10, 100, 1000, 10_000, 100_000], registers: [this.registry] });
  private readonly callSwapRead = new Counter({ name: 'hutch_call_swap_read_bytes_total', help: 'Bytes VM calls read back from guest swap disks', registers: [this.registry] });
  private readonly callZswapIns = new Counter({ name: 'hutch_call_zswap_loads_total', help: 'Pages VM calls decompressed from guest zswap pools', registers: [this.registry] });
  readonly guestMemory = new Gauge({ name: 'hutch_guest_memory_bytes', help: 'Guest memory summed over sampled live VMs, by kind', labelNames: ['kind'], registers: [this.registry] });
  readonly guestVms = new Gauge({ name: 'hutch_guest_vms', help: 'VMs by state at the last scrape (reclaimed VMs are not sampled)', labelNames: ['state'], registers: [this.registry] });
  private readonly guestVmstat = new Counter({ name: 'hutch_guest_vmstat_events_total', help: 'Guest /proc/vmstat events summed over VMs (swap, zswap, refaults, major faults)', labelNames: ['counter'], registers: [this.registry] });
  readonly guestPsi = new Gauge({ name: 'hutch_guest_psi_memory_avg10_max', help: 'Highest guest memory pressure (PSI avg10, percent) over sampled VMs', labelNames: ['kind'], registers: [this.registry] });
  readonly guestProcRss = new Gauge({ name: 'hutch_guest_process_rss_bytes', help: 'Guest process RSS summed by command name (bounded set of names)', labelNames: ['comm'], registers: [this.registry] });
  readonly guestProcCpu = new Gauge({ name: 'hutch_guest_process_cpu_percent', help: 'Guest process CPU summed by command name (bounded set of names)', labelNames: ['comm'], registers: [this.registry] });
  readonly egressConnections = new Counter({ name: 'hutch_egress_connections_total', help: "Sandbox connections through the egress proxy, by outcome (allowed, refused by policy or limit, failed to connect)", labelNames: ['outcome'], registers: [this.registry] });
  readonly egressBytes = new Counter({ name: 'hutch_egress_bytes_total', help: 'Bytes through the egress proxy by direction (in: from destinations) and principal', labelNames: ['direction', 'principal'], registers: [this.registry] });
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
      // Phase durations (each phase's end minus the previous one's), a fixed label set.
      let prev = 0;
      for (const ph of WAKE_PHASES) {
        const end = r.wakePhases?.[ph];
        if (end === undefined) continue;
        if (ph !== 'resume') {
          this.wakePhase.observe({ phase: ph }, Math.max(0, end - prev) / 1000);
          prev = end;
        } else this.wakePhase.observe({ phase: ph }, end / 1000);
      }
    }
    if (r.usage) {
      this.callFaults.observe(r.usage.majorFaults);
      if (r.usage.swapReadBytes) this.callSwapRead.inc(r.usage.swapReadBytes);
      if (r.usage.zswapIns) this.callZswapIns.inc(r.usage.zswapIns);
    }
    if (r.pushedBytes) this.syncBytes.inc({ direction: 'push' }, r.pushedBytes);
    if (r.pulledBytes) this.syncBytes.inc({ direction: 'pull' }, r.pulledBytes);
  }

  /** Counts a guest sample's vmstat increase, whoever asked for it (scrape or subscription). */
  recordGuestSample(s: TelemetrySample): void {
    for (const [k, v] of Object.entries(s.vmstatDelta)) if (v) this.guestVmstat.inc({ counter: k }, v);
  }

  /** Sets the gauges from this scrape's samples (sums over VMs, processes grouped by a bounded set of names). */
  setGuestGauges(states: Array<{ vm: 'none' | 'live' | 'reclaimed'; sample?: TelemetrySample | undefined }>): void {
    this.guestVms.reset();
    for (const st of ['live', 'reclaimed'] as const) this.guestVms.set({ state: st }, states.filter((x) => x.vm === st).length);
    const samples = states.flatMap((x) => (x.sample ? [x.sample] : []));
    this.guestMemory.reset();
    const mem: Record<string, number> = {};
    for (const s of samples) for (const [k, v] of Object.entries(s.memory)) mem[k] = (mem[k] ?? 0) + v;
    for (const [k, v] of Object.entries(mem)) this.guestMemory.set({ kind: k.replace(/Bytes$/, '') }, v);
    this.guestPsi.reset();
    this.guestPsi.set({ kind: 'some' }, Math.max(0, ...samples.map((s) => s.psiMemory?.someAvg10 ?? 0)));
    this.guestPsi.set({ kind: 'full' }, Math.max(0, ...samples.map((s) => s.psiMemory?.fullAvg10 ?? 0)));
    const byComm = new Map<string, { rss: number; cpu: number }>();
    for (const s of samples) {
      for (const p of s.processes) {
        const e = byComm.get(p.comm) ?? { rss: 0, cpu: 0 };
        e.rss += p.rssBytes;
        e.cpu += p.cpuPercent;
        byComm.set(p.comm, e);
      }
    }
    const ranked = [...byComm.entries()].sort((a, b) => b[1].rss - a[1].rss);
    const other = { rss: 0, cpu: 0 };
    for (const [, e] of ranked.slice(MAX_COMM_LABELS)) {
      other.rss += e.rss;
      other.cpu += e.cpu;
    }
    this.guestProcRss.reset();
    this.guestProcCpu.reset();
    for (const [comm, e] of [...ranked.slice(0, MAX_COMM_LABELS), ...(other.rss || other.cpu ? [['other', other] as const] : [])]) {
      this.guestProcRss.set({ comm }, e.rss);
      this.guestProcCpu.set({ comm }, e.cpu);
    }
  }

  text(): Promise<string> {
    return this.registry.metrics();
  }

  get contentType(): string {
    return this.registry.contentType;
  }
}

/** A scrape-only address (--metrics-port): /metrics without a token, answered by `serve`; nothing else. */
export async function listenMetrics(at: { host: string; port: number }, serve: (res: ServerResponse) => Promise<unknown>): Promise<{ server: Server; port: number }> {
  const server = createServer((req, res) => {
    if (req.url === '/metrics') void serve(res);
    else res.writeHead(404, { 'content-type': 'text/plain' }).end('only /metrics here\n');
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(at.port, at.host, () => resolve());
  });
  return { server, port: (server.address() as AddressInfo).port };
}
