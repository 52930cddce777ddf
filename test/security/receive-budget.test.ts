import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { Hutch } from '../../host-broker/src/sdk/index.ts';
import type { ReceiveBudget } from '../../host-broker/src/api/receive-budget.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/**
 * ws buffers a message whole before the broker sees it (up to the 64 MiB frame limit), and a
 * request stays in memory until it is answered (a queued write holds its content). One token
 * with 32 connections, each with 64 requests in flight, could make the broker hold gigabytes.
 * Now a principal's messages hold at most its share: arriving ones wait on TCP while one of
 * its messages finishes, and a large request past the share is answered busy at once.
 */
const ALICE = 'alice-token-0123456789abcdef';
const BOB = 'bob-token-0123456789abcdefgh';
const MiB = 1024 * 1024;
const SHARE = 16 * MiB;

describe("a principal's messages within its share of the broker's memory", () => {
  let b: TestBroker;
  let receive: ReceiveBudget;
  beforeAll(async () => {
    b = await startBroker({ tokens: { alice: ALICE, bob: BOB }, limits: { principalReceiveBytes: SHARE, maxConnectionsPerPrincipal: 16 } });
    receive = (b.broker['server'] as { receive: ReceiveBudget }).receive;
  });
  afterAll(async () => b?.stop());

  it('twelve connections sending 6 MiB writes at once: the broker holds at most twice the share and one message more, and every call is answered (written or busy)', async () => {
    const clients = await Promise.all(Array.from({ length: 12 }, () => Hutch.connect(b.url, { token: ALICE })));
    const sessions = await Promise.all(clients.map((h) => h.create()));
    const content = 'w'.repeat(6 * MiB);
    const outcomes = await Promise.all(
      sessions.map((sb) =>
        sb.call('write', { filePath: 'big.txt', content }).then(
          () => 'written',
          (e: { code?: string; context?: { limit?: string } }) => (e.code === 'busy' && e.context?.limit === 'receive' ? 'busy' : `unexpected ${e.code}`),
        ),
      ),
    );
    expect(outcomes.filter((o) => o !== 'written' && o !== 'busy')).toEqual([]);
    expect(outcomes).toContain('written');
    // Requests held up to the share, messages arriving up to it, one finishing past it, and a
    // socket read's worth per connection: not the 72 MiB all twelve would have been.
    expect(receive.peak.get('alice') ?? 0).toBeGreaterThan(0);
    expect(receive.peak.get('alice') ?? 0).toBeLessThanOrEqual(2 * SHARE + 6 * MiB + 2 * MiB);
    // What was written is whole; what was refused can be sent again.
    for (const [i, sb] of sessions.entries()) {
      if (outcomes[i] === 'busy') await sb.call('write', { filePath: 'big.txt', content });
      expect(readFileSync(join(b.dataDir, 'sessions', sb.id, 'workspace', 'big.txt'), 'utf8').length).toBe(6 * MiB);
    }
    expect(receive.heldBytes('alice')).toBe(0);
    for (const h of clients) h.close();
  }, 120_000);

  it('requests queued behind a long call hold their bytes: past the share a large one is answered busy at once, small ones and other principals still pass', async () => {
    const alice = await Hutch.connect(b.url, { token: ALICE });
    const bob = await Hutch.connect(b.url, { token: BOB });
    const sb = await alice.create();
    const content = 'q'.repeat(5 * MiB);
    // The session runs its calls in order: these writes wait behind the sleep, each holding 5 MiB.
    const sleeping = sb.run('sleep 4; echo done');
    const queued = [sb.call('write', { filePath: 'q1.txt', content }), sb.call('write', { filePath: 'q2.txt', content }), sb.call('write', { filePath: 'q3.txt', content })];
    const t0 = Date.now();
    const refused = await sb.call('write', { filePath: 'q4.txt', content }).catch((e: unknown) => e);
    expect(refused).toMatchObject({ code: 'busy', context: { limit: 'receive', bytes: expect.any(Number) } });
    expect(String((refused as Error).message)).toMatch(/upload streams/);
    // Answered at once, not after the sleep.
    expect(Date.now() - t0).toBeLessThan(3000);
    expect(receive.heldBytes('alice')).toBeGreaterThanOrEqual(15 * MiB);
    // Small requests pass; another principal's large one too.
    expect((await alice.sessions()).some((s) => s.session === sb.id)).toBe(true);
    const theirs = await bob.create();
    await theirs.call('write', { filePath: 'b.txt', content });
    expect((await sleeping).stdout).toBe('done\n');
    await Promise.all(queued);
    expect(receive.heldBytes('alice')).toBe(0);
    await sb.call('write', { filePath: 'q4.txt', content });
    alice.close();
    bob.close();
  }, 60_000);

  it('a request larger than the whole share is taken when its principal holds no other large one, and refused beside another', async () => {
    const small = await startBroker({ limits: { principalReceiveBytes: 4 * MiB } });
    try {
      const h = await small.connect();
      const sb = await h.create();
      const content = 'z'.repeat(6 * MiB);
      await sb.call('write', { filePath: 'alone.txt', content });
      expect(readFileSync(join(small.dataDir, 'sessions', sb.id, 'workspace', 'alone.txt'), 'utf8').length).toBe(6 * MiB);
      const sleeping = sb.run('sleep 2');
      const queued = sb.call('write', { filePath: 'first.txt', content });
      await expect(sb.call('write', { filePath: 'second.txt', content })).rejects.toMatchObject({ code: 'busy', context: { limit: 'receive' } });
      await sleeping;
      await queued;
      h.close();
    } finally {
      await small.stop();
    }
  }, 60_000);
});
