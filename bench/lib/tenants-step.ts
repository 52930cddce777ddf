/**
 * One step of the density search: a fresh real broker (qemu backend, in this process) at
 * one level, N tenants on their own WebSocket SDK connections for a fixed wall time, the
 * host sampled throughout; then the per-call samples reduced to the step's figures and
 * checked against the pass rule (p99 added < 1.5 s, no errors, no OOM).
 */
import { mkdirSync, rmSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { loadavg } from 'node:os';
import { randomBytes } from 'node:crypto';
import { createLogger } from '../../guest-agent/src/log.ts';
import { serve, type ServeOptions } from '../../host-broker/src/cli.ts';
import type { Broker } from '../../host-broker/src/broker.ts';
import type { SandboxPolicy } from '../../host-broker/src/policy/sandbox-policy.ts';
import { Hutch } from '../../host-broker/src/sdk/index.ts';
import { percentile, round } from './report.ts';
import type { RecordedSession } from './sessions.ts';
import { HostSampler, type HostCost } from './tenants-host.ts';
import { seededRng, streamSeed } from './tenants-rng.ts';
import { runTenant, type CallSample } from './tenants-tenant.ts';

export const PASS_P99_MS = 1500;

export interface StepPlan {
  level: string;
  policy: SandboxPolicy;
  tenants: number;
  durationMs: number;
  compression: number;
  seed: number;
  sessions: RecordedSession[];
  templates: Map<string, string>;
  bare: Map<string, number[]>;
  workDir: string;
  progress: (m: string) => void;
}

export interface StepResult {
  level: string;
  tenants: number;
  accel: string;
  duration_s: number;
  wall_s: number;
  time_compression: number;
  seed: number;
  calls: number;
  errors: number;
  error_samples: string[];
  tasks: number;
  completed_tasks: number;
  wakes: number;
  wakes_by_how: Record<string, number>;
  releases_by_decision: Record<string, number>;
  routes: Record<string, number>;
  p50_added_ms: number;
  p90_added_ms: number;
  p99_added_ms: number;
  max_added_ms: number;
  p50_broker_added_ms: number;
  p99_broker_added_ms: number;
  p99_added_ms_by_route: Record<string, number>;
  cpu_host_pct: number;
  cpu_tree_pct: number;
  /** 1-minute load average at the end of the step (the host is shared: other work shows here). */
  load1: number;
  peak_host_mib: number;
  baseline_host_mib: number;
  peak_qemu_pss_mib: number;
  peak_qemu_rss_mib: number;
  peak_live_vms: number;
  oom_kills: number;
  pass: boolean;
  fail_reasons: string[];
  /**
   * The broker-added rule: p99 of the broker's own added time < 1.5 s, no errors, no OOM.
   * It leaves the guest's run time out, so a host whose guests run slower (TCG) can judge it.
   */
  pass_broker_rule: boolean;
  broker_rule_fail_reasons: string[];
  /** Host MiB (MemTotal - MemAvailable above baseline, at its peak) per tenant of the step. */
  host_mib_per_tenant: number;
  /** Summed QEMU PSS at its peak over the most VMs alive at once. */
  qemu_pss_mib_per_live_vm: number;
}

/** A level the broker cannot run (serve() refused its policy, or ran it as something else). */
export class LevelUnavailable extends Error {}

type MetricValues = { values: Array<{ value: number; labels: Record<string, string | number | undefined> }> };

async function byLabel(metric: { get(): Promise<MetricValues> }, label: string): Promise<Record<string, number>> {
  const out: Record<string, number> = {};
  for (const v of (await metric.get()).values) if (v.value) out[String(v.labels[label])] = (out[String(v.labels[label])] ?? 0) + v.value;
  return out;
}

/** Why the broker did not run `policy` as asked, judged from what it did; undefined when it did. */
export function policyMismatch(policy: SandboxPolicy, seen: { routes: Record<string, number>; wakesByHow: Record<string, number>; releasesByDecision: Record<string, number> }): string | undefined {
  const offVm = (seen.routes['inprocess'] ?? 0) + (seen.routes['fastpath'] ?? 0);
  if (!policy.routing && offVm > 0) return `routing should be off, but ${offVm} calls ran outside the VM (serve() does not apply policy.routing)`;
  const restores = (seen.wakesByHow['pristine-restore'] ?? 0) + (seen.wakesByHow['slot-restore'] ?? 0);
  if (policy.wake === 'cold-boot' && restores > 0) return `wake should be a cold boot, but ${restores} wakes were snapshot restores (serve() does not apply policy.wake)`;
  if (policy.wake === 'restore' && (seen.wakesByHow['cold-boot'] ?? 0) > 0) return `wake should be a restore, but the broker cold-booted`;
  const releases = Object.values(seen.releasesByDecision).reduce((a, b) => a + b, 0);
  if (policy.idleMs === null && releases > 0) return `VMs should never be released, but the broker released ${releases} (serve() does not apply policy.idleMs)`;
  if (policy.idlePolicy === 'reclaim' && releases > 0 && !seen.releasesByDecision['reclaim']) {
    return `idle VMs should be reclaimed, but releases were ${JSON.stringify(seen.releasesByDecision)} (serve() does not apply policy.idlePolicy=reclaim)`;
  }
  return undefined;
}

async function startBroker(plan: StepPlan, dataDir: string, token: string): Promise<Broker> {
  // A broker that accepts the policy but runs something else is caught afterwards by
  // policyMismatch(), from what it did.
  const opts: ServeOptions = {
    port: 0,
    host: '127.0.0.1',
    token,
    dataDir,
    // The project templates tenants are created from (directory sources need a root).
    workspaceRoots: [...new Set([...plan.templates.values()].map((t) => dirname(t)))],
    log: createLogger({ name: 'hutch-broker', level: 'error' }),
    policy: plan.policy,
    // Every tenant is the one principal here (plus the warm-up session).
    maxSessionsPerPrincipal: plan.tenants + 8,
  };
  try {
    return await serve(opts);
  } catch (err) {
    throw new LevelUnavailable(`the broker refused level ${plan.level} (${JSON.stringify(plan.policy)}): ${(err as Error).message}`);
  }
}

/**
 * Before the clock starts: one forced VM call (builds the pristine snapshot if the guest
 * image changed since the last broker, and warms the restore path), then one `list`
 * whose route and wake show whether the broker applies the level's policy.
 */
async function warmUp(plan: StepPlan, broker: Broker, h: Hutch): Promise<void> {
  const s = plan.sessions[0] as RecordedSession;
  const sb = await h.create({ workspace: { dir: plan.templates.get(s.project) as string } });
  try {
    let r;
    try {
      r = await sb.run('true', { route: 'vm', timeoutMs: 60_000 });
    } catch (err) {
      throw new LevelUnavailable(`level ${plan.level}: the warm-up VM call failed: ${(err as Error).message}`);
    }
    if (r.exitCode !== 0) throw new LevelUnavailable(`level ${plan.level}: the warm-up VM call exited ${r.exitCode}: ${r.stderr.trim().slice(0, 200)}`);
    const l = await sb.call('list', {});
    const why = policyMismatch(plan.policy, { routes: { [l.route]: 1 }, wakesByHow: await byLabel(broker.metrics.wakes, 'how'), releasesByDecision: {} });
    if (why) throw new LevelUnavailable(`level ${plan.level}: ${why}`);
    plan.progress(`level ${plan.level} N=${plan.tenants}: warm-up wake ${Math.round(r.timing.wakeMs)} ms (${l.route} for a file tool)`);
  } finally {
    await sb.close();
  }
}

function minus(a: Record<string, number>, b: Record<string, number>): Record<string, number> {
  const out: Record<string, number> = {};
  for (const [k, v] of Object.entries(a)) if (v - (b[k] ?? 0) > 0) out[k] = v - (b[k] ?? 0);
  return out;
}

export async function runStep(plan: StepPlan): Promise<{ result: StepResult; samples: CallSample[] }> {
  const dataDir = join(plan.workDir, `broker-${plan.level}-${plan.tenants}-${Date.now()}`);
  mkdirSync(dataDir, { recursive: true });
  const token = randomBytes(16).toString('hex');
  const sampler = new HostSampler();
  const t0 = performance.now();
  const samples: CallSample[] = [];
  const problems: string[] = [];
  let broker: Broker | undefined;
  const clients: Hutch[] = [];
  let accel = 'unknown';
  let tasks = 0;
  let completed = 0;
  let wakesByHow: Record<string, number> = {};
  let releasesByDecision: Record<string, number> = {};
  let cost: HostCost | undefined;
  try {
    broker = await startBroker(plan, dataDir, token);
    const url = `ws://127.0.0.1:${broker.port}`;
    for (let i = 0; i < plan.tenants; i++) clients.push(await Hutch.connect(url, { token }));
    accel = clients[0]?.accel ?? clients[0]?.backend ?? 'unknown';
    await warmUp(plan, broker, clients[0] as Hutch);
    const wakes0 = await byLabel(broker.metrics.wakes, 'how');
    const releases0 = await byLabel(broker.metrics.releases, 'decision');
    const startedAt = performance.now();
    const deadline = startedAt + plan.durationMs;
    const outcomes = await Promise.all(
      clients.map((hutch, id) =>
        runTenant({
          id,
          hutch,
          rng: seededRng(streamSeed(plan.seed, plan.level, plan.tenants, id)),
          sessions: plan.sessions,
          templates: plan.templates,
          bare: plan.bare,
          compression: plan.compression,
          startedAt,
          deadline,
          prewarm: plan.policy.idleMs === null,
          record: (s) => samples.push(s),
          problem: (m) => problems.push(m),
        }).catch((err: unknown) => {
          problems.push(`tenant ${id} stopped: ${(err as Error).message}`);
          return { tasks: 0, completedTasks: 0 };
        }),
      ),
    );
    for (const o of outcomes) {
      tasks += o.tasks;
      completed += o.completedTasks;
    }
    wakesByHow = minus(await byLabel(broker.metrics.wakes, 'how'), wakes0);
    releasesByDecision = minus(await byLabel(broker.metrics.releases, 'decision'), releases0);
  } finally {
    for (const c of clients) c.close();
    await broker?.stop().catch((err: unknown) => problems.push(`broker stop failed: ${(err as Error).message}`));
    cost = sampler.stop();
    rmSync(dataDir, { recursive: true, force: true });
  }
  const routes: Record<string, number> = {};
  for (const s of samples) routes[s.route ?? 'none'] = (routes[s.route ?? 'none'] ?? 0) + 1;
  const mismatch = policyMismatch(plan.policy, { routes, wakesByHow, releasesByDecision });
  if (mismatch) throw new LevelUnavailable(`level ${plan.level}: ${mismatch}`);

  const added = samples.map((s) => s.addedMs);
  const brokerAdded = samples.flatMap((s) => (s.brokerAddedMs === undefined ? [] : [s.brokerAddedMs]));
  const failed = samples.filter((s) => !s.ok);
  const errors = failed.length + problems.length;
  const p99 = percentile(added, 99);
  const failReasons: string[] = [];
  if (samples.length === 0) failReasons.push('no calls completed');
  if (p99 >= PASS_P99_MS) failReasons.push(`p99 added ${Math.round(p99)} ms >= ${PASS_P99_MS}`);
  if (errors > 0) failReasons.push(`${errors} errors`);
  if (cost.oomKills > 0) failReasons.push(`${cost.oomKills} OOM kills on the host`);
  const p99Broker = percentile(brokerAdded, 99);
  const brokerRuleFails = failReasons.filter((r) => !r.startsWith('p99 added'));
  if (brokerAdded.length === 0) brokerRuleFails.push('no broker-added times reported');
  else if (p99Broker >= PASS_P99_MS) brokerRuleFails.push(`p99 broker-added ${Math.round(p99Broker)} ms >= ${PASS_P99_MS}`);
  const byRoute: Record<string, number> = {};
  for (const r of Object.keys(routes)) byRoute[r] = round(percentile(samples.filter((s) => (s.route ?? 'none') === r).map((s) => s.addedMs), 99), 0);
  const result: StepResult = {
    level: plan.level,
    tenants: plan.tenants,
    accel,
    duration_s: plan.durationMs / 1000,
    wall_s: round((performance.now() - t0) / 1000, 1),
    time_compression: plan.compression,
    seed: plan.seed,
    calls: samples.length,
    errors,
    error_samples: [...problems, ...failed.map((s) => `${s.session}#${s.index + 1} ${s.tool} (${s.route ?? 'no route'}): ${s.error}`)].slice(0, 12),
    tasks,
    completed_tasks: completed,
    wakes: samples.filter((s) => s.woke).length,
    wakes_by_how: wakesByHow,
    releases_by_decision: releasesByDecision,
    routes,
    p50_added_ms: round(percentile(added, 50), 0),
    p90_added_ms: round(percentile(added, 90), 0),
    p99_added_ms: round(p99, 0),
    max_added_ms: round(added.length ? Math.max(...added) : NaN, 0),
    p50_broker_added_ms: round(percentile(brokerAdded, 50), 0),
    p99_broker_added_ms: round(percentile(brokerAdded, 99), 0),
    p99_added_ms_by_route: byRoute,
    cpu_host_pct: round(cost.hostCpuPct, 1),
    cpu_tree_pct: round(cost.treeCpuPct, 1),
    load1: round(loadavg()[0] ?? NaN, 2),
    peak_host_mib: round(cost.peakHostMiB, 0),
    baseline_host_mib: round(cost.baselineHostMiB, 0),
    peak_qemu_pss_mib: round(cost.peakQemuPssMiB, 0),
    peak_qemu_rss_mib: round(cost.peakQemuRssMiB, 0),
    peak_live_vms: cost.peakLiveQemu,
    oom_kills: cost.oomKills,
    pass: failReasons.length === 0,
    fail_reasons: failReasons,
    pass_broker_rule: brokerRuleFails.length === 0,
    broker_rule_fail_reasons: brokerRuleFails,
    host_mib_per_tenant: round(cost.peakHostMiB / plan.tenants, 1),
    qemu_pss_mib_per_live_vm: cost.peakLiveQemu > 0 ? round(cost.peakQemuPssMiB / cost.peakLiveQemu, 1) : 0,
  };
  plan.progress(
    `level ${plan.level} N=${plan.tenants}: ${result.pass ? 'PASS' : `fail (${failReasons.join('; ')})`}; broker-added rule ${result.pass_broker_rule ? 'PASS' : `fail (${brokerRuleFails.join('; ')})`}; ${result.calls} calls, ${result.wakes} wakes, p50/p99 added ${result.p50_added_ms}/${result.p99_added_ms} ms, CPU ${result.cpu_tree_pct}% (host ${result.cpu_host_pct}%), +${result.peak_host_mib} MiB host, ${result.wall_s} s`,
  );
  return { result, samples };
}
