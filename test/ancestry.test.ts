import { describe, expect, it } from 'vitest';
import { AncestorTest, addWithAncestors } from '../guest-agent/src/workspace/ancestry.ts';
import { diffManifests, type Manifest } from '../host-broker/src/sync/manifest.ts';

/** The per-key walk these replace: every ancestor sliced and looked up. */
function naiveAnyAncestor(key: string, test: (p: string) => boolean): boolean {
  for (let i = key.lastIndexOf('/'); i > 0; i = key.lastIndexOf('/', i - 1)) if (test(key.slice(0, i))) return true;
  return false;
}

/** A tenant's deepest possible chain: one-letter directories nested up to a 4,000-byte path. */
function chain(top: string, depth: number): string[] {
  const out: string[] = [];
  let p = top;
  for (let i = 0; i < depth; i++) {
    out.push(p);
    p += '/d';
  }
  return out;
}

describe('ancestor tests over a manifest', () => {
  it('answers as the per-key walk does, in any order of asking, memo or not', () => {
    // A small tree with every shape: siblings, names that are prefixes of others, deep arms.
    const paths = ['a', 'a/b', 'a/b/c', 'a/bb', 'a/bb/c', 'ab', 'ab/c', 'x', 'x/y', 'x/y/z', 'x/y/z/w', 'x/yy', 'q/r/s'];
    for (const marked of [new Set(['a/b']), new Set(['a', 'x/y/z']), new Set(['ab', 'x']), new Set<string>(), new Set(['q/r'])]) {
      for (const order of [paths, [...paths].reverse(), [...paths].sort((p, q) => q.length - p.length)]) {
        const t = new AncestorTest((p) => marked.has(p));
        for (const p of order) {
          expect(t.anyAncestor(p), `${p} under ${[...marked].join(',')}`).toBe(naiveAnyAncestor(p, (a) => marked.has(a)));
          expect(t.selfOrAncestor(p)).toBe(marked.has(p) || naiveAnyAncestor(p, (a) => marked.has(a)));
        }
      }
    }
  });

  it('a 2,000-deep chain: only what lies below the marked directory is below it', () => {
    const keys = chain('top', 2000);
    const marked = keys[1500] as string;
    const t = new AncestorTest((p) => p === marked);
    // Deepest first: the first question walks the whole chain, every later one stops at once.
    const below = [...keys].reverse().filter((k) => t.anyAncestor(k));
    expect(below.length).toBe(2000 - 1501);
    expect(below.every((k) => k.length > marked.length && k.startsWith(`${marked}/`))).toBe(true);
    expect(keys.filter((k) => t.selfOrAncestor(k)).length).toBe(500);
  });

  it('addWithAncestors adds a path and every ancestor once, a sibling does not stop it early', () => {
    const s = new Set<string>();
    addWithAncestors(s, 'a/b/c');
    addWithAncestors(s, 'a/b/d/e');
    addWithAncestors(s, 'a/bx');
    addWithAncestors(s, 'z');
    expect([...s].sort()).toEqual(['a', 'a/b', 'a/b/c', 'a/b/d', 'a/b/d/e', 'a/bx', 'z']);
    const deep = new Set<string>();
    for (const k of chain('c', 2000).reverse()) addWithAncestors(deep, k);
    expect(deep.size).toBe(2000);
  });

  it("a push's diff that removes a 2,000-deep chain names only its top", async () => {
    const dir = { kind: 'dir' as const, size: 0, mtimeMs: 0, mode: 0o755 };
    const from: Manifest = new Map([['kept', dir]]);
    const to: Manifest = new Map([['kept', dir]]);
    for (const k of chain('gone', 2000)) to.set(k, dir);
    for (const k of chain('kept/deep', 300)) {
      from.set(k, dir);
      to.set(k, dir);
    }
    const { write, remove } = await diffManifests(from, to);
    expect(remove).toEqual(['gone']);
    expect(write).toEqual([]);
  });
});
