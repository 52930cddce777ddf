import { describe, expect, it } from 'vitest';
import { Admission } from '../host-broker/src/admission.ts';
import { HutchError } from '../guest-agent/src/protocol/errors.ts';

/**
 * The memory budget bounds every VM the broker keeps, standbys included: a standby holds
 * room like a live VM but is worth less than any session's, so a wake that needs its room
 * takes it (the standby is stopped) instead of waiting, and no standby takes room while a
 * wake waits for it.
 */
function admission(budgetMiB: number, queueTimeoutMs = 200): Admission {
  return new Admission({ maxConcurrentWakes: 4, maxConcurrentVmCalls: 4, memoryBudgetMiB: budgetMiB, queueTimeoutMs });
}

describe('memory budget with standby VMs', () => {
  it('a standby is granted room only inside the budget, and counts against it', async () => {
    const a = admission(1000);
    const live = await a.reserveMemory(600, 's1');
    expect(a.reserveYielding(500, () => undefined)).toBeUndefined();
    const stopped: string[] = [];
    const give = a.reserveYielding(400, () => stopped.push('sb'));
    expect(give).toBeTypeOf('function');
    expect(a.memoryReservedMiB).toBe(1000);
    // What a wake could have: the standby's room too.
    expect(a.freeMiB).toBe(400);
    // Taken by a wake (which reserved its own) or stopped: the room goes back, once.
    give?.();
    give?.();
    expect(a.memoryReservedMiB).toBe(600);
    expect(stopped).toEqual([]);
    live();
    expect(a.memoryReservedMiB).toBe(0);
  });

  it('a wake that needs a standby\'s room stops it (oldest first) and does not wait', async () => {
    const a = admission(1000, 60_000);
    const live = await a.reserveMemory(400, 's1');
    const stopped: string[] = [];
    const give1 = a.reserveYielding(300, () => stopped.push('sb1'));
    const give2 = a.reserveYielding(300, () => stopped.push('sb2'));
    expect(a.memoryReservedMiB).toBe(1000);
    const t0 = Date.now();
    const wake = await a.reserveMemory(300, 's2');
    expect(Date.now() - t0).toBeLessThan(5_000); // not the 60 s queue timeout
    expect(stopped).toEqual(['sb1']);
    expect(a.memoryReservedMiB).toBe(1000);
    // The stopped standby's own release later (its VM disposed) frees nothing twice.
    give1?.();
    expect(a.memoryReservedMiB).toBe(1000);
    give2?.();
    wake();
    live();
    expect(a.memoryReservedMiB).toBe(0);
  });

  it('standbys are left alone when stopping them would not make room: the wake waits for live VMs, then fails busy naming what live VMs hold', async () => {
    const a = admission(1000, 150);
    const live = await a.reserveMemory(800, 's1');
    const stopped: string[] = [];
    const give = a.reserveYielding(200, () => stopped.push('sb'));
    const err = await a.reserveMemory(400, 's2').catch((e: unknown) => e);
    expect(err).toBeInstanceOf(HutchError);
    expect((err as HutchError).code).toBe('busy');
    expect((err as HutchError).message).toContain('800 of 1000 MiB reserved by live VMs');
    expect(stopped).toEqual([]);
    give?.();
    live();
  });

  it('no standby takes room while a wake waits for it, and the waiting wake gets the room a live VM gives back', async () => {
    const a = admission(1000, 60_000);
    const live = await a.reserveMemory(900, 's1');
    const waiting = a.reserveMemory(500, 's2');
    expect(a.roomToYield(100)).toBe(false);
    expect(a.reserveYielding(100, () => undefined)).toBeUndefined();
    live();
    const wake = await waiting;
    expect(a.memoryReservedMiB).toBe(500);
    // Nobody waits now: a standby fits again.
    expect(a.roomToYield(500)).toBe(true);
    expect(a.roomToYield(501)).toBe(false);
    wake();
  });

  it('a session larger than the whole budget is refused at once, standbys or not', async () => {
    const a = admission(1000);
    const give = a.reserveYielding(1000, () => undefined);
    await expect(a.reserveMemory(1001, 'big')).rejects.toMatchObject({ code: 'too_large' });
    expect(a.memoryReservedMiB).toBe(1000);
    give?.();
  });
});

