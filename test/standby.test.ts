import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { readdirSync } from 'node:fs';
import { join } from 'node:path';
import type { QemuBackend } from '../host-broker/src/backends/qemu-backend.ts';
import { Hutch, type Sandbox } from '../host-broker/src/sdk/index.ts';
import { qemuPids } from '../host-broker/src/vm/qemu-driver.ts';
import { startBroker, type TestBroker } from './helpers/broker.ts';
import { waitFor } from './helpers/wait-for.ts';

/**
 * Standby VMs (vm/standby-pool.ts): restored from the pristine snapshot and warmed before
 * any session wants them. A wake that takes one must be indistinguishable to the tenant
 * from a fresh restore (its own files only, nothing of the warm-up, fresh entropy, the
 * host's clock, /work sized by its own quota), and a standby is never handed out twice.
 */
describe('standby VMs', { tags: ['vm'] }, () => {
  let b: TestBroker;
  let hutch: Hutch;
  let backend: QemuBackend;
  const QUOTA = { bytes: 96 * 1024 * 1024, files: 5000 };
  beforeAll(async () => {
    b = await startBroker({ backend: 'qemu', standby: 1, idleMs: 3_600_000, quota: QUOTA });
    backend = b.backend as QemuBackend;
    hutch = await b.connect();
  }, 1_800_000);
  afterAll(async () => {
    await b?.stop();
    // The pool's VMs go with the broker, ready or being filled.
    expect(qemuPids(b.dataDir)).toEqual([]);
  });

  const standbyReady = () => waitFor(async () => backend.standby.stats().ready === 1, 300_000);
  const released = (sb: Sandbox) => waitFor(async () => !(await hutch.sessions()).find((x) => x.session === sb.id)?.live, 120_000);
  /** What a tenant can see of the guest beyond its workspace, and a sample of its entropy. */
  const PROBE = 'ls -A /work; echo ---; ls -A ~; echo ---; ls -A /tmp; echo ---; head -c 16 /dev/urandom | od -An -tx1 | tr -d " \\n"; echo; date +%s%3N; df -k /work | tail -1';
  const parse = (out: string) => {
    const [work, home, tmp, rest] = out.split('---\n');
    const [rand, now, df] = (rest ?? '').trim().split('\n');
    return { work: work?.trim().split('\n').filter(Boolean), home: home?.trim(), tmp: tmp?.trim(), rand, now: Number(now), sizeKiB: Number(df?.trim().split(/\s+/)[1]) };
  };

  it('a wake takes the warmed standby; the tenant sees what a fresh restore shows: its files only, fresh entropy, the clock, its quota', async () => {
    // The first wake of the broker finds no standby (pools fill after wakes, never beside them).
    const a = await hutch.create({ workspace: { files: { 'a.txt': 'A\n' } } });
    const ra = await a.run(PROBE, { route: 'vm' });
    expect(ra.woke).toBe(true);
    expect(ra.timing.wakePhases?.['standby']).toBeUndefined();
    expect(ra.timing.wakePhases?.['restore']).toBeGreaterThan(0);
    await standbyReady();

    const bb = await hutch.create({ workspace: { files: { 'b.txt': 'B\n', 'dir/c.txt': 'C\n' } } });
    const rb = await bb.run(PROBE, { route: 'vm' });
    expect(rb.exitCode).toBe(0);
    expect(rb.woke).toBe(true);
    expect(rb.timing.wakePhases?.['standby']).toBeGreaterThanOrEqual(0);
    expect(rb.timing.wakePhases?.['restore']).toBeUndefined();
    // The wake's last phase: the call handed to the guest, after the push and its marker.
    const ph = rb.timing.wakePhases ?? {};
    expect(ph['exec']).toBeGreaterThanOrEqual(ph['mark'] as number);
    expect(ph['exec']).toBeLessThanOrEqual(rb.timing.totalMs);
    const pa = parse(ra.stdout);
    const pb = parse(rb.stdout);
    // Its own workspace, nothing of the warm-up project or of session a.
    expect(pb.work).toEqual(['b.txt', 'dir']);
    // HOME and /tmp as a pristine restore has them.
    expect(pb.home).toBe(pa.home);
    expect(pb.tmp).toBe(pa.tmp);
    // Reseeded at the take, not only when the standby was restored.
    expect(pb.rand).toMatch(/^[0-9a-f]{32}$/);
    expect(pb.rand).not.toBe(pa.rand);
    expect(Math.abs(pb.now - Date.now())).toBeLessThan(5_000);
    // /work sized from this session's quota (96 MiB), as after a restore.
    expect(pb.sizeKiB).toBe(pa.sizeKiB);
    expect(pb.sizeKiB).toBe(QUOTA.bytes / 1024);
    // Both VMs live at once: two QEMU processes, no sharing.
    expect((await bb.run('cat /work/a.txt', { route: 'vm' })).exitCode).not.toBe(0);

    const metrics = await (await fetch(`${b.url.replace('ws:', 'http:')}/metrics`, { headers: { authorization: `Bearer ${b.token}` } })).text();
    expect(metrics).toMatch(/hutch_wakes_total\{how="standby"\} 1/);
    expect(metrics).toMatch(/hutch_wake_phase_seconds_count\{phase="exec"\} 2/);
    // The standby just taken is being replaced, or already is: one either way.
    expect(metrics).toMatch(/hutch_standby_vms\{state="(ready|filling)"\} 1/);
    await a.close();
    await bb.close();
  }, 900_000);

  it('a standby serves one session only: what a tenant leaves in /tmp is gone for the next one, whose VM is a new standby', async () => {
    await standbyReady();
    const a = await hutch.create({ workspace: { files: { 'x.txt': 'x\n' } } });
    const ra = await a.run('echo secret-of-a > /tmp/left; cat /proc/sys/kernel/random/uuid', { route: 'vm' });
    expect(ra.timing.wakePhases?.['standby']).toBeDefined();
    await a.hint('idle');
    await released(a);
    await standbyReady();
    const c = await hutch.create({ workspace: { files: { 'y.txt': 'y\n' } } });
    const rc = await c.run('cat /tmp/left 2>&1; ls -A /work', { route: 'vm' });
    expect(rc.timing.wakePhases?.['standby']).toBeDefined();
    expect(rc.stdout).not.toContain('secret-of-a');
    expect(rc.stdout).toContain('No such file');
    expect(rc.stdout).toContain('y.txt');
    await a.close();
    await c.close();
  }, 900_000);

  it('a standby whose VM died is never used: the wake restores a VM of its own (starting over if it had taken it) and the call succeeds', async () => {
    await standbyReady();
    const vms = join(b.dataDir, 'vms');
    // The ready standby's QEMU (a VM of an earlier session may still be going away).
    const standbyPids = () => readdirSync(vms).filter((d) => /^standby-\d+$/.test(d)).flatMap((d) => qemuPids(join(vms, d)));
    await waitFor(async () => standbyPids().length === 1, 60_000, 'exactly one standby QEMU');
    const pids = standbyPids();
    // The call comes at once: the broker may not have seen the exit yet when it takes the
    // standby, and then the wake must start over from the pristine snapshot, not fail.
    const s = await hutch.create({ workspace: { files: { 'z.txt': 'z\n' } } });
    process.kill(pids[0] as number, 'SIGKILL');
    const r = await s.run('cat z.txt', { route: 'vm' });
    expect(r.exitCode).toBe(0);
    expect(r.stdout).toBe('z\n');
    expect(r.timing.wakePhases?.['standby']).toBeUndefined();
    expect(r.timing.wakePhases?.['restore']).toBeGreaterThan(0);
    await s.close();
  }, 900_000);
});

