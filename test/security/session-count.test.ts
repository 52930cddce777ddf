import { afterAll, describe, expect, it } from 'vitest';
import { existsSync, readFileSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { Hutch } from '../../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/**
 * Each session may fill its quota (2 GiB by default) of the data dir's disk, and a workspace
 * kept at close stays until the operator removes it. With no count per principal, a token
 * holder filled the host's disk by creating sessions (or creating and closing them with
 * keepWorkspace) in a loop. Now a principal holds at most N sessions, kept workspaces
 * included, across broker restarts; other principals are not affected.
 */
const ALICE = 'alice-token-0123456789abcdef';
const BOB = 'bob-token-0123456789abcdefgh';

describe('sessions per principal', () => {
  let b: TestBroker | undefined;
  afterAll(async () => b?.stop());

  it('at the limit a create is quota_exceeded (limit sessions); other principals still create; a close makes room, a kept workspace does not, even after a restart', async () => {
    b = await startBroker({ tokens: { alice: ALICE, bob: BOB }, maxSessionsPerPrincipal: 3 });
    let alice = await Hutch.connect(b.url, { token: ALICE });
    const bob = await Hutch.connect(b.url, { token: BOB });
    const mine = [await alice.create({}), await alice.create({}), await alice.create({})];
    const err = await alice.create({}).catch((e: unknown) => e);
    expect(err).toMatchObject({ code: 'quota_exceeded', context: { limit: 'sessions', quota: 3, sessions: 3, kept: 0 } });
    const theirs = await bob.create({});
    await mine[0]?.close();
    const again = await alice.create({ workspace: { files: { 'keep.txt': 'kept\n' } } });
    // Closed with its workspace kept: the slot stays taken.
    await again.close({ keepWorkspace: true });
    const kept = join(b.dataDir, 'sessions', again.id);
    expect(readFileSync(join(kept, 'workspace', 'keep.txt'), 'utf8')).toBe('kept\n');
    expect(JSON.parse(readFileSync(join(kept, 'kept.json'), 'utf8'))).toMatchObject({ owner: 'alice' });
    await expect(alice.create({})).rejects.toMatchObject({ code: 'quota_exceeded', context: { limit: 'sessions', sessions: 2, kept: 1 } });
    // A new broker on the same data dir counts the same.
    alice.close();
    bob.close();
    await b.stop({ keepData: true });
    b = await startBroker({ dataDir: b.dataDir, tokens: { alice: ALICE, bob: BOB }, maxSessionsPerPrincipal: 3 });
    alice = await Hutch.connect(b.url, { token: ALICE });
    await expect(alice.create({})).rejects.toMatchObject({ code: 'quota_exceeded', context: { limit: 'sessions', sessions: 2, kept: 1 } });
    // The operator removes the kept workspace: room again (after the next start).
    rmSync(kept, { recursive: true });
    alice.close();
    await b.stop({ keepData: true });
    b = await startBroker({ dataDir: b.dataDir, tokens: { alice: ALICE, bob: BOB }, maxSessionsPerPrincipal: 3 });
    alice = await Hutch.connect(b.url, { token: ALICE });
    expect((await alice.create({})).id).toMatch(/^s-/);
    expect(existsSync(join(b.dataDir, 'sessions', theirs.id))).toBe(true);
    alice.close();
  }, 120_000);

  it('over the E2B API the limit is a 429, as E2B answers its concurrent-sandbox limit', async () => {
    const c = await startBroker({ maxSessionsPerPrincipal: 1 });
    try {
      const create = () => fetch(`${c.url.replace('ws:', 'http:')}/e2b/api/v2/sandboxes`, { method: 'POST', headers: { 'X-API-KEY': c.token, 'content-type': 'application/json' }, body: '{}' });
      expect((await create()).status).toBe(201);
      const second = await create();
      expect(second.status).toBe(429);
      expect(await second.text()).toMatch(/quota_exceeded: principal default holds 1 sessions and 0 kept workspaces, its limit of 1/);
    } finally {
      await c.stop();
    }
  }, 120_000);

  it('creates racing each other cannot pass the limit together', async () => {
    const c = await startBroker({ maxSessionsPerPrincipal: 3 });
    try {
      const h = await c.connect();
      const results = await Promise.allSettled(Array.from({ length: 12 }, () => h.create({ workspace: { files: { 'a.txt': 'x\n' } } })));
      expect(results.filter((r) => r.status === 'fulfilled').length).toBe(3);
      expect(results.filter((r) => r.status === 'rejected').every((r) => (r.reason as { code?: string }).code === 'quota_exceeded')).toBe(true);
      expect((await h.sessions()).length).toBe(3);
    } finally {
      await c.stop();
    }
  }, 120_000);
});
