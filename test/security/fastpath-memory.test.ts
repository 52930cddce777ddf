import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { FastPath } from '../../host-broker/src/fastpath/index.ts';
import { Hutch, type Sandbox } from '../../host-broker/src/sdk/index.ts';
import { HutchError } from '../../guest-agent/src/protocol/errors.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/**
 * Issue 38 item 3: each fast-path run had its 512 MiB, and nothing bounded them together.
 * Eight sessions of one tenant each running `cat /dev/zero | tail -c 400000000` held about
 * 2-3 GiB of the host until their timeouts, and the broker's memory admission (which
 * counted only VMs) knew nothing of it. Now the kernel holds every run of a fast path to a
 * total (its pool cgroup), the broker admits at most so many runs at once and per principal
 * (a run that cannot get a slot in time fails `busy`), and each run counts its limit against
 * the memory budget VMs are admitted from.
 */
const MiB = 1024 * 1024;

describe('the fast path bounds all its runs together', () => {
  it('the pool cgroup OOM-kills past the total of all runs, each run within its own limit', async (ctx) => {
    const fp = await FastPath.create({ memoryBytes: 256 * MiB, maxConcurrentRuns: 2 });
    try {
      const d = fp.describe().limits;
      if (d.mechanism === 'rlimit') ctx.skip(`no cgroups here (${d.notes.join('; ')}): only the broker's admission bounds the total`);
      expect(d).toMatchObject({ totalMemoryBytes: 512 * MiB, totalProcesses: 2 * d.maxProcesses, totalEnforced: true });
      const ws = mkdtempSync(join(tmpdir(), 'hutch-fp-total-'));
      // Three runs of 200 MB each (under 256 MiB), held until all three have it: 600 MB in all.
      const runs = await Promise.all(
        [0, 1, 2].map(() => fp.run({ command: 'head -c 200000000 /dev/zero | tail -c 200000000 | { sleep 4; wc -c; }', workspace: ws, timeoutMs: 60_000 })),
      );
      const killed = runs.filter((r) => r.limits.oomKilled).length;
      expect(killed, JSON.stringify(runs.map((r) => r.limits))).toBeGreaterThan(0);
      // Alone, the same run fits its own limit.
      const alone = await fp.run({ command: 'head -c 200000000 /dev/zero | tail -c 200000000 | wc -c', workspace: ws, timeoutMs: 60_000 });
      expect(alone.limits.oomKilled).toBe(false);
    } finally {
      await fp.close();
    }
  }, 180_000);
});

describe('the broker admits fast-path runs', () => {
  const otherToken = 'another-principal-token-0123456789';
  let b: TestBroker;
  let mine: Hutch;
  let theirs: Hutch;

  beforeAll(async () => {
    b = await startBroker({ tokens: { other: otherToken }, idleMs: 60_000, admission: { maxConcurrentFastPath: 4, principalFastPath: 1, fastPathQueueMs: 1500, memoryBudgetMiB: 1100 } });
    mine = await b.connect();
    theirs = await Hutch.connect(b.url, { token: otherToken });
  });
  afterAll(async () => {
    theirs?.close();
    await b?.stop();
  });

  /** A fast-path command that holds its run for about `ms`. */
  const hold = (sb: Sandbox, ms: number) => sb.run('cat /dev/zero | tail -c 100', { timeoutMs: ms });

  it('a session runs one call at a time: eight at once never hold more than one run', async () => {
    const sb = await mine.create();
    let most = 0;
    const sampler = setInterval(() => (most = Math.max(most, b.broker.admission.fastPathRuns.inUse)), 5);
    try {
      const rs = await Promise.all(Array.from({ length: 8 }, () => sb.run('head -c 50000000 /dev/zero | tail -c 50000000 | wc -c')));
      expect(rs.map((r) => r.route)).toEqual(Array(8).fill('fastpath'));
    } finally {
      clearInterval(sampler);
    }
    expect(most).toBe(1);
  });

  it("past a principal's runs, its next waits, then fails busy, while another principal's runs", async () => {
    const a = await mine.create();
    const c = await mine.create();
    const other = await theirs.create();
    const long = hold(a, 6000);
    await new Promise((r) => setTimeout(r, 1000));
    const t0 = Date.now();
    const refused = await c.run('echo hi').then(
      () => null,
      (e: unknown) => e,
    );
    expect(refused).toBeInstanceOf(HutchError);
    expect((refused as HutchError).code).toBe('busy');
    expect((refused as HutchError).message).toMatch(/fast-path run/);
    expect(Date.now() - t0).toBeGreaterThanOrEqual(1000);
    const ok = await other.run('echo hi');
    expect(ok.route).toBe('fastpath');
    expect(ok.stdout).toBe('hi\n');
    expect((await long).route).toBe('fastpath');
    // The slot is back: the same principal runs again.
    expect((await c.run('echo again')).stdout).toBe('again\n');
  });

  it('fast-path runs and VMs share one memory budget', async () => {
    const vm = await mine.create();
    const woke = await vm.run('sleep 0.1'); // not read-only: the (local) VM, which reserves its 512 MiB
    expect(woke.route).toBe('vm');
    const other = await theirs.create();
    const running = hold(other, 6000); // 512 MiB more: 1024 of the 1,100
    await new Promise((r) => setTimeout(r, 1000));
    const metrics = await (await fetch(b.url.replace('ws:', 'http:') + '/metrics', { headers: { authorization: `Bearer ${b.token}` } })).text();
    expect(metrics).toMatch(/hutch_memory_reserved_mib\{holder="fastpath"\} 512/);
    // Another of mine: below its principal's runs, but not within the budget.
    const third = await mine.create();
    const refused = await third.run('echo hi').then(
      () => null,
      (e: unknown) => e,
    );
    expect((refused as HutchError).code).toBe('busy');
    expect((refused as HutchError).message).toMatch(/memory budget exhausted .* reserved by live VMs and fast-path runs/);
    expect((await running).route).toBe('fastpath');
    expect((await third.run('echo hi')).stdout).toBe('hi\n');
  });
});
