/**
 * Memory on wake, the published method: rounds of warm call, idle, wakeup call, for
 * long-lived workloads that survive between calls, driven the way the broker drives a
 * guest: mem.policy `idle` (the agent reclaims by its own policy), then mem.policy
 * `active` and the call. Three settings of the policy's steps:
 *
 *   stock     reclaim everything (memory.reclaim), wake with the call itself
 *   prefetch  same reclaim; on wake, the agent starts MADV_WILLNEED of the activation set
 *             recorded during the warm call once the call has started, alongside it
 *   hotset    "hot set last" reclaim (cold pages to disk with the pool closed, then the
 *             activation set into the pool, writeback off); wake with the call
 *
 * `npx tsx bench/wakeup-memory.ts [--json] [--rounds N] [--quick]`
 *
 * --quick: the Python server without the corpus's projects (it keeps its stdlib and state),
 * the stock policy alone, two rounds (one VM), to check the bench reaches its JSON line
 * (test/benches.test.ts, VM tier); its numbers are not a measurement.
 *
 *   <workload>_<policy>_swap_mb_read   MB read from the swap disk by the wake (prefetch + call), median
 *   <workload>_<policy>_wake_ms        mem.policy active + call (the prefetch runs inside it), host wall time, median
 *   <workload>_<policy>_idle_host_mib  what the idle VM costs the host after reclaim, once free page reporting
 *                                      settled: QEMU's private memory (USS) plus what of it the host swapped
 *                                      out, median. Not RSS, which also counts pages shared with other
 *                                      processes (QEMU's binary and libraries).
 *   <workload>_<policy>_idle_rss_mib   QEMU's RSS at the same moment, for comparison
 *
 * Median of rounds 2..N (round 1 warms caches). Each policy has its own VM (see runPolicy).
 *
 * The VMs are cold-booted (anonymous guest RAM): QEMU 7.2 punches reported free pages out
 * of a file-backed RAM block even when it is mapped privately, which for a VM restored
 * from the pristine snapshot would damage the shared snapshot file (see
 * guest-agent/src/memory/page-reporting.ts). The policy's reporting step sets the guest's
 * page_reporting_order to 0 while idle, so pages freed one by one by reclaim go back to the host.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { createLogger } from '../guest-agent/src/log.ts';
import type { AgentClient } from '../host-broker/src/agent-client.ts';
import { QemuBackend } from '../host-broker/src/backends/qemu-backend.ts';
import { cacheDir } from '../host-broker/src/backends/registry.ts';
import { connectAgent } from '../host-broker/src/vm/agent-channel.ts';
import { processMemory } from '../host-broker/src/vm/smaps.ts';
import type { Vm } from '../host-broker/src/vm/vmm.ts';
import type { MemoryPolicySteps } from '../guest-agent/src/protocol/methods-memory.ts';
import { benchArgs, emit, markdownTable, median, round } from './lib/report.ts';
import { NODE_LSP, PYTHON_REPL, callWorkload, startWorkload, type LongLivedWorkload } from './lib/memory-workloads.ts';

const args = benchArgs();
const roundsIdx = args.argv.indexOf('--rounds');
const quick = args.argv.includes('--quick');
const ROUNDS = roundsIdx > 0 ? Number(args.argv[roundsIdx + 1]) : quick ? 2 : 4;
if (!Number.isInteger(ROUNDS) || ROUNDS < 2) throw new Error('--rounds must be an integer >= 2 (round 1 is a warm-up)');
const ALL_POLICIES = ['stock', 'prefetch', 'hotset'] as const;
type Policy = (typeof ALL_POLICIES)[number];
const POLICIES: readonly Policy[] = quick ? ['stock'] : ALL_POLICIES;
/** The policy's steps each setting switches; everything else as the broker runs it (DEFAULT_MEMORY_POLICY). */
const STEPS: Record<Policy, Partial<MemoryPolicySteps>> = {
  stock: { hotSetLast: false, prefetch: false },
  prefetch: { hotSetLast: false, prefetch: true },
  hotset: { hotSetLast: true, prefetch: false },
};
/** The Python server with no projects to test: its start command without their names. */
const PYTHON_ALONE: LongLivedWorkload = { ...PYTHON_REPL, projects: [], start: PYTHON_REPL.start.replace(` ${PYTHON_REPL.projects.join(' ')}`, '') };
const WORKLOADS: LongLivedWorkload[] = quick ? [PYTHON_ALONE] : [PYTHON_REPL, NODE_LSP];
const SIZE = { memoryMiB: 512, cpus: 1, swapMiB: 512 };
const PAGE = 4096;
const log = createLogger({ name: 'bench-wakeup-memory', level: 'warn' });
const progress = (m: string) => process.stderr.write(`[wakeup-memory] ${m}\n`);
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

