/**
 * The sandbox lifecycle through a real broker and SDK client, qemu backend.
 * `npx tsx bench/lifecycle.ts [--json] [--quick]`
 *
 *   wake_p50_ms / wake_p99_ms   call arrival to the call starting in a VM with the workspace
 *                               pushed (the broker's wakeMs), as `hutch serve` runs by default:
 *                               one standby VM (restored and warmed ahead) taken by the wake,
 *                               the next call arriving after the refill (an agent's think time)
 *   wake_over_restore           wake p50 over restore_ms p50 (aim <= 1.5)
 *   wake_phases_ms              p50 ms from the wake's start to the end of each phase
 *   standby_refill_p50_ms       from a wake's end to the next standby being ready
 *   restore_wake_p50_ms         the same wakes without a standby (--standby 0): restore,
 *                               channel, resume, push into a guest running that code cold
 *   restore_wake_over_restore   that wake p50 over restore_ms p50
 *   restore_wake_phases_ms      its phases
 *   first_call_p50_ms           the whole first call after a wake (`true`), as the broker timed it:
 *                               the wake, the command's first fork in the restored guest, the pull
 *   first_call_after_pending_p50_ms  the same when the harness sent tool_call_pending pending_lead_ms
 *                               before the call (the wake starts then; the call waits for the rest)
 *   release_kill_ms             releasing a clean VM (state check + kill)
 *   release_snapshot_ms         releasing a dirty VM (state check + snapshot into a slot + kill)
 *   slot_restore_ms             the wake after that: restore from the slot, incremental push
 *   push_mb_s                   workspace push throughput into a live guest (64 MiB of files)
 *   idle_host_mib_per_session   broker memory per session that has no VM
 * Baseline in the same run: restore_ms, the bare restore-to-first-reply of bench/vm.ts.
 */