/**
 * A standby is memory like a live VM: it counts against the broker's memory budget, and
 * gives its room up to a wake that needs it rather than make the wake wait or push the
 * host past the budget.
 */
describe('standby VMs inside the memory budget', { tags: ['vm'] }, () => {
  let b: TestBroker;
  let hutch: Hutch;
  let backend: QemuBackend;
  // Room for two 512 MiB VMs, not three.
  const BUDGET_MIB = 1300;
  beforeAll(async () => {
    b = await startBroker({ backend: 'qemu', standby: 1, idleMs: 3_600_000, admission: { memoryBudgetMiB: BUDGET_MIB } });
    backend = b.backend as QemuBackend;
    hutch = await b.connect();
  }, 1_800_000);
  afterAll(async () => {
    await b?.stop();
    expect(qemuPids(b.dataDir)).toEqual([]);
  });

  it('a wake that needs the standby\'s room stops it and restores its own VM; no standby fills past the budget', async () => {
    const a = await hutch.create({ workspace: { files: { 'a.txt': 'A\n' } } });
    expect((await a.run('cat a.txt', { route: 'vm' })).stdout).toBe('A\n');
    // One live VM and one standby fit.
    await waitFor(async () => backend.standby.stats().ready === 1, 300_000, 'a standby beside the live VM');
    expect(b.broker.admission.memoryReservedMiB).toBe(1024);
    const metrics = await (await fetch(`${b.url.replace('ws:', 'http:')}/metrics`, { headers: { authorization: `Bearer ${b.token}` } })).text();
    expect(metrics).toMatch(/^hutch_memory_reserved_mib\{holder="vm"\} 512$/m);
    expect(metrics).toMatch(/^hutch_memory_reserved_mib\{holder="standby"\} 512$/m);
    expect(metrics).toMatch(/^hutch_memory_budget_mib 1300$/m);

    const c = await hutch.create({ workspace: { files: { 'c.txt': 'C\n' } } });
    const rc = await c.run('cat c.txt', { route: 'vm' });
    expect(rc.stdout).toBe('C\n');
    // A third VM would not fit: the standby gave its room up instead of serving this wake
    // on top of the budget, and none is being prepared in its place.
    expect(rc.timing.wakePhases?.['standby']).toBeUndefined();
    expect(rc.timing.wakePhases?.['restore']).toBeGreaterThan(0);
    expect(backend.standby.stats()).toMatchObject({ ready: 0, filling: 0 });
    expect(b.broker.admission.memoryReservedMiB).toBe(1024);
    const vms = join(b.dataDir, 'vms');
    const standbyPids = () => readdirSync(vms).filter((d) => /^standby-\d+$/.test(d)).flatMap((d) => qemuPids(join(vms, d)));
    await waitFor(async () => standbyPids().length === 0, 60_000, 'the stopped standby\'s QEMU gone');
    await a.close();
    await c.close();
    expect(b.broker.admission.memoryReservedMiB).toBe(0);
  }, 900_000);
});
