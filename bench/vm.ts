/**
 * Cold boot vs pristine-snapshot restore, host memory per restored idle VM, and what the
 * Python stdlib preload buys a test run. `npx tsx bench/vm.ts [--json] [--quick] [--tb MiB]`
 *
 *   cold_boot_ms             QEMU start to the agent's first reply, cold boot
 *   restore_ms               QEMU start to the agent's first reply, restored from the pristine snapshot
 *   restore_over_boot        restore_ms / cold_boot_ms
 *   private_mib_per_idle_vm  median Private (clean+dirty) of 10 restored idle VMs, smaps_rollup
 *   pss_mib_per_idle_vm      median PSS of the same
 *   private_mib_after_call   the same 10 VMs after each ran a call and idled again: private (USS),
 *   pss_mib_after_call       PSS, and the TCG translation buffer apart (host-broker/src/vm/smaps.ts
 *   tcg_tb_mib               says how it is found): tcg_tb_mib is its resident size, and
 *   private_mib_excl_tcg     private_mib_excl_tcg what the VM costs without it (as on KVM)
 *   tcg_tb_size_mib          the buffer size QEMU ran with (its command line)
 *   guest_ram_private_mib    of private_mib_excl_tcg: guest RAM copied on write since the restore,
 *   qemu_own_private_mib_excl_tcg   and the rest (QEMU's heap, TCG block metadata, stacks)
 *   *_idle_policy            the same 10 VMs once told `idle` (mem.policy, with dropCaches) as the
 *                            broker tells a VM it keeps, after free page reporting settled
 *   tb_<N>_run_ms            at tb-size N MiB (64, 32, 16; same run): wall time of the first
 *                            `python3 -m unittest` on datespan in a restored VM, median of rounds,
 *                            with tb_<N>_resident_mib the buffer resident after it and
 *                            tb_<N>_anon_excl_tcg_mib QEMU's other anonymous memory, and
 *                            tb_<N>_flushes how often the buffer was emptied (full) meanwhile
 *   unittest_cpu_ms_preloaded / _cold   guest user+sys CPU of `python3 -m unittest` on datespan,
 *                            in a restored VM (stdlib preloaded before the snapshot) vs a VM booted
 *                            with hutch.preload=0 (first run in each)
 */
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { createLogger } from '../guest-agent/src/log.ts';
import { Workspace } from '../guest-agent/src/workspace/confine.ts';
import { WorkspaceSync } from '../guest-agent/src/workspace/sync.ts';
import { QemuBackend } from '../host-broker/src/backends/qemu-backend.ts';
import { cacheDir } from '../host-broker/src/backends/registry.ts';
import type { AgentClient } from '../host-broker/src/agent-client.ts';
import { connectAgent } from '../host-broker/src/vm/agent-channel.ts';
import { WorkspaceMirror } from '../host-broker/src/sync/workspace-mirror.ts';
import { qemuMemory, type QemuMemory } from '../host-broker/src/vm/smaps.ts';
import type { Vm, VmSpec } from '../host-broker/src/vm/vmm.ts';
import { benchArgs, emit, markdownTable, median, round } from './lib/report.ts';
import { prepareWorkspace } from './lib/sessions.ts';

const args = benchArgs();
/**
 * --quick: the least that still runs every part once (one cold boot, one restore, two idle
 * VMs, the unittest comparison on the repo's own invoicer; no bytecode-less run, no tb-size
 * sweep), to check the bench reaches its JSON line (test/benches.test.ts, VM tier).
 */
const quick = args.argv.includes('--quick');
/** The project whose `python3 -m unittest` is timed: the benchmark corpus's datespan, or the repo's invoicer when quick. */
const UNITTEST_PROJECT = quick ? 'invoicer' : 'datespan';
const IDLE_VMS = quick ? 2 : 10;
const tbIdx = args.argv.indexOf('--tb');
const tbMiB = tbIdx > 0 ? Number(args.argv[tbIdx + 1]) : undefined;
const log = createLogger({ name: 'bench-vm', level: 'warn' });
const SIZE = { memoryMiB: 512, cpus: 1, swapMiB: 512 };
const dataDir = mkdtempSync(join(tmpdir(), 'hutch-bench-vm-'));
const progress = (m: string) => process.stderr.write(`[vm] ${m}\n`);

