/**
 * "Does some ancestor of this workspace path pass a test?", asked of every key of a
 * manifest, in time linear in the keys' total length.
 *
 * The obvious loop (slice each ancestor, look it up) costs, per key, its depth times its
 * length, since hashing a sliced string reads it whole. A tenant decides both: one chain
 * of 2,000 nested one-letter directories (4,000-byte paths, within PATH_MAX) made one pass
 * over a manifest 3.9 s of the broker's loop, and the cost grows with the cube of the depth.
 * Here each distinct ancestor is tested once and remembered, and a walk up stops at the
 * first ancestor already known.
 */
export class AncestorTest {
  /** Path -> whether the path itself or one of its ancestors passes the test. */
  private readonly known = new Map<string, boolean>();

  constructor(private readonly test: (path: string) => boolean) {}

  /** Whether a proper ancestor of `path` passes the test (`a/b/c`: `a/b` or `a`). */
  anyAncestor(path: string): boolean {
    const i = path.lastIndexOf('/');
    return i > 0 ? this.selfOrAncestor(path.slice(0, i)) : false;
  }

  /** Whether `path` or one of its ancestors passes the test. */
  selfOrAncestor(path: string): boolean {
    const chain: string[] = [];
    let result = false;
    let cur: string | undefined = path;
    while (cur !== undefined) {
      const k = this.known.get(cur);
      if (k !== undefined) {
        result = k;
        break;
      }
      chain.push(cur);
      if (this.test(cur)) {
        result = true;
        break;
      }
      const i = cur.lastIndexOf('/');
      cur = i > 0 ? cur.slice(0, i) : undefined;
    }
    // Everything walked through gets the answer: below a passing path (or one known to be
    // below one) every path is below it too; otherwise none on the way passed.
    for (const c of chain) this.known.set(c, result);
    return result;
  }
}

/**
 * Adds `path` and all its ancestors to `set`, stopping at the first one already there
 * (whose ancestors, added the same way, are there too): linear in the paths' total length.
 */
export function addWithAncestors(set: Set<string>, path: string): void {
  for (let i = path.length; i > 0; i = path.lastIndexOf('/', i - 1)) {
    const a = i === path.length ? path : path.slice(0, i);
    if (set.has(a)) return;
    set.add(a);
  }
}
