import { afterAll, describe, expect, it } from 'vitest';
import { existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { SlotDiskBudget, defaultSlotDisk, type SlotGrant } from '../host-broker/src/lifecycle/slot-disk-budget.ts';
import { SnapshotSlots } from '../host-broker/src/lifecycle/snapshot-slots.ts';
import { slotDiskFromFlags } from '../host-broker/src/cli.ts';

const MiB = 1024 * 1024;

function budget(o: { total?: number; principal?: number; reserve?: number; free?: () => number } = {}): SlotDiskBudget {
  return new SlotDiskBudget({ dir: tmpdir(), totalBytes: (o.total ?? 4096) * MiB, principalBytes: (o.principal ?? 1024) * MiB, reserveBytes: (o.reserve ?? 0) * MiB, freeBytes: o.free ?? (() => 1e15) });
}

function granted(r: SlotGrant | { refused: string }): SlotGrant {
  if ('refused' in r) throw new Error(`refused: ${r.refused}`);
  return r;
}

describe('slot disk budget', () => {
  it("holds one principal to its share, counting writes in flight, and leaves other principals' room alone", () => {
    const b = budget({ principal: 1000 });
    const g1 = granted(b.reserve('s1', 'alice', 600 * MiB, 0));
    // The first write is still going: its 600 MiB count, so a second one does not fit.
    const r = b.reserve('s2', 'alice', 600 * MiB, 0);
    expect(r).toMatchObject({ refused: expect.stringMatching(/principal alice's slots hold 600 MiB.*1000 MiB/) });
    expect(granted(b.reserve('s3', 'bob', 600 * MiB, 0))).toBeDefined();
    // Written, the slot measured 150 MiB: that is what alice holds from now on.
    g1.settle(150 * MiB);
    expect(b.heldBytes('alice')).toBe(150 * MiB);
    granted(b.reserve('s2', 'alice', 600 * MiB, 0)).settle(200 * MiB);
    expect(b.heldBytes('alice')).toBe(350 * MiB);
    // Closed sessions give their slots' disk back.
    b.forget('s1');
    b.forget('s2');
    expect(b.heldBytes('alice')).toBe(0);
  });

  it("counts the older slot a write replaces as freed, and a settle that never comes twice", () => {
    const b = budget({ principal: 1000 });
    b.set('s1', 'alice', 900 * MiB); // two slots of 450 MiB
    expect('refused' in b.reserve('s1', 'alice', 600 * MiB, 0)).toBe(true);
    const g = granted(b.reserve('s1', 'alice', 500 * MiB, 450 * MiB));
    g.settle(700 * MiB);
    g.settle(10 * MiB);
    expect(b.heldBytes('alice')).toBe(700 * MiB);
  });

  it('holds all principals to the total', () => {
    const b = budget({ total: 1000, principal: 800 });
    granted(b.reserve('a1', 'alice', 700 * MiB, 0)).settle(700 * MiB);
    expect(b.reserve('b1', 'bob', 400 * MiB, 0)).toMatchObject({ refused: expect.stringMatching(/slots hold 700 MiB.*1000 MiB of slot disk/) });
  });

  it('never writes into the free space kept for workspaces, not even at a final release', () => {
    let free = 3000 * MiB;
    const b = budget({ reserve: 2048, free: () => free });
    const g = granted(b.reserve('s1', 'alice', 700 * MiB, 0));
    // The write in flight is not on disk yet: it still counts against what is free.
    expect(b.reserve('s2', 'alice', 700 * MiB, 0, true)).toMatchObject({ refused: expect.stringMatching(/free on the data dir's disk.*2048 MiB kept free/) });
    free -= 700 * MiB;
    g.settle(700 * MiB);
    expect('refused' in b.reserve('s2', 'alice', 400 * MiB, 0)).toBe(true);
  });

  it("lets a final release (the VM stops anyway) past the principal's share, then counts it", () => {
    const b = budget({ principal: 500 });
    granted(b.reserve('s1', 'alice', 400 * MiB, 0)).settle(400 * MiB);
    expect('refused' in b.reserve('s2', 'alice', 400 * MiB, 0)).toBe(true);
    granted(b.reserve('s2', 'alice', 400 * MiB, 0, true)).settle(400 * MiB);
    expect(b.heldBytes('alice')).toBe(800 * MiB);
    expect('refused' in b.reserve('s3', 'alice', 1, 0)).toBe(true);
  });

  it('defaults to half the filesystem, half of that per principal with several, and 5% (2 GiB at least) kept free', () => {
    const one = defaultSlotDisk(tmpdir(), 1);
    const two = defaultSlotDisk(tmpdir(), 2);
    expect(one.totalBytes).toBeGreaterThan(0);
    expect(one.principalBytes).toBe(one.totalBytes);
    expect(two.principalBytes).toBe(Math.floor(two.totalBytes / 2));
    expect(one.reserveBytes).toBeGreaterThanOrEqual(2 * 1024 ** 3);
  });

  it('takes --slot-disk-gib and --principal-slot-disk-gib, and refuses a share above the total or a bad number', () => {
    expect(slotDiskFromFlags(undefined, undefined)).toEqual({});
    expect(slotDiskFromFlags('10', '4')).toEqual({ slotDisk: { totalBytes: 10 * 1024 ** 3, principalBytes: 4 * 1024 ** 3 } });
    expect(() => slotDiskFromFlags('4', '10')).toThrow(/at most --slot-disk-gib/);
    expect(() => slotDiskFromFlags('-1', undefined)).toThrow(/--slot-disk-gib must be a whole number/);
  });
});

describe('snapshot slots on disk', () => {
  const dir = mkdtempSync(join(tmpdir(), 'hutch-slots-'));
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  it('removes the older slot before writing the next one (two slots at most on disk) and measures allocated bytes', async () => {
    const slots = new SnapshotSlots(dir);
    const write = (fill: number, check?: () => void) =>
      slots.write(async (d) => {
        check?.();
        mkdirSync(d, { recursive: true });
        writeFileSync(join(d, 'state.bin'), Buffer.alloc(fill, 1));
        writeFileSync(join(d, 'manifest.json'), '{}');
        return { dir: d, state: join(d, 'state.bin'), manifest: join(d, 'manifest.json'), pristineKey: 'k' };
      });
    expect(slots.bytes()).toBe(0);
    await write(1 * MiB);
    await write(2 * MiB);
    expect(slots.bytes()).toBeGreaterThanOrEqual(3 * MiB);
    expect(slots.replacedBytes()).toBeGreaterThanOrEqual(1 * MiB);
    expect(slots.replacedBytes()).toBeLessThan(2 * MiB);
    const root = join(dir, 'slots');
    await write(4 * MiB, () => {
      // Writing into "a" again: the old "a" is gone, "b" (current) is still there.
      expect(existsSync(join(root, 'a'))).toBe(false);
      expect(existsSync(join(root, 'b', 'state.bin'))).toBe(true);
    });
    expect(slots.current()?.dir).toBe(join(root, 'a'));
    expect(slots.previous()?.dir).toBe(join(root, 'b'));
    expect(slots.bytes()).toBeGreaterThanOrEqual(6 * MiB);
    expect(slots.bytes()).toBeLessThan(7 * MiB);
  });
});