const t0 = performance.now();
const backend = await QemuBackend.create({ dataDir, cacheDir: cacheDir(), log, ...(tbMiB ? { tcgTbMiB: tbMiB } : {}) });
const tPrep = performance.now();
await backend.prepare(SIZE);
const pristineMs = performance.now() - tPrep;
const pristine = await backend.snapshots.pristine(backend.image, SIZE);
progress(`guest ready (${backend.image.describe}; accel ${backend.accel}) in ${((performance.now() - t0) / 1000).toFixed(1)} s`);

let n = 0;
const spec = (extra: Partial<VmSpec> = {}): VmSpec => ({ id: `b${n}`, dir: join(dataDir, 'vms', `b${n++}`), image: backend.image, ...SIZE, ...extra });

async function firstReply(start: () => Promise<Vm>, timeoutMs: number): Promise<{ ms: number; vm: Vm; agent: AgentClient }> {
  const s = performance.now();
  const vm = await start();
  const agent = await connectAgent(vm, { timeoutMs, log });
  await agent.call('ping', {});
  return { ms: performance.now() - s, vm, agent };
}

const coldRuns = quick ? 1 : 3;
const restoreRuns = quick ? 1 : 7;
const cold: number[] = [];
for (let i = 0; i < coldRuns; i++) {
  const r = await firstReply(() => backend.driver.boot(spec()), 300_000);
  cold.push(r.ms);
  r.agent.close();
  await r.vm.destroy();
  progress(`cold boot ${i + 1}/${coldRuns}: ${r.ms.toFixed(0)} ms`);
}
const restore: number[] = [];
for (let i = 0; i < restoreRuns; i++) {
  const r = await firstReply(() => backend.driver.restore(spec(), pristine), 60_000);
  restore.push(r.ms);
  r.agent.close();
  await r.vm.destroy();
}
progress(`restores: ${restore.map((x) => x.toFixed(0)).join(', ')} ms`);

// Ten idle VMs restored side by side: what each costs the host, idle as restored, then idle
// again after a call (side by side, so the snapshot's clean pages count as shared, as they
// are on a host with many tenants).
const IDLE_CALL = 'ls -la / >/dev/null && python3 -c "import json; print(json.dumps({\'ok\': sum(range(100000))}))"';
const idle: Array<{ vm: Vm; agent: AgentClient }> = [];
for (let i = 0; i < IDLE_VMS; i++) {
  const r = await firstReply(() => backend.driver.restore(spec(), pristine), 60_000);
  await r.agent.call('agent.resume', { unixTimeMs: Date.now(), entropy: new Uint8Array(64).map(() => Math.random() * 256) });
  idle.push({ vm: r.vm, agent: r.agent });
}
await new Promise((r) => setTimeout(r, 5000));
const mem = await Promise.all(idle.map((x) => x.vm.stats()));
for (const x of idle) {
  const r = await x.agent.run({ command: IDLE_CALL });
  if (r.exitCode !== 0) throw new Error(`idle VM call exited ${r.exitCode}: ${r.stderrText}`);
}
await new Promise((r) => setTimeout(r, 5000));
const afterCall: QemuMemory[] = await Promise.all(idle.map((x) => qemuMemory(x.vm.pid, pristine.memory)));
// The same VMs told they are idle, as the broker tells a VM it keeps (release decision
// reclaim): the guest's own policy reclaims the workload, drops the clean page cache and
// reports every free page, which QEMU drops from its copy-on-write copy of guest RAM.
const idleOutcomes = await Promise.all(idle.map((x) => x.agent.call('mem.policy', { state: 'idle', steps: { dropCaches: true } })));
const afterIdlePolicy = await settledMemory(idle.map((x) => x.vm.pid));
const tbSizeMiB = Number(/tb-size=(\d+)/.exec(readFileSync(`/proc/${idle[0]?.vm.pid}/cmdline`, 'utf8'))?.[1] ?? NaN);
for (const x of idle) {
  x.agent.close();
  await x.vm.destroy();
}
const privMiB = mem.map((m) => m.privateKiB / 1024);
const pssMiB = mem.map((m) => m.pssKiB / 1024);
const rssMiB = mem.map((m) => m.rssKiB / 1024);
const mib = (f: (m: QemuMemory) => number) => round(median(afterCall.map((m) => f(m) / 1024)), 1);
const after = {
  private_mib_after_call: mib((m) => m.total.privateKiB),
  pss_mib_after_call: mib((m) => m.total.pssKiB),
  tcg_tb_mib: mib((m) => m.tcg.rssKiB),
  anon_mib_excl_tcg: mib((m) => m.excludingTcg.anonKiB),
  // Of the private memory beside the buffer: the guest's writes since the restore (its RAM
  // copied on write), and QEMU's own (heap, TCG's block metadata, thread stacks, relocations).
  guest_ram_private_mib: mib((m) => m.guestRam.privateKiB),
  qemu_own_private_mib_excl_tcg: mib((m) => m.excludingTcg.privateKiB - m.guestRam.privateKiB),
  private_mib_excl_tcg: mib((m) => m.excludingTcg.privateKiB),
  pss_mib_excl_tcg: mib((m) => m.excludingTcg.pssKiB),
  swap_mib_after_call: mib((m) => m.total.swapKiB),
  tcg_tb_size_mib: tbSizeMiB,
};
const idleMib = (f: (m: QemuMemory) => number) => round(median(afterIdlePolicy.map((m) => f(m) / 1024)), 1);
const afterIdle = {
  private_mib_excl_tcg_idle_policy: idleMib((m) => m.excludingTcg.privateKiB),
  guest_ram_private_mib_idle_policy: idleMib((m) => m.guestRam.privateKiB),
  qemu_own_private_mib_excl_tcg_idle_policy: idleMib((m) => m.excludingTcg.privateKiB - m.guestRam.privateKiB),
  pss_mib_excl_tcg_idle_policy: idleMib((m) => m.excludingTcg.pssKiB),
  idle_policy_reclaimed_mib: round(median(idleOutcomes.map((o) => (o.reclaim?.reclaimedBytes ?? 0) / 2 ** 20)), 1),
};
progress(`${IDLE_VMS} idle VMs: private ${median(privMiB).toFixed(1)} MiB, PSS ${median(pssMiB).toFixed(1)} MiB, RSS ${median(rssMiB).toFixed(1)} MiB each`);
progress(`after a call: ${JSON.stringify(after)}`);
progress(`after a call and the guest's idle policy: ${JSON.stringify(afterIdle)}`);