import { mkdtempSync, rmSync, writeFileSync, mkdirSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { createLogger } from '../guest-agent/src/log.ts';
import { Workspace } from '../guest-agent/src/workspace/confine.ts';
import { WorkspaceSync } from '../guest-agent/src/workspace/sync.ts';
import { Broker } from '../host-broker/src/broker.ts';
import { QemuBackend } from '../host-broker/src/backends/qemu-backend.ts';
import { cacheDir } from '../host-broker/src/backends/registry.ts';
import { createFastPath } from '../host-broker/src/tools/fastpath-factory.ts';
import { Hutch, type Sandbox } from '../host-broker/src/sdk/index.ts';
import { connectAgent } from '../host-broker/src/vm/agent-channel.ts';
import { qemuPids } from '../host-broker/src/vm/qemu-driver.ts';
import { qemuMemory } from '../host-broker/src/vm/smaps.ts';
import { WorkspaceMirror } from '../host-broker/src/sync/workspace-mirror.ts';
import { benchArgs, emit, markdownTable, median, percentile, round, writeResults } from './lib/report.ts';
import { prepareWorkspace } from './lib/sessions.ts';

const args = benchArgs();
/**
 * --quick: the least that still runs every part once (a wake of each kind, one pending
 * call, one slot, a small push, a few idle sessions), to check the bench reaches its JSON
 * line (test/benches.test.ts, VM tier); its numbers are not a measurement.
 */
const quick = args.argv.includes('--quick');
const WAKES = quick ? 1 : 20;
/** Sessions without a VM made at the end for the broker's memory per session. */
const IDLE_SESSIONS = quick ? 10 : 200;
const log = createLogger({ name: 'bench-lifecycle', level: 'warn' });
const progress = (m: string) => process.stderr.write(`[lifecycle] ${m}\n`);
const dataDir = mkdtempSync(join(tmpdir(), 'hutch-bench-lifecycle-'));
const token = randomBytes(12).toString('hex');

const backend = await QemuBackend.create({ dataDir, cacheDir: cacheDir(), log });
await backend.prepare({ memoryMiB: 512, cpus: 1 });
// The project is copied under dataDir and given to the broker as a directory source.
// Its principal holds the idle sessions at the end besides the bench's own, past the default session limit.
const broker = new Broker({ port: 0, token, dataDir, backend, fastPath: await createFastPath(log), log, idleMs: 3_600_000, workspaceRoots: [dataDir], maxSessionsPerPrincipal: IDLE_SESSIONS + 8 });
const port = await broker.start();
const hutch = await Hutch.connect(`ws://127.0.0.1:${port}`, { token });
// The same broker with one standby VM (what `hutch serve` runs by default), in its own data dir.
const standbyDir = join(dataDir, 'standby');
mkdirSync(standbyDir);
const sbBackend = await QemuBackend.create({ dataDir: standbyDir, cacheDir: cacheDir(), log, standby: 1 });
const sbBroker = new Broker({ port: 0, token, dataDir: standbyDir, backend: sbBackend, fastPath: await createFastPath(log), log, idleMs: 3_600_000, workspaceRoots: [dataDir] });
const sbHutch = await Hutch.connect(`ws://127.0.0.1:${await sbBroker.start()}`, { token });

async function released(sb: Sandbox, h: Hutch = hutch): Promise<void> {
  await sb.hint('idle');
  for (;;) {
    const s = (await h.sessions()).find((x) => x.session === sb.id);
    if (!s?.live) return;
    await new Promise((r) => setTimeout(r, 50));
  }
}
/** Median of each phase's end time over the wakes that reported it, in wake order. */
function phaseMedians(samples: Array<Record<string, number>>): Record<string, number> {
  const out: Record<string, number> = {};
  for (const k of ['standby', 'restore', 'channel', 'push', 'resume', 'mark', 'exec']) {
    const v = samples.map((x) => x[k]).filter((x): x is number => x !== undefined);
    if (v.length) out[k] = round(median(v), 0);
  }
  return out;
}
const lastRelease = (sb: Sandbox) => broker.sessions.get(sb.id).vm.lastRelease;

// Baseline: bare restore to first agent reply, same host, same moment.
const pristine = await backend.snapshots.pristine(backend.image, { memoryMiB: 512, cpus: 1, swapMiB: 512 });
const bareRestore: number[] = [];
for (let i = 0; i < (quick ? 1 : 5); i++) {
  const t0 = performance.now();
  const vm = await backend.driver.restore({ id: `base${i}`, dir: join(dataDir, 'vms', `base${i}`), image: backend.image, memoryMiB: 512, cpus: 1, swapMiB: 512 }, pristine);
  const a = await connectAgent(vm, { timeoutMs: 60_000, log });
  await a.call('ping', {});
  bareRestore.push(performance.now() - t0);
  a.close();
  await vm.destroy();
}

progress(`bare restores (ms): ${bareRestore.map((x) => x.toFixed(0)).join(' ')}`);
// Wakes with a real project pushed each time: restored from the pristine snapshot (no
// standby), and taken from a standby; released (killed) after each call.
const project = join(dataDir, 'project');
prepareWorkspace('invoicer', project);
const sb = await hutch.create({ workspace: { dir: project } });
const wakes: number[] = [];
/** Per wake: ms from its start to the end of each phase (restore, channel, push, resume, mark). */
const phaseSamples: Array<Record<string, number>> = [];
const kills: number[] = [];
const firstCalls: number[] = [];
for (let i = 0; i < WAKES; i++) {
  const r = await sb.run('true', { route: 'vm' });
  if (!r.woke) throw new Error('expected a wake');
  wakes.push(r.timing.wakeMs);
  firstCalls.push(r.timing.totalMs);
  phaseSamples.push(r.timing.wakePhases ?? {});
  progress(`restore wake ${i + 1}/${WAKES}: ${r.timing.wakeMs.toFixed(0)} ms (${Object.entries(r.timing.wakePhases ?? {}).map(([k, v]) => `${k} ${v}`).join(', ')}); whole call ${r.timing.totalMs.toFixed(0)} ms`);
  await released(sb);
  const rel = lastRelease(sb);
  if (rel?.decision !== 'kill') throw new Error(`expected a kill release, got ${rel?.decision}`);
  kills.push(rel.ms);
}
progress(`restore wakes (ms): ${wakes.map((w) => w.toFixed(0)).join(' ')}`);

// Standby wakes: the call comes once the pool has its VM again, as after an agent's think time.
const sbSession = await sbHutch.create({ workspace: { dir: project } });
const standbyWakes: number[] = [];
const standbyPhases: Array<Record<string, number>> = [];
const standbyFirstCalls: number[] = [];
const refills: number[] = [];
let standbyMisses = 0;
for (let i = 0; i < WAKES + 1; i++) {
  const r = await sbSession.run('true', { route: 'vm' });
  if (!r.woke) throw new Error('expected a wake');
  const tEnd = performance.now();
  // The broker's first wake has no standby yet: it fills the pool and is not counted.
  if (i > 0) {
    if (r.timing.wakePhases?.['standby'] === undefined) standbyMisses++;
    standbyWakes.push(r.timing.wakeMs);
    standbyFirstCalls.push(r.timing.totalMs);
    standbyPhases.push(r.timing.wakePhases ?? {});
    progress(`standby wake ${i}/${WAKES}: ${r.timing.wakeMs.toFixed(0)} ms (${Object.entries(r.timing.wakePhases ?? {}).map(([k, v]) => `${k} ${v}`).join(', ')}); whole call ${r.timing.totalMs.toFixed(0)} ms`);
  }
  await released(sbSession, sbHutch);
  while (sbBackend.standby.stats().ready < 1) {
    if (performance.now() - tEnd > 120_000) throw new Error('no standby VM within 120 s of a wake');
    await new Promise((r) => setTimeout(r, 20));
  }
  refills.push(performance.now() - tEnd);
}
// What the ready standby costs the host while it waits (alone: its snapshot pages count as its own).
const standbyPid = qemuPids(join(standbyDir, 'vms', 'standby-'))[0];
const standbyMem = standbyPid ? await qemuMemory(standbyPid, pristine.memory) : undefined;
await sbSession.close();
progress(`standby wakes (ms): ${standbyWakes.map((w) => w.toFixed(0)).join(' ')}; refills (ms): ${refills.map((w) => w.toFixed(0)).join(' ')}; misses ${standbyMisses}`);

// The same wake started by the harness's tool_call_pending, PENDING_LEAD_MS before the call
// (the model still writing the call): what the call then waits for is what is left of the wake.
const PENDING_LEAD_MS = 500;
const pendingCalls: number[] = [];
for (let i = 0; i < (quick ? 1 : 10); i++) {
  await sb.hint('tool_call_pending');
  await new Promise((r) => setTimeout(r, PENDING_LEAD_MS));
  const r = await sb.run('true', { route: 'vm' });
  pendingCalls.push(r.timing.totalMs);
  await released(sb);
}
progress(`calls ${PENDING_LEAD_MS} ms after tool_call_pending (ms): ${pendingCalls.map((w) => w.toFixed(0)).join(' ')}`);

// Dirty release into a slot, and the wake from it.
const snaps: number[] = [];
const slotWakes: number[] = [];
const slotBytes: number[] = [];
for (let i = 0; i < (quick ? 1 : 5); i++) {
  await sb.run(`echo ${i} >> ~/.dirty`, { route: 'vm' });
  await released(sb);
  const rel = lastRelease(sb);
  if (rel?.decision !== 'snapshot') throw new Error(`expected a snapshot release, got ${rel?.decision}: ${rel?.reason}`);
  snaps.push(rel.ms);
  slotBytes.push(rel.bytesWritten);
  const r = await sb.run('cat ~/.dirty | wc -l', { route: 'vm' });
  if (r.stdout.trim() !== String(i + 1)) throw new Error(`slot restore lost state: ${r.stdout}`);
  slotWakes.push(r.timing.wakeMs);
}
await sb.close();
progress(`snapshot releases ${snaps.map((x) => x.toFixed(0)).join(' ')} ms; slot wakes ${slotWakes.map((x) => x.toFixed(0)).join(' ')} ms`);

// Push throughput into a live guest: 64 MiB in files of 1 MiB and 64 KiB (4 MiB quick).
const big = join(dataDir, 'big');
mkdirSync(big);
for (let i = 0; i < (quick ? 3 : 48); i++) writeFileSync(join(big, `m${i}.bin`), randomBytes(1024 * 1024));
for (let i = 0; i < (quick ? 16 : 256); i++) writeFileSync(join(big, `k${i}.bin`), randomBytes(64 * 1024));
const vm = await backend.driver.restore({ id: 'push', dir: join(dataDir, 'vms', 'push'), image: backend.image, memoryMiB: 512, cpus: 1, swapMiB: 512 }, pristine);
const agent = await connectAgent(vm, { timeoutMs: 60_000, log });
const w = new Workspace(big);
const ps = await new WorkspaceMirror(w, new WorkspaceSync(w)).push(agent);
const pushMbS = ps.bytes / 1e6 / (ps.ms / 1000);
agent.close();
await vm.destroy();
progress(`push: ${(ps.bytes / 1e6).toFixed(1)} MB in ${ps.ms.toFixed(0)} ms`);

// Broker memory per session without a VM.
const idleN = IDLE_SESSIONS;
if (global.gc) global.gc();
const before = process.memoryUsage().rss;
const idle: Sandbox[] = [];
for (let i = 0; i < idleN; i++) idle.push(await hutch.create({ workspace: { files: { 'a.py': 'print(1)\n', 'README.md': '# x\n' } } }));
await new Promise((r) => setTimeout(r, 1000));
const perSessionMiB = (process.memoryUsage().rss - before) / idleN / 1024 / 1024;
for (const s of idle) await s.close();

hutch.close();
sbHutch.close();
await broker.stop();
await sbBroker.stop();
rmSync(dataDir, { recursive: true, force: true });

const summary = {
  accel: backend.accel,
  wake_p50_ms: round(median(standbyWakes), 0),
  wake_p99_ms: round(percentile(standbyWakes, 99), 0),
  wake_over_restore: round(median(standbyWakes) / median(bareRestore), 2),
  restore_ms: round(median(bareRestore), 0),
  standby_refill_p50_ms: round(median(refills), 0),
  standby_misses: standbyMisses,
  standby_private_mib_excl_tcg: standbyMem ? round(standbyMem.excludingTcg.privateKiB / 1024, 1) : null,
  standby_guest_ram_written_mib: standbyMem ? round(standbyMem.guestRam.privateKiB / 1024, 1) : null,
  standby_tcg_tb_mib: standbyMem ? round(standbyMem.tcg.rssKiB / 1024, 1) : null,
  restore_wake_p50_ms: round(median(wakes), 0),
  restore_wake_over_restore: round(median(wakes) / median(bareRestore), 2),
  restore_wake_phases_ms: phaseMedians(phaseSamples),
  restore_first_call_p50_ms: round(median(firstCalls), 0),
  release_kill_ms: round(median(kills), 0),
  release_snapshot_ms: round(median(snaps), 0),
  slot_restore_ms: round(median(slotWakes), 0),
  slot_mib_written: round(median(slotBytes) / 1024 / 1024, 1),
  push_mb_s: round(pushMbS, 1),
  idle_host_mib_per_session: round(perSessionMiB, 3),
  wakes: standbyWakes.length,
  wake_phases_ms: phaseMedians(standbyPhases),
  first_call_p50_ms: round(median(standbyFirstCalls), 0),
  pending_lead_ms: PENDING_LEAD_MS,
  first_call_after_pending_p50_ms: round(median(pendingCalls), 0),
};
const title = `lifecycle: wake, release, slot restore through the broker (${backend.accel}; project invoicer)`;
const table = markdownTable([
    { measure: 'wake p50 / bare restore (standby taken)', value: summary.wake_over_restore, aim: '<= 1.5' },
    { measure: 'wake p50 ms (standby: resume + push)', value: summary.wake_p50_ms, aim: '' },
    { measure: 'wake p99 ms', value: summary.wake_p99_ms, aim: '' },
    { measure: 'bare restore ms (baseline)', value: summary.restore_ms, aim: '' },
    { measure: 'wake phases, p50 ms to the end of each', value: Object.entries(summary.wake_phases_ms).map(([k, v]) => `${k} ${v}`).join(', '), aim: '' },
    { measure: 'whole first call after a wake, p50 ms', value: summary.first_call_p50_ms, aim: '' },
    { measure: 'standby refill after a wake, p50 ms (misses)', value: `${summary.standby_refill_p50_ms} (${summary.standby_misses})`, aim: '' },
    { measure: 'the ready standby VM: private MiB excluding the TCG buffer (guest RAM written) / TCG buffer MiB', value: `${summary.standby_private_mib_excl_tcg} (${summary.standby_guest_ram_written_mib}) / ${summary.standby_tcg_tb_mib}`, aim: '' },
    { measure: 'wake without a standby, p50 ms / over bare restore', value: `${summary.restore_wake_p50_ms} / ${summary.restore_wake_over_restore}`, aim: '' },
    { measure: 'its phases, p50 ms to the end of each', value: Object.entries(summary.restore_wake_phases_ms).map(([k, v]) => `${k} ${v}`).join(', '), aim: '' },
    { measure: 'whole first call after such a wake, p50 ms', value: summary.restore_first_call_p50_ms, aim: '' },
    { measure: `the same, tool_call_pending sent ${PENDING_LEAD_MS} ms before the call, p50 ms`, value: summary.first_call_after_pending_p50_ms, aim: '' },
    { measure: 'release, kill (clean) ms', value: summary.release_kill_ms, aim: '' },
    { measure: 'release, snapshot slot (dirty) ms', value: summary.release_snapshot_ms, aim: '' },
    { measure: 'slot MiB written per dirty release', value: summary.slot_mib_written, aim: '' },
    { measure: 'wake from slot ms', value: summary.slot_restore_ms, aim: '' },
    { measure: 'push MB/s', value: summary.push_mb_s, aim: '' },
    { measure: 'broker MiB per idle session (no VM)', value: summary.idle_host_mib_per_session, aim: '' },
]);
const raw = { standby_wakes_ms: standbyWakes.map((x) => round(x, 0)), standby_first_calls_ms: standbyFirstCalls.map((x) => round(x, 0)), standby_wake_phases_ms: standbyPhases, standby_refills_ms: refills.map((x) => round(x, 0)), wakes_ms: wakes.map((x) => round(x, 0)), first_calls_ms: firstCalls.map((x) => round(x, 0)), pending_calls_ms: pendingCalls.map((x) => round(x, 0)), wake_phases_ms: phaseSamples, kills_ms: kills.map((x) => round(x, 0)), snaps_ms: snaps.map((x) => round(x, 0)), slot_wakes_ms: slotWakes.map((x) => round(x, 0)), bare_restore_ms: bareRestore.map((x) => round(x, 0)) };
emit(title, table, summary, raw);
// A full run is the record (bench/results, as the other benches); --quick is for trying things.
if (!quick) writeResults('lifecycle', title, table, summary, raw);
process.exit(0);