interface Sample {
  workload: string;
  policy: Policy;
  round: number;
  warmMs: number;
  busyHostMiB: number;
  reclaimedMiB: number;
  reclaimMs: number;
  idleHostMiB: number;
  idleRssMiB: number;
  prefetchMs: number;
  prefetchPages: number;
  callMs: number;
  wakeMs: number;
  swapMbRead: number;
  zswapMbRead: number;
  majorFaults: number;
}

/** What a VM costs the host (MiB): QEMU's private memory plus what the host swapped out of it. */
async function hostCostMiB(vm: Vm): Promise<{ cost: number; rss: number }> {
  const m = await processMemory(vm.pid);
  return { cost: (m.privateKiB + m.swapKiB) / 1024, rss: m.rssKiB / 1024 };
}

/**
 * hostCostMiB once free page reporting has settled: the guest reports in passes 2 s apart,
 * each covering part of the free lists, so wait a few passes, then for 4 s without change.
 */
async function settledCostMiB(vm: Vm): Promise<{ cost: number; rss: number }> {
  await sleep(6000);
  let last = await hostCostMiB(vm);
  for (let stable = 0, i = 0; stable < 4 && i < 40; i++) {
    await sleep(1000);
    const now = await hostCostMiB(vm);
    stable = Math.abs(now.cost - last.cost) < 0.5 ? stable + 1 : 0;
    last = now;
  }
  return last;
}

/** The wake's prefetch once it has finished (it may outlast the call it runs beside). */
async function prefetchDone(agent: AgentClient): Promise<{ ms: number; pages: number }> {
  for (let i = 0; i < 600; i++) {
    const p = (await agent.call('telemetry.sample', { processes: false })).memoryPolicy?.prefetch;
    if (!p) return { ms: 0, pages: 0 };
    if (p.state === 'failed') throw new Error(`prefetch failed: ${p.error}`);
    if (p.state === 'done') return { ms: p.ms, pages: p.pages };
    await sleep(100);
  }
  throw new Error('prefetch did not finish in 60 s');
}

async function oneRound(agent: AgentClient, vm: Vm, w: LongLivedWorkload, policy: Policy, roundNo: number): Promise<Sample> {
  const warm = await callWorkload(agent, w);
  const busyHostMiB = (await hostCostMiB(vm)).cost;
  const idleOutcome = await agent.call('mem.policy', { state: 'idle' });
  const r = idleOutcome.reclaim;
  if (!r) throw new Error(`idle did not reclaim: ${JSON.stringify(idleOutcome.warnings)}`);
  const idle = await settledCostMiB(vm);
  const before = (await agent.call('mem.status', {})).swap;
  const t0 = performance.now();
  await agent.call('mem.policy', { state: 'active' });
  const call = await callWorkload(agent, w);
  const wakeMs = performance.now() - t0;
  const { ms: prefetchMs, pages: prefetchPages } = await prefetchDone(agent);
  const after = (await agent.call('mem.status', {})).swap;
  return {
    workload: w.name,
    policy,
    round: roundNo,
    warmMs: warm.wallMs,
    busyHostMiB,
    reclaimedMiB: r.reclaimedBytes / 2 ** 20,
    reclaimMs: r.ms,
    idleHostMiB: idle.cost,
    idleRssMiB: idle.rss,
    prefetchMs,
    prefetchPages,
    callMs: call.wallMs,
    wakeMs,
    swapMbRead: ((after.pswpin - before.pswpin) * PAGE) / 1e6,
    zswapMbRead: ((after.zswpin - before.zswpin) * PAGE) / 1e6,
    majorFaults: after.pgmajfault - before.pgmajfault,
  };
}

