import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createLogger } from '../guest-agent/src/log.ts';
import type { MemoryPolicyOutcome } from '../guest-agent/src/protocol/methods-memory.ts';
import type { AgentClient } from '../host-broker/src/agent-client.ts';
import { memoryStepsFor, parseMemorySteps } from '../host-broker/src/policy/memory-policy.ts';
import { DEFAULT_POLICY, policyForLevel } from '../host-broker/src/policy/sandbox-policy.ts';
import { PYTHON_REPL, callWorkload, startWorkload } from '../bench/lib/memory-workloads.ts';
import { bootMemoryVm, type MemoryVm } from './helpers/memory-vm.ts';

/**
 * The guest's own memory policy (mem.policy, guest-agent/src/memory/policy.ts) in a real VM:
 * the broker only says active or idle; the agent applies DAMON, zswap sizing and MGLRU
 * once a call has started, records each exec's activation set, reclaims with the hot set
 * last on idle, and prefetches the set alongside the first call after it, never before.
 * Cold-booted, as memory.test.ts (helpers/memory-vm.ts says why).
 */
const log = createLogger({ name: 'memory-policy-test', level: 'warn' });
const MiB = 1024 * 1024;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

describe('memory policy steps on the broker', () => {
  it('the broker policy switches steps; the published levels keep their prefetch flag', () => {
    expect(memoryStepsFor(DEFAULT_POLICY)).toMatchObject({ damon: true, reclaim: true, hotSetLast: true, prefetch: true, dropCaches: false });
    expect(memoryStepsFor(policyForLevel('reclaim')).prefetch).toBe(false);
    expect(memoryStepsFor({ ...DEFAULT_POLICY, memoryPolicy: { damon: false, prefetch: false } })).toMatchObject({ damon: false, prefetch: false, zswap: true });
    expect(parseMemorySteps('damon=off, hotSetLast=on')).toEqual({ damon: false, hotSetLast: true });
    expect(() => parseMemorySteps('damon=maybe')).toThrow(/STEP=on\|off/);
    expect(() => parseMemorySteps('swapiness=off')).toThrow(/unknown step/);
  });
});