/**
 * A VM call holds its admission slot for the push and the start of its run, not for as long
 * as the command runs: four slots taken by one tenant's `sleep 600` held every other
 * tenant's VM calls until they failed busy.
 */
describe('VM call slots', () => {
  it('a call still running past vmCallSlotMs gives its slot to the next waiter; its own release later is a no-op', async () => {
    const a = new Admission({ maxConcurrentWakes: 1, maxConcurrentVmCalls: 1, memoryBudgetMiB: 1000, queueTimeoutMs: 5000, vmCallSlotMs: 100 });
    const long = await a.admitVmCall();
    let second: (() => void) | undefined;
    const waiting = a.admitVmCall().then((d) => (second = d));
    await new Promise((r) => setTimeout(r, 20));
    expect(second).toBeUndefined(); // within the slot time the long call holds it
    expect(a.vmCalls.waiting).toBe(1);
    await waiting; // then it passes on, the long call still running
    expect(a.vmCalls.inUse).toBe(1);
    long(); // the long call ends: nothing to give back twice
    expect(a.vmCalls.inUse).toBe(1);
    second?.();
    expect(a.vmCalls.inUse).toBe(0);
  });

  it('a call that ends within the slot time passes its slot on at once', async () => {
    const a = new Admission({ maxConcurrentWakes: 1, maxConcurrentVmCalls: 1, memoryBudgetMiB: 1000, queueTimeoutMs: 5000, vmCallSlotMs: 60_000 });
    const first = await a.admitVmCall();
    const next = a.admitVmCall();
    first();
    const done = await next;
    expect(a.vmCalls.inUse).toBe(1);
    done();
    expect(a.vmCalls.inUse).toBe(0);
  });
});

describe('fair admission between principals', () => {
  it('a free slot goes to the principals in turn, each one\'s waiters in arrival order', async () => {
    const a = new Admission({ maxConcurrentWakes: 1, maxConcurrentVmCalls: 1, memoryBudgetMiB: 1000, queueTimeoutMs: 5000 });
    const held = await a.wakes.acquire(5000, 'alice');
    const order: string[] = [];
    const queued: Array<Promise<void>> = [];
    // Alice queues five wakes before Bob and Carol queue one each.
    for (let i = 1; i <= 5; i++) queued.push(a.wakes.acquire(5000, 'alice').then((done) => (order.push(`alice${i}`), done())));
    queued.push(a.wakes.acquire(5000, 'bob').then((done) => (order.push('bob'), done())));
    queued.push(a.wakes.acquire(5000, 'carol').then((done) => (order.push('carol'), done())));
    expect(a.wakes.waiting).toBe(7);
    held();
    await Promise.all(queued);
    // FIFO would have served alice1..alice5 first.
    expect(order).toEqual(['alice1', 'bob', 'carol', 'alice2', 'alice3', 'alice4', 'alice5']);
    expect([a.wakes.inUse, a.wakes.waiting]).toEqual([0, 0]);
  });

  it('a waiter that times out leaves its principal\'s queue; the others are still served', async () => {
    const a = new Admission({ maxConcurrentWakes: 1, maxConcurrentVmCalls: 1, memoryBudgetMiB: 1000, queueTimeoutMs: 5000 });
    const held = await a.wakes.acquire(5000, 'alice');
    const late = a.wakes.acquire(30, 'bob');
    const next = a.wakes.acquire(5000, 'carol');
    await expect(late).rejects.toMatchObject({ code: 'busy' });
    expect(a.wakes.waiting).toBe(1);
    held();
    (await next)();
    expect([a.wakes.inUse, a.wakes.waiting]).toEqual([0, 0]);
  });
});