/** One VM per (workload, policy): swap slots a policy leaves behind (hot set last puts part
 * of the set on disk, and a page read back keeps its disk copy) must not leak into another
 * policy's measurements. The three policies of a workload run side by side, so a busier or
 * quieter host affects them alike. */
async function runPolicy(backend: QemuBackend, dataDir: string, w: LongLivedWorkload, policy: Policy): Promise<Sample[]> {
  const id = `wake-${w.name}-${policy}`;
  const vm = await backend.driver.boot({ id, dir: join(dataDir, 'vms', id), image: backend.image, ...SIZE });
  const agent = await connectAgent(vm, { timeoutMs: 600_000, log });
  const out: Sample[] = [];
  try {
    await agent.call('mem.policy', { state: 'active', steps: STEPS[policy] });
    const t = performance.now();
    await startWorkload(agent, w, 600_000);
    progress(`${id}: server up in ${((performance.now() - t) / 1000).toFixed(1)} s (accel ${backend.accel})`);
    await callWorkload(agent, w);
    for (let roundNo = 1; roundNo <= ROUNDS; roundNo++) {
      const s = await oneRound(agent, vm, w, policy, roundNo);
      out.push(s);
      progress(`${id} round ${roundNo}: wake ${s.wakeMs.toFixed(0)} ms, swap read ${s.swapMbRead.toFixed(1)} MB, zswap ${s.zswapMbRead.toFixed(1)} MB, idle ${s.idleHostMiB.toFixed(0)} MiB`);
    }
  } finally {
    agent.close();
    await vm.destroy();
  }
  return out;
}

const dataDir = mkdtempSync(join(tmpdir(), 'hutch-bench-wakeup-'));
const backend = await QemuBackend.create({ dataDir, cacheDir: cacheDir(), log });
const samples: Sample[] = [];
try {
  for (const w of WORKLOADS) {
    for (const ss of await Promise.all(POLICIES.map((p) => runPolicy(backend, dataDir, w, p)))) samples.push(...ss);
  }
} finally {
  await backend.shutdown();
  rmSync(dataDir, { recursive: true, force: true });
}

const summary: Record<string, unknown> = { accel: backend.accel };
const rows: Array<Record<string, string | number>> = [];
for (const w of WORKLOADS) {
  const stockWake = median(samples.filter((s) => s.workload === w.name && s.policy === 'stock' && s.round >= 2).map((s) => s.wakeMs));
  for (const policy of POLICIES) {
    const ss = samples.filter((s) => s.workload === w.name && s.policy === policy && s.round >= 2);
    const m = (f: (s: Sample) => number) => median(ss.map(f));
    summary[`${w.name}_${policy}_swap_mb_read`] = round(m((s) => s.swapMbRead), 1);
    summary[`${w.name}_${policy}_wake_ms`] = round(m((s) => s.wakeMs), 0);
    summary[`${w.name}_${policy}_idle_host_mib`] = round(m((s) => s.idleHostMiB), 1);
    summary[`${w.name}_${policy}_idle_rss_mib`] = round(m((s) => s.idleRssMiB), 1);
    rows.push({
      workload: w.name,
      policy,
      'wake / stock': round(m((s) => s.wakeMs) / stockWake, 2),
      'wake ms': round(m((s) => s.wakeMs), 0),
      'prefetch ms': round(m((s) => s.prefetchMs), 0),
      'swap MB read': round(m((s) => s.swapMbRead), 1),
      'zswap MB read': round(m((s) => s.zswapMbRead), 1),
      'major faults': m((s) => s.majorFaults),
      'idle host MiB (private + swap)': round(m((s) => s.idleHostMiB), 1),
      'idle RSS MiB': round(m((s) => s.idleRssMiB), 1),
      'busy host MiB (private + swap)': round(m((s) => s.busyHostMiB), 1),
      'reclaimed MiB': round(m((s) => s.reclaimedMiB), 1),
      'warm call ms': round(m((s) => s.warmMs), 0),
    });
  }
}
emit(`wakeup memory (${backend.accel}, ${SIZE.memoryMiB} MiB guests, median of rounds 2-${ROUNDS})`, markdownTable(rows), summary, samples);