/** QEMU memory of each pid once free page reporting settled (reports come in passes 2 s apart): 4 s without change. */
async function settledMemory(pids: number[]): Promise<QemuMemory[]> {
  await new Promise((r) => setTimeout(r, 6000));
  let last = await Promise.all(pids.map((pid) => qemuMemory(pid, pristine.memory)));
  for (let stable = 0, i = 0; stable < 4 && i < 40; i++) {
    await new Promise((r) => setTimeout(r, 1000));
    const now = await Promise.all(pids.map((pid) => qemuMemory(pid, pristine.memory)));
    const moved = now.some((m, j) => Math.abs(m.excludingTcg.privateKiB - (last[j] as QemuMemory).excludingTcg.privateKiB) > 512);
    stable = moved ? 0 : stable + 1;
    last = now;
  }
  return last;
}

/**
 * Guest CPU (user+sys, ms) of `python3 -m unittest` on datespan, first and second run, in
 * a VM restored from a snapshot. Both variants are restores, so both start with QEMU's
 * translation cache empty (TCG JIT state is host-side and not in the snapshot): the
 * difference is what the guest-side preload did (page cache, dentries), nothing else.
 */
async function unittestCpu(
  snapshot: typeof pristine,
  image = backend.image,
  envPrefix = '',
  be: QemuBackend = backend,
): Promise<{ first: number; second: number; firstWallMs: number; exitCode: number | null; tcgResidentMiB: number; anonExclTcgMiB: number; tbFlushes: number | null }> {
  const { vm, agent } = await firstReply(() => be.driver.restore(spec({ image }), snapshot), 60_000);
  try {
    await agent.call('agent.resume', { unixTimeMs: Date.now(), entropy: new Uint8Array(64).fill(7) });
    const ws = join(dataDir, `${UNITTEST_PROJECT}-${vm.spec.id}`);
    prepareWorkspace(UNITTEST_PROJECT, ws);
    const w = new Workspace(ws);
    await new WorkspaceMirror(w, new WorkspaceSync(w)).push(agent);
    const cpu: number[] = [];
    const wall: number[] = [];
    let exitCode: number | null = null;
    for (let i = 0; i < 2; i++) {
      const t = performance.now();
      const r = await agent.run({ command: `TIMEFORMAT="%3U %3S"; { time ${envPrefix}python3 -m unittest >/dev/null 2>&1; } 2>&1; exit 0` });
      wall.push(performance.now() - t);
      const [u, s] = r.stdoutText.trim().split(/\s+/).map(Number);
      cpu.push(((u ?? NaN) + (s ?? NaN)) * 1000);
      exitCode = r.exitCode;
    }
    const m = await qemuMemory(vm.pid);
    return { first: cpu[0] as number, second: cpu[1] as number, firstWallMs: wall[0] as number, exitCode, tcgResidentMiB: m.tcg.rssKiB / 1024, anonExclTcgMiB: m.excludingTcg.anonKiB / 1024, tbFlushes: await tbFlushCount(vm) };
  } finally {
    agent.close();
    await vm.destroy();
  }
}
/**
 * How many times QEMU emptied the translation buffer since it started (HMP `info jit`):
 * a flush when the buffer is full throws away every translated block, which the guest then
 * pays to translate again. Unlike run times, this does not vary with the host's load. The
 * restore itself flushes once. Read through the VM's QMP connection, which the driver keeps
 * to itself (a bench-only reach into it); null if that is not there.
 */
