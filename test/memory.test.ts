import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createLogger } from '../guest-agent/src/log.ts';
import type { ParamsOf } from '../guest-agent/src/protocol/methods.ts';
import type { AgentClient } from '../host-broker/src/agent-client.ts';
import { processMemory } from '../host-broker/src/vm/smaps.ts';
import type { Vm } from '../host-broker/src/vm/vmm.ts';
import { PYTHON_REPL, callWorkload, startWorkload } from '../bench/lib/memory-workloads.ts';
import { bootMemoryVm, type MemoryVm } from './helpers/memory-vm.ts';
import { systemRamSpan } from '../guest-agent/src/memory/damon.ts';
import { overlapOf, toRanges, type ProcessSet } from '../guest-agent/src/memory/activation-set.ts';

/**
 * The guest memory manager (mem.*) in a real VM: real kernel, zswap, cgroup v2, DAMON,
 * idle page tracking, the native process_madvise helper, QEMU's virtio-balloon.
 *
 * The VM is cold-booted, not restored from the pristine snapshot: its RAM is anonymous
 * memory. QEMU 7.2 discards reported free pages of a file-backed RAM block with
 * fallocate(PUNCH_HOLE) even when the mapping is private, so a restored VM returning
 * memory would punch holes into the pristine memory file other VMs map (see
 * guest-agent/src/memory/page-reporting.ts).
 */
const log = createLogger({ name: 'memory-test', level: 'warn' });
const SIZE = { memoryMiB: 512, cpus: 1, swapMiB: 512 };
const MiB = 1024 * 1024;

async function until<T>(what: string, f: () => Promise<T>, ok: (v: T) => boolean, timeoutMs: number, everyMs = 1000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  let v = await f();
  while (!ok(v)) {
    if (Date.now() > deadline) throw new Error(`${what}: not reached in ${timeoutMs} ms; last ${JSON.stringify(v)}`);
    await new Promise((r) => setTimeout(r, everyMs));
    v = await f();
  }
  return v;
}

describe('memory manager arithmetic', () => {
  it('monitors all System RAM: min start to max end + 1, across the PCI hole', () => {
    const iomem = [
      '00000000-00000fff : Reserved',
      '00001000-0009fbff : System RAM',
      '000f0000-000fffff : Reserved',
      '00100000-bfffffff : System RAM',
      '  01000000-01ffffff : Kernel code',
      'c0000000-febfffff : PCI Bus 0000:00',
      '100000000-23fffffff : System RAM',
    ].join('\n');
    expect(systemRamSpan(iomem)).toEqual({ start: 0x1000, end: 0x240000000 });
    expect(systemRamSpan('00000000-00000fff : Reserved\n')).toBeNull();
  });

  it('turns page sets into ranges and measures overlap per process', () => {
    const set = (pid: number, pages: number[]): [string, ProcessSet] => [`${pid}:1`, { pid, start: '1', comm: 'p', pages: Float64Array.from(pages) }];
    expect(toRanges(Float64Array.from([1, 2, 3, 7, 9, 10]))).toEqual([[0x1000, 0x4000], [0x7000, 0x8000], [0x9000, 0xb000]]);
    const a = new Map([set(10, [1, 2, 3, 4]), set(11, [5])]);
    const b = new Map([set(10, [2, 3, 4, 5]), set(12, [5])]);
    // Same page numbers in different processes are different pages.
    expect(overlapOf(a, b)).toEqual({ overlap: 3 / 7, coverage: 3 / 5 });
    expect(overlapOf(a, a)).toEqual({ overlap: 1, coverage: 1 });
  });
});

