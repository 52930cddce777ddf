/**
 * DAMON_RECLAIM profiles on real workloads (the shape of the published DAMON table):
 * each workload runs in a fresh VM with the `previous` or the `tuned` profile, while the
 * host samples the guest's memory every 500 ms.
 *
 * `npx tsx bench/damon.ts [--json] [--quick]`
 *
 * --quick: the search workload alone, over a small part of the stdlib, once per profile (two
 * VMs), to check the bench reaches its JSON line (test/benches.test.ts, VM tier); it needs
 * none of the benchmark corpus's projects.
 *
 *   <workload>_<profile>_occupied_mib  time-weighted MemTotal - MemFree during the run
 *   <workload>_<profile>_cache_mib     time-weighted Cached during the run
 *   <workload>_<profile>_runtime_s     wall time of the workload
 *
 * Workloads (what a coding agent does in its sandbox):
 *   pytest    the unittest suites of three bench projects, each run four times in fresh
 *             interpreters, and salesreport's data pipeline
 *   search    code search: grep and wc over the Python stdlib and /usr/share, twice
 *   git       a repository built from the bench projects, 40 commits, log -p, gc
 *
 * Fresh cold-booted VMs (not restores from the pristine snapshot): DAMON reclaim frees
 * pages the snapshot file backs, and QEMU 7.2's free page reporting would punch them out
 * of the shared file (see guest-agent/src/memory/page-reporting.ts).
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
import { PROJECTS_DIR } from './lib/sessions.ts';
import { pushDir } from './lib/memory-workloads.ts';
import { benchArgs, emit, markdownTable, round } from './lib/report.ts';

const args = benchArgs();
const quick = args.argv.includes('--quick');
const PROFILES = ['previous', 'tuned'] as const;
const SIZE = { memoryMiB: 512, cpus: 1, swapMiB: 512 };
const log = createLogger({ name: 'bench-damon', level: 'warn' });
const progress = (m: string) => process.stderr.write(`[damon] ${m}\n`);
const reps = quick ? 1 : 4;

interface Workload {
  name: string;
  projects: string[];
  command: string;
}

const ALL_WORKLOADS: Workload[] = [
  {
    name: 'pytest',
    projects: ['datespan', 'logtally', 'salesreport'],
    command: `for i in $(seq ${reps}); do for p in datespan logtally salesreport; do (cd /work/$p && python3 -B -m unittest -q 2>/dev/null); done; done; cd /work/salesreport && python3 -B scripts/bench.py`,
  },
  {
    name: 'search',
    projects: [],
    command: `for i in $(seq ${reps}); do grep -rIn --include='*.py' 'def __init__' /usr/lib/python3.11 | wc -l; grep -rIl 'license' /usr/share 2>/dev/null | wc -l; find /usr/lib /usr/share -type f -name '*.py' -print0 | xargs -0 wc -l | tail -1; done`,
  },
  {
    name: 'git',
    projects: ['datespan', 'logtally', 'salesreport', 'textkit', 'opsbox'],
    command: [
      'set -e; mkdir -p /work/repo && cd /work/repo && git init -q . && git config user.email b@example.com && git config user.name bench',
      'for p in datespan logtally salesreport textkit opsbox; do cp -r /work/$p .; done; git add -A && git commit -qm init',
      `for i in $(seq ${reps * 10}); do for f in $(git ls-files | grep -E '\\.(py|js|md)$' | head -40); do echo "# change $i" >> $f; done; git commit -qam "change $i"; done`,
      'git log -p | wc -c; git gc -q; git count-objects -vH | tail -2',
    ].join('; '),
  },
];

const QUICK_SEARCH: Workload = {
  name: 'search',
  projects: [],
  command: "grep -rIn --include='*.py' 'def __init__' /usr/lib/python3.11/json /usr/lib/python3.11/email | wc -l; find /usr/lib/python3.11/json -type f -name '*.py' -print0 | xargs -0 wc -l | tail -1",
};
const WORKLOADS: Workload[] = quick ? [QUICK_SEARCH] : ALL_WORKLOADS;

interface Run {
  workload: string;
  profile: string;
  runtimeS: number;
  occupiedMiB: number;
  cacheMiB: number;
  peakOccupiedMiB: number;
  samples: number;
  damonReclaimedMiB: number;
  exitCode: number | null;
}

/** Time-weighted mean of (t, v) samples (trapezoids). */
function timeWeighted(samples: Array<[number, number]>): number {
  if (samples.length < 2) return samples[0]?.[1] ?? NaN;
  let area = 0;
  for (let i = 1; i < samples.length; i++) {
    const [t0, v0] = samples[i - 1] as [number, number];
    const [t1, v1] = samples[i] as [number, number];
    area += ((v0 + v1) / 2) * (t1 - t0);
  }
  return area / ((samples[samples.length - 1] as [number, number])[0] - (samples[0] as [number, number])[0]);
}