describe('guest memory policy (real QEMU)', { tags: ['vm'] }, () => {
  let m: MemoryVm | undefined;
  let agent: AgentClient;

  const outcome = async (): Promise<MemoryPolicyOutcome | undefined> => (await agent.call('telemetry.sample', { processes: false })).memoryPolicy;
  async function prefetchSettled(): Promise<NonNullable<MemoryPolicyOutcome['prefetch']>> {
    for (let i = 0; i < 1200; i++) {
      const p = (await outcome())?.prefetch;
      if (!p) throw new Error('no prefetch in the outcome');
      if (p.state === 'done' || p.state === 'failed') return p;
      await sleep(100);
    }
    throw new Error('prefetch did not finish in 120 s');
  }

  beforeAll(async () => {
    m = await bootMemoryVm('mempolicy', log);
    agent = m.agent;
    const first = await agent.call('mem.policy', { state: 'active' });
    expect(first.state).toBe('active');
    await startWorkload(agent, PYTHON_REPL);
  }, 900_000);

  afterAll(async () => m?.close());

  it('a call under an active policy applies DAMON (or says loudly why not), sizes zswap and records the call', async () => {
    await callWorkload(agent, PYTHON_REPL);
    const o = await outcome();
    expect(o?.state).toBe('active');
    expect(o?.zswap?.maxPoolPercent).toBe(20);
    expect(o?.damon).not.toBeNull();
    if (o?.damon?.running) {
      const st = await agent.call('mem.status', {});
      expect(st.damon?.enabled).toBe(true);
      expect(st.damon?.profile).toBe('tuned');
    } else {
      expect(o?.damon?.unavailable).toBeTruthy();
      expect(o?.warnings.some((w) => w.startsWith('damon'))).toBe(true);
    }
    // The activation set is recorded at the end of the call, off the call's path.
    for (let i = 0; i < 100 && ((await outcome())?.activation.calls ?? 0) === 0; i++) await sleep(200);
    expect((await outcome())?.activation.calls).toBeGreaterThan(0);
  }, 600_000);

  it('idle reclaims with the hot set last; the next call is right and its prefetch starts after the call did', async () => {
    const first = await callWorkload(agent, PYTHON_REPL);
    const before = (await agent.call('mem.status', {})).swap;
    const idle = await agent.call('mem.policy', { state: 'idle' });
    expect(idle.state).toBe('idle');
    expect(idle.warnings).toEqual([]);
    expect(idle.activation.pages).toBeGreaterThan(0);
    expect(idle.reclaim?.reclaimedBytes).toBeGreaterThan(MiB);
    expect(idle.reclaim?.hotSetBytes).toBeGreaterThan(0);
    // DAMON does not watch an idle guest.
    expect(idle.damon?.running ?? false).toBe(false);
    const after = (await agent.call('mem.status', {})).swap;
    expect(after.zswpout + after.pswpout).toBeGreaterThan(before.zswpout + before.pswpout);
    expect((await agent.call('mem.status', {})).reporting.order).toBe(0);

    const active = await agent.call('mem.policy', { state: 'active' });
    expect(active.prefetch?.state).toBe('armed');
    // Nothing is read back before the call: the wake's critical path stays the call's.
    const quiet = (await agent.call('mem.status', {})).swap;
    await sleep(1500);
    expect((await outcome())?.prefetch?.state).toBe('armed');
    expect((await agent.call('mem.status', {})).swap.zswpin - quiet.zswpin).toBeLessThan(64);

    const next = await callWorkload(agent, PYTHON_REPL);
    // The same answer as before the idle (the projects' suites, the server's state walked).
    expect(next.reply['tests']).toBeGreaterThan(0);
    expect({ ...next.reply, ms: 0 }).toEqual({ ...first.reply, ms: 0 });
    const p = await prefetchSettled();
    expect(p.error).toBeNull();
    expect(p.state).toBe('done');
    expect(p.pages).toBeGreaterThan(0);
    expect(p.callStartedAtMs).toBeGreaterThanOrEqual(active.atMs);
    expect(p.startedAtMs).toBeGreaterThanOrEqual(p.callStartedAtMs as number);
    expect((await agent.call('mem.status', {})).reporting.order).toBe(10);
  }, 600_000);

  it('a step switched off is off: no DAMON, no recording, no reclaim, no prefetch, no reporting', async () => {
    const off = { damon: false, activationSet: false, reclaim: false, prefetch: false, reporting: false } as const;
    const a = await agent.call('mem.policy', { state: 'active', steps: off });
    expect(a.steps).toMatchObject(off);
    // mem.activation waits for the recording of the call before (it ends after the call).
    const calls = (await agent.call('mem.activation', {})).calls;
    await callWorkload(agent, PYTHON_REPL);
    await sleep(2000);
    const o = await outcome();
    expect(o?.activation).toMatchObject({ track: false, calls });
    const st = await agent.call('mem.status', {});
    expect(st.damon?.enabled ?? false).toBe(false);
    const before = st.swap;
    const idle = await agent.call('mem.policy', { state: 'idle' });
    expect(idle.reclaim).toBeNull();
    const after = await agent.call('mem.status', {});
    expect(after.swap.zswpout + after.swap.pswpout - (before.zswpout + before.pswpout)).toBeLessThan(256);
    expect(after.reporting.order).toBe(10);
    const back = await agent.call('mem.policy', { state: 'active' });
    expect(back.prefetch).toBeNull();
    // Back to the defaults for what follows.
    const on = await agent.call('mem.policy', { state: 'active', steps: { damon: true, activationSet: true, reclaim: true, prefetch: true, reporting: true } });
    expect(on.steps).toMatchObject({ damon: true, activationSet: true, reclaim: true, prefetch: true, reporting: true });
  }, 600_000);

  it('a tenant command cannot write the memory controls nor reach the agent', async () => {
    await agent.call('mem.policy', { state: 'active', steps: { damon: true, reclaim: true, prefetch: true } });
    const who = await agent.run({ command: 'id -u' });
    expect(Number(who.stdoutText.trim())).toBeGreaterThan(0);
    const knobs = [
      '/sys/kernel/mm/damon/admin/kdamonds/nr_kdamonds',
      '/sys/module/zswap/parameters/max_pool_percent',
      '/sys/module/zswap/parameters/enabled',
      '/sys/module/page_reporting/parameters/page_reporting_order',
      '/sys/kernel/mm/lru_gen/enabled',
      '/sys/kernel/mm/page_idle/bitmap',
      '/proc/sys/vm/drop_caches',
      '/sys/fs/cgroup/workload/memory.reclaim',
      '/sys/fs/cgroup/workload/memory.zswap.max',
      '/sys/fs/cgroup/workload/memory.zswap.writeback',
      '/sys/fs/cgroup/workload/memory.max',
    ];
    const zswapBefore = (await agent.call('mem.status', {})).zswap;
    // Each write is tried and reported; `wrote` would mean the tenant changed the policy.
    const script = knobs.map((k) => `if [ -e ${k} ]; then if (echo 0 > ${k}) 2>/dev/null; then echo "wrote ${k}"; else echo "refused ${k}"; fi; else echo "absent ${k}"; fi`).join('\n');
    const r = await agent.run({ command: script });
    expect(r.stdoutText).not.toMatch(/^wrote /m);
    expect(r.stdoutText).toMatch(/^refused \/sys\/module\/zswap\/parameters\/max_pool_percent$/m);
    expect(r.stdoutText).toMatch(/^refused \/sys\/fs\/cgroup\/workload\/memory.reclaim$/m);
    // The agent's channel (a virtio-serial port) is the only way to its policy: root's alone.
    const ch = await agent.run({ command: 'for p in /dev/vport*; do [ -e "$p" ] || continue; if (exec 3<>"$p") 2>/dev/null; then echo "opened $p"; else echo "refused $p"; fi; done; ls /dev/vport* | wc -l' });
    expect(ch.stdoutText).not.toMatch(/^opened /m);
    expect(ch.stdoutText).toMatch(/^refused /m);
    // And nothing moved.
    const st = await agent.call('mem.status', {});
    expect(st.zswap?.maxPoolPercent).toBe(zswapBefore?.maxPoolPercent);
    expect(st.zswap?.enabled).toBe(true);
    expect((await outcome())?.steps).toMatchObject({ damon: true, reclaim: true, prefetch: true });
  }, 300_000);
});