/**
 * One tenant keeping its VMs busy held the whole memory budget: every other tenant's wake
 * waited, then failed busy. A principal's VMs reserve at most principalMemoryMiB (half the
 * budget by default once several principals share a broker).
 */
describe('memory per principal', () => {
  it("a principal at its share waits for one of its own VMs, and fails busy naming its share; another's wake goes on", async () => {
    const a = new Admission({ maxConcurrentWakes: 4, maxConcurrentVmCalls: 4, memoryBudgetMiB: 2000, queueTimeoutMs: 100, principalMemoryMiB: 1000 });
    const a1 = await a.reserveMemory(512, 's1', 'alice');
    await expect(a.reserveMemory(512, 's2', 'alice')).rejects.toMatchObject({ code: 'busy', context: { principalReservedMiB: 512, principalMemoryMiB: 1000 } });
    const b1 = await a.reserveMemory(512, 's3', 'bob'); // the budget has room: bob is not held back
    // Alice's next wake waits for her own release, not a timeout.
    const next = a.reserveMemory(512, 's2', 'alice');
    a1();
    (await next)();
    b1();
    expect(a.memoryReservedMiB).toBe(0);
    await expect(a.reserveMemory(1024, 's4', 'carol')).rejects.toMatchObject({ code: 'too_large', context: { principalMemoryMiB: 1000 } });
  });

  it('several principals on a broker get half the budget each by default; one gets all of it', async () => {
    const { startBroker } = await import('./helpers/broker.ts');
    const one = await startBroker({ admission: { memoryBudgetMiB: 4000 } });
    const two = await startBroker({ tokens: { alice: 'alice-token-share-0123456789' }, admission: { memoryBudgetMiB: 4000 } });
    try {
      expect(one.broker.admission.opts.principalMemoryMiB).toBe(4000);
      expect(two.broker.admission.opts.principalMemoryMiB).toBe(2000);
    } finally {
      await one.stop();
      await two.stop();
    }
  }, 120_000);
});

describe('fast-path runs', () => {
  it('a principal at its cap waits while another principal is served, in turn', async () => {
    const a = new Admission({ maxConcurrentWakes: 1, maxConcurrentVmCalls: 1, memoryBudgetMiB: 10_000, queueTimeoutMs: 200, maxConcurrentFastPath: 3, principalFastPath: 1, fastPathRunMiB: 100, fastPathQueueMs: 5000 });
    const first = await a.admitFastPath('s1', 'p');
    const order: string[] = [];
    const second = a.admitFastPath('s2', 'p').then((r) => (order.push('p'), r));
    const other = await a.admitFastPath('s3', 'q');
    order.push('q');
    expect(a.fastPathRuns.inUse).toBe(2);
    expect(a.fastPathReservedMiB).toBe(200);
    first.release();
    (await second).release();
    other.release();
    expect(order).toEqual(['q', 'p']);
    expect(a.fastPathReservedMiB).toBe(0);
    expect(a.memoryReservedMiB).toBe(0);
  });

  it('waits for memory within its deadline, then fails busy; a VM share is not charged', async () => {
    const a = new Admission({ maxConcurrentWakes: 1, maxConcurrentVmCalls: 1, memoryBudgetMiB: 1000, principalMemoryMiB: 500, queueTimeoutMs: 200, fastPathRunMiB: 400, fastPathQueueMs: 300 });
    const vm = await a.reserveMemory(500, 'vm', 'p');
    // The principal's VMs are at their share; its fast-path run still fits the budget.
    const run = await a.admitFastPath('s1', 'p');
    await expect(a.admitFastPath('s2', 'q')).rejects.toMatchObject({ code: 'busy' });
    expect(a.fastPathRuns.inUse).toBe(1); // the refused run gave its slot back
    run.release();
    vm();
    expect(a.memoryReservedMiB).toBe(0);
  });
});