async function runOne(backend: QemuBackend, dataDir: string, w: Workload, profile: (typeof PROFILES)[number]): Promise<Run> {
  const id = `damon-${w.name}-${profile}`;
  const vm = await backend.driver.boot({ id, dir: join(dataDir, 'vms', id), image: backend.image, ...SIZE });
  let agent: AgentClient | undefined;
  try {
    agent = await connectAgent(vm, { timeoutMs: 300_000, log });
    for (const p of w.projects) await pushDir(agent, join(PROJECTS_DIR, p), p);
    await agent.call('mem.damon', { profile });
    const occupied: Array<[number, number]> = [];
    const cache: Array<[number, number]> = [];
    const sample = async () => {
      const s = await agent!.call('mem.status', {});
      const t = performance.now() / 1000;
      occupied.push([t, (s.mem.totalBytes - s.mem.freeBytes) / 2 ** 20]);
      cache.push([t, s.mem.cacheBytes / 2 ** 20]);
    };
    let running = true;
    const sampler = (async () => {
      while (running) {
        await sample();
        await new Promise((r) => setTimeout(r, 500));
      }
    })();
    const t0 = performance.now();
    const r = await agent.run({ command: w.command, timeoutMs: 1_800_000 });
    const runtimeS = (performance.now() - t0) / 1000;
    running = false;
    await sampler;
    await sample();
    if (r.exitCode !== 0) progress(`${id}: exit ${r.exitCode}: ${r.stderrText.slice(-400)}`);
    // Stats first: stopping the sysfs kdamond drops them.
    const damon = (await agent.call('mem.status', {})).damon;
    await agent.call('mem.damon', { profile: 'off' });
    return {
      workload: w.name,
      profile,
      runtimeS,
      occupiedMiB: timeWeighted(occupied),
      cacheMiB: timeWeighted(cache),
      peakOccupiedMiB: Math.max(...occupied.map(([, v]) => v)),
      samples: occupied.length,
      damonReclaimedMiB: (damon?.stats.bytesReclaimedRegions ?? 0) / 2 ** 20,
      exitCode: r.exitCode,
    };
  } finally {
    agent?.close();
    await vm.destroy();
  }
}

const dataDir = mkdtempSync(join(tmpdir(), 'hutch-bench-damon-'));
const backend = await QemuBackend.create({ dataDir, cacheDir: cacheDir(), log });
const runs: Run[] = [];
try {
  for (const w of WORKLOADS) {
    for (const profile of PROFILES) {
      const r = await runOne(backend, dataDir, w, profile);
      runs.push(r);
      progress(`${w.name} ${profile}: ${r.runtimeS.toFixed(1)} s, occupied ${r.occupiedMiB.toFixed(0)} MiB, cache ${r.cacheMiB.toFixed(0)} MiB, DAMON reclaimed ${r.damonReclaimedMiB.toFixed(0)} MiB`);
    }
  }
} finally {
  await backend.shutdown();
  rmSync(dataDir, { recursive: true, force: true });
}

const summary: Record<string, unknown> = {};
const rows: Array<Record<string, string | number>> = [];
for (const w of WORKLOADS) {
  const prev = runs.find((r) => r.workload === w.name && r.profile === 'previous') as Run;
  for (const r of runs.filter((x) => x.workload === w.name)) {
    summary[`${w.name}_${r.profile}_occupied_mib`] = round(r.occupiedMiB, 1);
    summary[`${w.name}_${r.profile}_cache_mib`] = round(r.cacheMiB, 1);
    summary[`${w.name}_${r.profile}_runtime_s`] = round(r.runtimeS, 1);
    rows.push({
      workload: w.name,
      profile: r.profile,
      'occupied / previous': round(r.occupiedMiB / prev.occupiedMiB, 2),
      'runtime / previous': round(r.runtimeS / prev.runtimeS, 2),
      'occupied MiB': round(r.occupiedMiB, 1),
      'cache MiB': round(r.cacheMiB, 1),
      'peak occupied MiB': round(r.peakOccupiedMiB, 1),
      'runtime s': round(r.runtimeS, 1),
      'DAMON reclaimed MiB': round(r.damonReclaimedMiB, 1),
      exit: r.exitCode ?? 'signal',
    });
  }
}
emit(`DAMON_RECLAIM profiles (${backend.accel}, ${SIZE.memoryMiB} MiB guests)`, markdownTable(rows), summary, runs);
