/**
 * Sorting a tenant-sized list without holding the event loop: one sort of 200,000 names
 * took 50-150 ms in one block, and the broker sorts such lists (a directory's entries, a
 * push's paths). Up to SORT_RUN items sort in one go; more are sorted in runs with `tick`
 * between them and merged lazily as the caller takes them, so a caller that ticks as it
 * consumes (a walk does, per entry) holds the loop for one run at most.
 */
export const SORT_RUN = 16384;

type Keyed<T> = { x: T; k: string };

/** `items` in order of `key` (compared as strings, by UTF-16 code units). */
export async function sortSliced<T>(items: readonly T[], key: (x: T) => string, tick?: () => Promise<void>): Promise<Iterable<T>> {
  if (items.length <= SORT_RUN) return sortedRun(items, key).map((e) => e.x);
  const runs: Array<Array<Keyed<T>>> = [];
  for (let i = 0; i < items.length; i += SORT_RUN) {
    runs.push(sortedRun(items.slice(i, i + SORT_RUN), key));
    if (tick) await tick();
  }
  return mergeRuns(runs);
}

function sortedRun<T>(items: readonly T[], key: (x: T) => string): Array<Keyed<T>> {
  const keyed = items.map((x) => ({ x, k: key(x) }));
  keyed.sort((a, b) => (a.k < b.k ? -1 : a.k > b.k ? 1 : 0));
  return keyed;
}

/** The runs' items in key order, the earlier run first on a tie. A scan of the run heads: a few dozen runs at most. */
function* mergeRuns<T>(runs: Array<Array<Keyed<T>>>): Generator<T> {
  const next = runs.map(() => 0);
  for (;;) {
    let best = -1;
    let key = '';
    for (let r = 0; r < runs.length; r++) {
      const e = (runs[r] as Array<Keyed<T>>)[next[r] as number];
      if (e && (best < 0 || e.k < key)) {
        best = r;
        key = e.k;
      }
    }
    if (best < 0) return;
    const run = runs[best] as Array<Keyed<T>>;
    yield (run[(next[best] as number)++] as Keyed<T>).x;
  }
}
