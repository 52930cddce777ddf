import { describe, expect, it } from 'vitest';
import { ByteBudget } from '../host-broker/src/util/byte-budget.ts';

/** What the broker holds of request bodies at once, in all and per principal. */
describe('ByteBudget', () => {
  it('grants what fits at once; the rest waits for releases, per principal and in all', async () => {
    const b = new ByteBudget(100, 60, 'test');
    const a1 = await b.reserve(50, 'alice', 1000);
    const granted: string[] = [];
    const a2 = b.reserve(50, 'alice', 1000).then((r) => (granted.push('alice2'), r)); // alice would hold 100 > 60
    const b1 = await b.reserve(40, 'bob', 1000); // fits: 90 of 100, bob 40 of 60
    const c1 = b.reserve(20, 'carol', 1000).then((r) => (granted.push('carol'), r)); // 110 > 100: waits
    await new Promise((r) => setTimeout(r, 10));
    expect([b.inUse, granted]).toEqual([90, []]);
    b1(); // 50 in use: carol fits (70); alice's second still does not (alice 100 > 60)
    (await c1)();
    expect(granted).toEqual(['carol']);
    a1();
    (await a2)();
    expect(granted).toEqual(['carol', 'alice2']);
    expect(b.inUse).toBe(0);
  });

  it('a wait past its time is busy, and its place no longer holds anyone back; a release twice counts once', async () => {
    const b = new ByteBudget(100, 100, 'upload');
    const held = await b.reserve(100, 'alice', 1000);
    await expect(b.reserve(10, 'bob', 20)).rejects.toMatchObject({ code: 'busy', message: /upload: waited 20 ms for 10 bytes/ });
    held();
    held();
    expect(b.inUse).toBe(0);
    (await b.reserve(100, 'bob', 10))();
  });

  it('a request above the per-principal budget reserves the whole budget (and so runs alone)', async () => {
    const b = new ByteBudget(1000, 100, 'x');
    const big = await b.reserve(5000, 'alice', 1000);
    expect(b.inUse).toBe(100);
    const next = b.reserve(1, 'alice', 30);
    await expect(next).rejects.toMatchObject({ code: 'busy' });
    big();
  });

  it("a key's waiters are granted in the order they asked: a small later one does not pass a large earlier one", async () => {
    const b = new ByteBudget(100, 100, 'x');
    const alice = await b.reserve(60, 'alice', 1000);
    const bob = await b.reserve(30, 'bob', 1000);
    const order: string[] = [];
    const large = b.reserve(50, 'alice', 1000).then((r) => (order.push('large'), r));
    const small = b.reserve(5, 'alice', 1000).then((r) => (order.push('small'), r));
    bob(); // 60 in use: the small one would fit, the large one not yet
    await new Promise((r) => setTimeout(r, 10));
    expect(order).toEqual([]);
    const carol = await b.reserve(5, 'carol', 1000); // another key is not held back
    carol();
    alice();
    (await large)();
    (await small)();
    expect(order).toEqual(['large', 'small']);
  });

  it('a wait without deadline ends when its signal aborts, and its place no longer holds anyone back', async () => {
    const b = new ByteBudget(100, 100, 'x');
    const held = await b.reserve(100, 'alice', 1000);
    const ac = new AbortController();
    const waiting = b.reserve(60, 'alice', Infinity, ac.signal);
    const behind = b.reserve(10, 'alice', Infinity);
    ac.abort(new Error('gone'));
    await expect(waiting).rejects.toThrow('gone');
    held();
    (await behind)();
    expect(b.inUse).toBe(0);
    await expect(b.reserve(1, 'alice', Infinity, ac.signal)).rejects.toThrow('gone');
  });
});