async function tbFlushCount(vm: Vm): Promise<number | null> {
  const qmp = (vm as unknown as { qmp?: { execute(cmd: string, args?: Record<string, unknown>): Promise<unknown> } }).qmp;
  if (!qmp) return null;
  const text = String(await qmp.execute('human-monitor-command', { 'command-line': 'info jit' }));
  const n = /TB flush count\s+(\d+)/.exec(text)?.[1];
  return n === undefined ? null : Number(n);
}

const preloaded = await unittestCpu(pristine);
const coldImage = { ...backend.image, cmdline: [...(backend.image.cmdline ?? []), 'hutch.preload=0'] };
const coldPristine = await backend.snapshots.pristine({ ...coldImage, key: backend.image.key }, SIZE);
const coldPy = await unittestCpu(coldPristine, coldImage);
// And with no bytecode at all (what a guest without the build-time compile would pay):
// Python compiles every stdlib module it imports from source, and cannot save the result.
const noPyc = quick ? undefined : await unittestCpu(coldPristine, coldImage, 'PYTHONDONTWRITEBYTECODE=1 PYTHONPYCACHEPREFIX=/nonexistent ');
progress(`unittest CPU (first/second run): preloaded ${preloaded.first.toFixed(0)}/${preloaded.second.toFixed(0)} ms, no preload ${coldPy.first.toFixed(0)}/${coldPy.second.toFixed(0)} ms${noPyc ? `, no bytecode ${noPyc.first.toFixed(0)}/${noPyc.second.toFixed(0)} ms` : ''}`);

// What a smaller translation buffer costs a guest workload: the same restored-VM unittest
// run at each tb-size, rounds interleaved so load drifts hit every size alike. Only under
// TCG (KVM has no buffer).
const TB_SIZES = [64, 32, 16] as const;
const tbRuns: Record<number, Array<{ wallMs: number; cpuMs: number; residentMiB: number; anonExclTcgMiB: number; flushes: number | null }>> = { 64: [], 32: [], 16: [] };
if (backend.accel === 'tcg' && !quick) {
  const backends = new Map<number, QemuBackend>();
  for (const tb of TB_SIZES) {
    backends.set(tb, await QemuBackend.create({ dataDir: join(dataDir, `tb${tb}`), cacheDir: cacheDir(), log, tcgTbMiB: tb }));
  }
  for (let round = 0; round < (quick ? 1 : 3); round++) {
    for (const tb of TB_SIZES) {
      const r = await unittestCpu(pristine, backend.image, '', backends.get(tb));
      tbRuns[tb]?.push({ wallMs: r.firstWallMs, cpuMs: r.first, residentMiB: r.tcgResidentMiB, anonExclTcgMiB: r.anonExclTcgMiB, flushes: r.tbFlushes });
    }
  }
  for (const be of backends.values()) await be.shutdown();
  progress(`tb-size: ${TB_SIZES.map((tb) => `${tb} MiB ${median(tbRuns[tb]?.map((x) => x.wallMs) ?? []).toFixed(0)} ms`).join(', ')}`);
}
const tbSummary = Object.fromEntries(
  TB_SIZES.flatMap((tb) => {
    const runs = tbRuns[tb] ?? [];
    if (runs.length === 0) return [];
    return [
      [`tb_${tb}_run_ms`, round(median(runs.map((x) => x.wallMs)), 0)],
      [`tb_${tb}_guest_cpu_ms`, round(median(runs.map((x) => x.cpuMs)), 0)],
      [`tb_${tb}_resident_mib`, round(median(runs.map((x) => x.residentMiB)), 1)],
      // QEMU's anonymous memory beside the buffer (guest RAM copied on write, TCG's metadata
      // of the translated blocks, heap): part of it grows with the number of blocks.
      [`tb_${tb}_anon_excl_tcg_mib`, round(median(runs.map((x) => x.anonExclTcgMiB)), 1)],
      // Buffer flushes from the restore to the end of the two unittest runs (1 = the restore's own).
      [`tb_${tb}_flushes`, runs.some((x) => x.flushes === null) ? null : median(runs.map((x) => x.flushes as number))],
    ];
  }),
);
await backend.shutdown();
rmSync(dataDir, { recursive: true, force: true });

