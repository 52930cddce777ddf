import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Hutch } from '../../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/**
 * One tenant's long VM commands must not hold every other tenant's VM calls. The broker
 * admits a bounded number of VM calls at once; a call held its slot for as long as its
 * command ran, so a tenant with as many `sleep 600` calls as there are slots (four on a
 * two-core host) made everyone else's VM calls wait, then fail busy. (The unsafe-local
 * backend here: the admission path is the same for every backend, and no VM is needed to
 * hold a slot with `sleep`.)
 */
const ALICE = 'alice-token-slots-0123456789';
const BOB = 'bob-token-slots-0123456789ab';

describe('VM call admission between tenants', () => {
  let b: TestBroker;
  beforeAll(async () => {
    b = await startBroker({ tokens: { alice: ALICE, bob: BOB }, admission: { maxConcurrentVmCalls: 1, queueTimeoutMs: 60_000, vmCallSlotMs: 500 } });
  }, 120_000);
  afterAll(async () => b?.stop());

  it("another principal's VM call runs while a long one is still running in the only slot", async () => {
    const alice = await Hutch.connect(b.url, { token: ALICE });
    const bob = await Hutch.connect(b.url, { token: BOB });
    const sa = await alice.create({});
    const sb = await bob.create({});
    // Admission takes principals in turn: each session's VM work is queued as its owner's.
    expect([b.broker.sessions.get(sa.id).vm['spec'].principal, b.broker.sessions.get(sb.id).vm['spec'].principal]).toEqual(['alice', 'bob']);
    const order: string[] = [];
    const long = sa.run('sleep 15; echo slept', { route: 'vm' }).then((r) => {
      order.push('alice');
      return r;
    });
    await new Promise((r) => setTimeout(r, 300)); // alice's call holds the slot now
    const short = await sb.run('echo hi', { route: 'vm' });
    order.push('bob');
    expect(short.stdout).toBe('hi\n');
    expect(order).toEqual(['bob']); // alice's sleep is still running
    expect((await long).stdout).toBe('slept\n');
    expect(order).toEqual(['bob', 'alice']);
    alice.close();
    bob.close();
  }, 120_000);
});
