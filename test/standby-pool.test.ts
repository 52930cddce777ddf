import { describe, expect, it } from 'vitest';
import { createLogger } from '../guest-agent/src/log.ts';
import { StandbyPool, type StandbyPoolOptions } from '../host-broker/src/vm/standby-pool.ts';

/**
 * The pool's bookkeeping (which item goes to whom, what is stopped when); the VMs it
 * holds in production are exercised in standby.test.ts.
 */
interface Item {
  id: number;
  key: string;
  alive: boolean;
  disposed: boolean;
}

function pool(o: Partial<StandbyPoolOptions<Item>> & { fillMs?: number; failFill?: boolean } = {}) {
  let n = 0;
  const made: Item[] = [];
  const p = new StandbyPool<Item>({
    size: 1,
    idleMs: 60_000,
    joinMs: 1_000,
    log: createLogger({ name: 'test', level: 'error' }),
    fill: async (key) => {
      await new Promise((r) => setTimeout(r, o.fillMs ?? 10));
      if (o.failFill) throw new Error('restore failed');
      const it = { id: ++n, key, alive: true, disposed: false };
      made.push(it);
      return it;
    },
    dispose: async (it) => void (it.disposed = true),
    alive: (it) => it.alive && !it.disposed,
    ...o,
  });
  return { p, made };
}

const until = async (cond: () => boolean, ms = 2_000) => {
  const end = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > end) throw new Error('timed out');
    await new Promise((r) => setTimeout(r, 5));
  }
};

describe('StandbyPool', () => {
  it('discard stops a ready item (a wake needs its room) and never one already taken', async () => {
    const { p, made } = pool();
    await p.take('k');
    p.replenish();
    await until(() => p.stats().ready === 1);
    const ready = made[0] as Item;
    expect(p.discard(ready, 'a wake needed its room')).toBe(true);
    await until(() => ready.disposed);
    expect(p.stats().ready).toBe(0);
    expect(await p.take('k')).toBeUndefined();
    // Once taken, an item is its session's VM: discard leaves it alone.
    p.replenish();
    await until(() => p.stats().ready === 1);
    const taken = await p.take('k');
    expect(taken?.id).toBe(2);
    expect(p.discard(taken as Item, 'late')).toBe(false);
    expect(taken?.disposed).toBe(false);
    await p.close();
  });

  it('misses first, fills only when told (after a wake), then hands each item out once', async () => {
    const { p, made } = pool();
    expect(await p.take('k')).toBeUndefined();
    expect(p.stats()).toMatchObject({ ready: 0, filling: 0, misses: 1 });
    p.replenish();
    await until(() => p.stats().ready === 1);
    const a = await p.take('k');
    expect(a?.id).toBe(1);
    // Taken: the next take finds nothing until the pool is replenished again.
    expect(await p.take('k')).toBeUndefined();
    p.replenish();
    await until(() => p.stats().ready === 1);
    expect((await p.take('k'))?.id).toBe(2);
    expect(made.every((m) => !m.disposed)).toBe(true);
  });

  it('a take during a fill gets that fill\'s item, and nobody else does', async () => {
    const { p } = pool({ fillMs: 100 });
    await p.take('k');
    p.replenish();
    const [x, y] = await Promise.all([p.take('k'), p.take('k')]);
    expect([x?.id, y?.id].filter(Boolean)).toEqual([1]);
    expect(p.stats().ready).toBe(0);
  });

  it('a fill slower than joinMs is not waited for, and its item joins the pool when ready (not lost)', async () => {
    const { p, made } = pool({ fillMs: 200, joinMs: 20 });
    await p.take('k');
    p.replenish();
    expect(await p.take('k')).toBeUndefined();
    await until(() => made.length === 1);
    await until(() => p.stats().ready === 1);
    expect(made[0]?.disposed).toBe(false);
    expect((await p.take('k'))?.id).toBe(1);
  });

  it('a dead item is stopped, never handed out', async () => {
    const { p, made } = pool();
    await p.take('k');
    p.replenish();
    await until(() => p.stats().ready === 1);
    (made[0] as Item).alive = false;
    expect(await p.take('k')).toBeUndefined();
    expect(made[0]?.disposed).toBe(true);
  });

  it('keeps items only for the most recently wanted keys; others are stopped', async () => {
    const { p, made } = pool();
    await p.take('a');
    p.replenish();
    await until(() => p.stats().ready === 1);
    expect(await p.take('b')).toBeUndefined();
    expect(made[0]?.disposed).toBe(true);
    p.replenish();
    await until(() => p.stats().ready === 1);
    expect(made[1]?.key).toBe('b');
  });

  it('stops an item not taken within idleMs, and does not refill its key until wanted again', async () => {
    const { p, made } = pool({ idleMs: 30 });
    await p.take('k');
    p.replenish();
    await until(() => made.length === 1);
    await until(() => made[0]?.disposed === true);
    p.replenish();
    await new Promise((r) => setTimeout(r, 50));
    expect(made.length).toBe(1);
  });

  it('does not fill without room (canFill), and a failed fill is a miss, not an error', async () => {
    const { p, made } = pool({ canFill: () => false });
    await p.take('k');
    p.replenish();
    await new Promise((r) => setTimeout(r, 30));
    expect(made.length).toBe(0);
    const f = pool({ failFill: true });
    await f.p.take('k');
    f.p.replenish();
    expect(await f.p.take('k')).toBeUndefined();
  });

  it('close() stops ready items and items whose fill ends later; size 0 is off', async () => {
    const { p, made } = pool({ fillMs: 50 });
    await p.take('k');
    p.replenish();
    await p.close();
    await until(() => made.length === 1);
    expect(made[0]?.disposed).toBe(true);
    const off = pool({ size: 0 });
    expect(off.p.enabled).toBe(false);
    off.p.replenish();
    expect(await off.p.take('k')).toBeUndefined();
    expect(off.made.length).toBe(0);
  });
});