const summary = {
  accel: backend.accel,
  restore_over_boot: round(median(restore) / median(cold), 3),
  cold_boot_ms: round(median(cold), 0),
  restore_ms: round(median(restore), 0),
  private_mib_per_idle_vm: round(median(privMiB), 1),
  pss_mib_per_idle_vm: round(median(pssMiB), 1),
  rss_mib_per_idle_vm: round(median(rssMiB), 1),
  ...after,
  ...afterIdle,
  ...tbSummary,
  unittest_cpu_ms_preloaded: round(preloaded.first, 0),
  unittest_cpu_ms_cold: round(coldPy.first, 0),
  unittest_cpu_ratio: round(preloaded.first / coldPy.first, 2),
  unittest_cpu_ms_preloaded_second_run: round(preloaded.second, 0),
  unittest_cpu_ms_cold_second_run: round(coldPy.second, 0),
  unittest_cpu_ms_no_bytecode: noPyc ? round(noPyc.first, 0) : null,
  pristine_build_ms: backend.image.built.kernelSeconds || backend.image.built.rootfsSeconds || pristineMs > 5000 ? round(pristineMs, 0) : 0,
  ...(backend.image.built.kernelSeconds ? { kernel_build_s: round(backend.image.built.kernelSeconds, 0) } : {}),
  ...(backend.image.built.rootfsSeconds ? { rootfs_build_s: round(backend.image.built.rootfsSeconds, 0) } : {}),
};
emit(
  `vm: cold boot vs pristine restore (${backend.accel}; ${backend.image.describe})`,
  markdownTable([
    { measure: 'restore / cold boot', value: summary.restore_over_boot, aim: '<= 0.05' },
    { measure: 'cold boot to first agent reply (ms, median)', value: summary.cold_boot_ms, aim: '' },
    { measure: 'restore to first agent reply (ms, median)', value: summary.restore_ms, aim: '' },
    { measure: `private MiB per idle VM (${IDLE_VMS} restored)`, value: summary.private_mib_per_idle_vm, aim: '<= 40' },
    { measure: `PSS MiB per idle VM (${IDLE_VMS} restored)`, value: summary.pss_mib_per_idle_vm, aim: '' },
    { measure: 'private MiB per idle VM after a call', value: summary.private_mib_after_call, aim: '' },
    { measure: 'PSS MiB per idle VM after a call', value: summary.pss_mib_after_call, aim: '' },
    { measure: `TCG translation buffer resident MiB after a call (tb-size ${summary.tcg_tb_size_mib})`, value: summary.tcg_tb_mib, aim: '' },
    { measure: 'private MiB per idle VM after a call, TCG buffer excluded', value: summary.private_mib_excl_tcg, aim: '<= 16' },
    { measure: "the same after the guest's idle policy (reclaim, drop caches, free pages reported)", value: summary.private_mib_excl_tcg_idle_policy, aim: '<= 16' },
    ...TB_SIZES.filter((tb) => `tb_${tb}_run_ms` in tbSummary).map((tb) => ({ measure: `unittest run ms at tb-size ${tb} (resident MiB ${tbSummary[`tb_${tb}_resident_mib`]}, buffer flushes ${tbSummary[`tb_${tb}_flushes`]})`, value: tbSummary[`tb_${tb}_run_ms`] ?? null, aim: '' })),
    { measure: 'unittest guest CPU ms, preloaded', value: summary.unittest_cpu_ms_preloaded, aim: '' },
    { measure: 'unittest guest CPU ms, no preload (image bytecode only)', value: summary.unittest_cpu_ms_cold, aim: 'preload <= half' },
    { measure: 'unittest guest CPU ms, no bytecode cache at all', value: summary.unittest_cpu_ms_no_bytecode, aim: '' },
  ]),
  summary,
  { cold_ms: cold.map((x) => round(x, 0)), restore_ms: restore.map((x) => round(x, 0)), private_mib: privMiB.map((x) => round(x, 1)), pss_mib: pssMiB.map((x) => round(x, 1)), unittest: { preloaded, cold: coldPy } },
);
process.exit(0);