describe('guest memory manager (real QEMU)', { tags: ['vm'] }, () => {
  let m: MemoryVm | undefined;
  let vm: Vm;
  let agent: AgentClient;

  beforeAll(async () => {
    m = await bootMemoryVm('mem', log, SIZE);
    ({ vm, agent } = m);
    await startWorkload(agent, PYTHON_REPL);
  }, 900_000);

  afterAll(async () => m?.close());

  it('every memory control refuses bad values with a clear, typed error', async () => {
    const cases: Array<[string, Record<string, unknown>, RegExp]> = [
      ['mem.reclaim', {}, /target/],
      ['mem.reclaim', { target: 0 }, /target/],
      ['mem.reclaim', { target: -4096 }, /target/],
      ['mem.reclaim', { target: 'most' }, /target/],
      ['mem.reclaim', { target: 'all', hotSetLast: 'yes' }, /hotSetLast/],
      ['mem.reclaim', { target: 'all', surprise: 1 }, /surprise/],
      ['mem.zswap', { maxPoolPercent: 101 }, /maxPoolPercent/],
      ['mem.zswap', { maxPoolPercent: 2.5 }, /maxPoolPercent/],
      ['mem.zswap', { acceptThresholdPercent: -1 }, /acceptThresholdPercent/],
      ['mem.zswap', { zpool: 'zram' }, /zpool/],
      ['mem.zswap', { compressor: 'LZO; rm -rf /' }, /compressor/],
      ['mem.zswap', { compressor: 'nosuchzip' }, /nosuchzip.*not in this kernel/],
      ['mem.zswap', { cgroupMax: -1 }, /cgroupMax/],
      ['mem.zswap', { cgroupMax: 'unlimited' }, /cgroupMax/],
      ['mem.zswap', { cgroupWriteback: 1 }, /cgroupWriteback/],
      ['mem.mglru', {}, /enabled/],
      ['mem.mglru', { enabled: 'on' }, /enabled/],
      ['mem.damon', { profile: 'aggressive' }, /profile/],
      ['mem.damon', { profile: 'tuned', dirtyFlush: 'yes' }, /dirtyFlush/],
      ['mem.reporting', { order: 11 }, /order/],
      ['mem.reporting', { order: -1 }, /order/],
      ['mem.activation', { method: 'psi' }, /method/],
      ['mem.activation', { maxRanges: -1 }, /maxRanges/],
      ['mem.prefetch', { pages: 10 }, /pages/],
      ['mem.status', { verbose: true }, /verbose/],
    ];
    for (const [method, params, mentions] of cases) {
      const err = await agent.call(method as 'mem.reclaim', params as ParamsOf<'mem.reclaim'>).then(
        () => new Error(`${method} ${JSON.stringify(params)} was accepted`),
        (e: unknown) => e,
      );
      expect(err, `${method} ${JSON.stringify(params)}`).toMatchObject({ code: 'bad_request' });
      expect((err as Error).message, `${method} ${JSON.stringify(params)}`).toMatch(mentions);
    }
    // Nothing was changed by the refused calls.
    const z = await agent.call('mem.zswap', {});
    expect(z).toMatchObject({ enabled: true, zpool: 'zsmalloc', maxPoolPercent: 20, cgroupMax: 'max', cgroupWriteback: true });
  }, 120_000);

  it('controls apply and read back: zswap, per-cgroup zswap, MGLRU, reporting order', async () => {
    const z = await agent.call('mem.zswap', { maxPoolPercent: 35, acceptThresholdPercent: 80, shrinkerEnabled: true, cgroupMax: 64 * MiB, cgroupWriteback: false });
    expect(z).toMatchObject({ maxPoolPercent: 35, acceptThresholdPercent: 80, shrinkerEnabled: true, cgroupMax: 64 * MiB, cgroupWriteback: false });
    const back = await agent.call('mem.zswap', { maxPoolPercent: 20, acceptThresholdPercent: 90, shrinkerEnabled: false, cgroupMax: 'max', cgroupWriteback: true });
    expect(back).toMatchObject({ maxPoolPercent: 20, acceptThresholdPercent: 90, shrinkerEnabled: false, cgroupMax: 'max', cgroupWriteback: true });
    expect(await agent.call('mem.mglru', { enabled: false })).toMatchObject({ enabled: false });
    expect(await agent.call('mem.mglru', { enabled: true })).toMatchObject({ enabled: true, raw: '0x0007' });
    // The opt-in dirty-flush profile is independent of DAMON: on, then back to the kernel defaults.
    expect(await agent.call('mem.damon', { profile: 'off', dirtyFlush: true })).toMatchObject({ enabled: false, dirtyFlush: true });
    const dirty = await agent.run({ command: 'cat /proc/sys/vm/dirty_bytes /proc/sys/vm/dirty_background_bytes /proc/sys/vm/dirty_writeback_centisecs' });
    expect(dirty.stdoutText.split('\n').slice(0, 3)).toEqual(['33554432', '16777216', '10']);
    expect(await agent.call('mem.damon', { profile: 'off', dirtyFlush: false })).toMatchObject({ dirtyFlush: false });
    const order = (await agent.call('mem.status', {})).reporting.order;
    expect(await agent.call('mem.reporting', { order: 3 })).toMatchObject({ order: 3, available: true });
    expect(await agent.call('mem.reporting', { order })).toMatchObject({ order });
  }, 120_000);

  it('records the activation set of a long-lived Python process; a repeated call overlaps > 0.8', async () => {
    for (let i = 0; i < 3; i++) {
      const c = await callWorkload(agent, PYTHON_REPL);
      expect(c.reply['tests']).toBeGreaterThan(20);
    }
    const a = await agent.call('mem.activation', { maxRanges: 5 });
    expect(a.method).toBe('idle');
    const py = a.processes.find((p) => p.comm === 'python3');
    expect(py, JSON.stringify(a.processes.map((p) => p.comm))).toBeDefined();
    // The server walks ~20 MiB of state on every call.
    expect(py!.pages * 4096).toBeGreaterThan(16 * MiB);
    expect(py!.ranges.length).toBeGreaterThan(0);
    expect(BigInt(`0x${py!.ranges[0]![1]}`)).toBeGreaterThan(BigInt(`0x${py!.ranges[0]![0]}`));
    expect(a.overlap).toBeGreaterThan(0.8);
  }, 300_000);

  it('reclaim moves workload memory into zswap, and the host gets the freed memory back', async () => {
    await callWorkload(agent, PYTHON_REPL);
    // Free blocks of any size go back to the host (the default order only returns 4 MiB blocks).
    await agent.call('mem.reporting', { order: 0 });
    const settle = async () => (await processMemory(vm.pid)).rssKiB;
    const rssBefore = await settle();
    const r = await agent.call('mem.reclaim', { target: 'all' });
    expect(r.reclaimedBytes).toBeGreaterThan(20 * MiB);
    expect(r.after.zswapStoredBytes - r.before.zswapStoredBytes).toBeGreaterThan(20 * MiB);
    // Compressed: the pool holds much less than it stores.
    expect(r.after.zswapPoolBytes).toBeLessThan(r.after.zswapStoredBytes);
    const status = await agent.call('mem.status', {});
    expect(status.workload.zswapBytes).toBeGreaterThan(0);
    const rssAfter = await until('QEMU RSS drops after reclaim', settle, (kib) => kib < rssBefore - 16 * 1024, 90_000);
    expect(rssAfter).toBeLessThan(rssBefore);
  }, 300_000);

  it('prefetch of the recorded set cuts the major faults of the next call', async () => {
    const majorFaultsOfWake = async (prefetch: boolean) => {
      await callWorkload(agent, PYTHON_REPL);
      await agent.call('mem.reclaim', { target: 'all' });
      const before = (await agent.call('mem.status', {})).swap.pgmajfault;
      if (prefetch) {
        const p = await agent.call('mem.prefetch', {});
        expect(p.pages).toBeGreaterThan(1000);
        expect(p.processes).toBeGreaterThanOrEqual(1);
      }
      const mid = (await agent.call('mem.status', {})).swap.pgmajfault;
      await callWorkload(agent, PYTHON_REPL);
      const after = (await agent.call('mem.status', {})).swap.pgmajfault;
      return { call: after - mid, prefetch: mid - before };
    };
    const stock = await majorFaultsOfWake(false);
    const pre = await majorFaultsOfWake(true);
    expect(stock.call).toBeGreaterThan(500);
    expect(pre.call).toBeLessThan(stock.call / 2);
    const a = await agent.call('mem.activation', {});
    expect(a.prefetch?.hits).toBeGreaterThan(0);
    expect(a.prefetch?.hitRatio).toBeGreaterThan(0.5);
  }, 600_000);

  it('hot set last reclaims in two phases and leaves the pool with writeback off', async () => {
    await callWorkload(agent, PYTHON_REPL);
    const r = await agent.call('mem.reclaim', { target: 'all', hotSetLast: true });
    expect(r.passes).toBe(2);
    expect(r.hotSetBytes).toBeGreaterThan(16 * MiB);
    // Cold pages went to the disk (pool closed), the hot set to the pool.
    expect(r.after.pswpout).toBeGreaterThan(r.before.pswpout);
    expect(r.after.zswpout).toBeGreaterThan(r.before.zswpout);
    expect(await agent.call('mem.zswap', {})).toMatchObject({ cgroupMax: 'max', cgroupWriteback: false });
    // A stock reclaim afterwards opens writeback again.
    await agent.call('mem.reclaim', { target: 4 * MiB });
    expect(await agent.call('mem.zswap', {})).toMatchObject({ cgroupWriteback: true });
  }, 300_000);

  it('falls back to the swapped-to-present pagemap difference', async () => {
    await agent.call('mem.activation', { method: 'pagemap' });
    try {
      await callWorkload(agent, PYTHON_REPL);
      await agent.call('mem.reclaim', { target: 'all' });
      await callWorkload(agent, PYTHON_REPL);
      const a = await agent.call('mem.activation', {});
      expect(a.method).toBe('pagemap');
      // Everything the call needed came back from swap: the set is most of the state it walks.
      expect(a.pages * 4096).toBeGreaterThan(16 * MiB);
    } finally {
      await agent.call('mem.activation', { method: 'idle' });
    }
  }, 300_000);

  it('DAMON_RECLAIM with the tuned profile shrinks the page cache', async () => {
    const cached = async () => (await agent.call('mem.status', {})).mem.cacheBytes;
    // Fill the page cache with file pages nobody will touch again.
    await agent.run({ command: 'find /usr/lib /usr/share -type f -size -2M 2>/dev/null | head -4000 | xargs cat > /dev/null 2>&1; true', timeoutMs: 300_000 });
    const full = await cached();
    const st = await agent.call('mem.damon', { profile: 'tuned' });
    try {
      expect(st).toMatchObject({ enabled: true, profile: 'tuned' });
      expect(st.kdamondPid).toBeGreaterThan(0);
      // All System RAM, not just the biggest block.
      expect(st.monitorRegion?.start).toBeLessThan(1024 * 1024);
      expect(st.monitorRegion?.end).toBeGreaterThan(400 * MiB);
      const done = await until(
        'DAMON_RECLAIM reclaims',
        async () => (await agent.call('mem.status', {})).damon!,
        (d) => d.stats.bytesReclaimedRegions > 32 * MiB,
        180_000,
        2000,
      );
      expect(done.stats.nrReclaimedRegions).toBeGreaterThan(0);
      expect(await cached()).toBeLessThan(full - 16 * MiB);
    } finally {
      expect(await agent.call('mem.damon', { profile: 'off' })).toMatchObject({ enabled: false, kdamondPid: null });
    }
  }, 400_000);
});
