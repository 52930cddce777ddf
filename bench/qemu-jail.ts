/**
 * What the QEMU jail costs: restores and snapshots of the same guest with QEMU jailed (its
 * own user id, `-sandbox`, a pid namespace, disks as inherited descriptors; the default)
 * and with QEMU left as root without sandbox or namespace (`jail: false`; the disks and
 * the snapshot socket are the same), alternating in one run. `npx tsx bench/qemu-jail.ts [--json] [--quick] [--runs N]`
 *
 *   jailed_restore_ms / plain_restore_ms    QEMU start to the agent's first reply, restored
 *                                           from the pristine snapshot (median)
 *   restore_jail_over_plain                 their ratio
 *   jailed_snapshot_ms / plain_snapshot_ms  a snapshot after a call dirtied guest RAM (the
 *                                           slot path: stop, migrate into the broker's
 *                                           socket, file written), median
 *   snapshot_jail_over_plain                their ratio
 *   state_mib                               the median state written per snapshot
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { hostTscKhz } from '../kernel-configs/boot-params.ts';
import { createLogger } from '../guest-agent/src/log.ts';
import { QemuBackend } from '../host-broker/src/backends/qemu-backend.ts';
import { cacheDir } from '../host-broker/src/backends/registry.ts';
import { connectAgent } from '../host-broker/src/vm/agent-channel.ts';
import { QemuDriver } from '../host-broker/src/vm/qemu-driver.ts';
import type { VmmDriver, VmSpec } from '../host-broker/src/vm/vmm.ts';
import { benchArgs, emit, markdownTable, median, round } from './lib/report.ts';

const args = benchArgs();
const runsIdx = args.argv.indexOf('--runs');
/** --quick: one round (a VM of each kind), to check the bench reaches its JSON line (test/benches.test.ts, VM tier). */
const runs = runsIdx > 0 ? Number(args.argv[runsIdx + 1]) : args.argv.includes('--quick') ? 1 : 7;
const log = createLogger({ name: 'bench-qemu-jail', level: 'warn' });
const SIZE = { memoryMiB: 512, cpus: 1, swapMiB: 512 };
const dataDir = mkdtempSync(join(tmpdir(), 'hutch-bench-jail-'));
const progress = (m: string) => process.stderr.write(`[qemu-jail] ${m}\n`);

const backend = await QemuBackend.create({ dataDir, cacheDir: cacheDir(), log });
await backend.prepare(SIZE);
const pristine = await backend.snapshots.pristine(backend.image, SIZE);
const tsc = backend.accel === 'tcg' ? (await hostTscKhz()).khz : undefined;
const plain = new QemuDriver({ accel: backend.accel, log, jail: false, ...(tsc ? { tscKhz: tsc } : {}) });
const drivers: Record<'jailed' | 'plain', VmmDriver> = { jailed: backend.driver, plain };
progress(`guest ready (${backend.image.describe}; accel ${backend.accel}); ${runs} rounds`);

let n = 0;
const spec = (): VmSpec => ({ id: `j${n}`, dir: join(dataDir, 'vms', `j${n++}`), image: backend.image, ...SIZE });
const samples = { jailed: { restore: [] as number[], snapshot: [] as number[], stateBytes: [] as number[] }, plain: { restore: [] as number[], snapshot: [] as number[], stateBytes: [] as number[] } };

for (let round_ = 0; round_ < runs; round_++) {
  // Alternate which goes first, so neither always runs on a warmer page cache.
  const order: Array<'jailed' | 'plain'> = round_ % 2 === 0 ? ['jailed', 'plain'] : ['plain', 'jailed'];
  for (const kind of order) {
    const t0 = performance.now();
    const vm = await drivers[kind].restore(spec(), pristine);
    const agent = await connectAgent(vm, { timeoutMs: 60_000, log });
    await agent.call('ping', {});
    samples[kind].restore.push(performance.now() - t0);
    const r = await agent.run({ command: 'python3 -c "x = bytearray(32 << 20); print(len(x))"' });
    if (r.exitCode !== 0) throw new Error(`${kind} VM call exited ${r.exitCode}: ${r.stderrText}`);
    agent.close();
    const snap = await vm.snapshot(join(dataDir, `state-${kind}-${round_}.bin`));
    samples[kind].snapshot.push(snap.ms);
    samples[kind].stateBytes.push(snap.stateBytes);
    await vm.destroy();
    rmSync(join(dataDir, `state-${kind}-${round_}.bin`), { force: true });
  }
  progress(`round ${round_ + 1}/${runs}: restore jailed ${samples.jailed.restore.at(-1)?.toFixed(0)} plain ${samples.plain.restore.at(-1)?.toFixed(0)} ms; snapshot jailed ${samples.jailed.snapshot.at(-1)?.toFixed(0)} plain ${samples.plain.snapshot.at(-1)?.toFixed(0)} ms`);
}
rmSync(dataDir, { recursive: true, force: true });

const m = (xs: number[]) => round(median(xs), 0);
const summary = {
  accel: backend.accel,
  runs,
  jailed_restore_ms: m(samples.jailed.restore),
  plain_restore_ms: m(samples.plain.restore),
  restore_jail_over_plain: round(median(samples.jailed.restore) / median(samples.plain.restore), 2),
  jailed_snapshot_ms: m(samples.jailed.snapshot),
  plain_snapshot_ms: m(samples.plain.snapshot),
  snapshot_jail_over_plain: round(median(samples.jailed.snapshot) / median(samples.plain.snapshot), 2),
  state_mib: round(median(samples.jailed.stateBytes) / 1048576, 1),
};
emit(
  `qemu-jail: jailed vs plain QEMU, restore and snapshot (${backend.accel}; ${runs} rounds)`,
  markdownTable([
    { measure: 'restore to first agent reply (ms, median)', jailed: summary.jailed_restore_ms, plain: summary.plain_restore_ms, ratio: summary.restore_jail_over_plain },
    { measure: `snapshot after a call (ms, median; ${summary.state_mib} MiB state)`, jailed: summary.jailed_snapshot_ms, plain: summary.plain_snapshot_ms, ratio: summary.snapshot_jail_over_plain },
  ]),
  summary,
  { restore_ms: { jailed: samples.jailed.restore.map((x) => round(x, 0)), plain: samples.plain.restore.map((x) => round(x, 0)) }, snapshot_ms: { jailed: samples.jailed.snapshot.map((x) => round(x, 0)), plain: samples.plain.snapshot.map((x) => round(x, 0)) } },
);
process.exit(0);
