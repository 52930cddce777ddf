import { describe, expect, it } from 'vitest';
import { SORT_RUN, sortSliced } from '../guest-agent/src/workspace/sliced-sort.ts';
import { diffManifests, type Manifest } from '../host-broker/src/sync/manifest.ts';

describe('sorting in runs between ticks', () => {
  it('orders a list above one run like a plain sort, ticking between runs, ties in input order', async () => {
    const n = SORT_RUN * 3 + 17;
    const items = Array.from({ length: n }, (_, i) => ({ i, k: `k${((i * 7919) % 5000).toString(36)}\u00e9${i % 3 ? '' : '\ud83d\ude00'}` }));
    let ticks = 0;
    const got = [...(await sortSliced(items, (x) => x.k, async () => void ticks++))];
    const want = [...items].sort((a, b) => (a.k < b.k ? -1 : a.k > b.k ? 1 : a.i - b.i));
    expect(got.map((x) => x.i)).toEqual(want.map((x) => x.i));
    expect(ticks).toBe(4);
    // A short list is one plain sort, no tick.
    const short = [...(await sortSliced(['b', 'a', 'c'], (x) => x, async () => void ticks++))];
    expect(short).toEqual(['a', 'b', 'c']);
    expect(ticks).toBe(4);
  });

  it("a push's diff of a 40,000-entry manifest: parents first, deletions deepest first", async () => {
    const file = { kind: 'file' as const, size: 1, mtimeMs: 1, mode: 0o644 };
    const dir = { kind: 'dir' as const, size: 0, mtimeMs: 0, mode: 0o755 };
    const from: Manifest = new Map();
    const to: Manifest = new Map();
    for (let d = 0; d < 40; d++) {
      from.set(`d${d}`, dir);
      for (let f = 0; f < 1000; f++) from.set(`d${d}/f${(f * 7919) % 1000}`, file);
      to.set(`old${d}`, dir);
      to.set(`old${d}/sub`, dir);
      to.set(`old${d}/sub/x`, file);
    }
    const { write, remove } = await diffManifests(from, to);
    expect(write).toEqual([...from.keys()].sort());
    expect(write.indexOf('d7')).toBeLessThan(write.indexOf('d7/f0'));
    // Only the top of a removed tree is named (its contents go with it).
    expect(remove).toEqual([...Array(40).keys()].map((d) => `old${d}`).sort().reverse());
  });
});
