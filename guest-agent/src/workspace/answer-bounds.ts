/**
 * How much one file tool's answer may carry, and how the tools keep no more than that while
 * they work. A read of a file of 40 million empty lines with `limit: 2**31` built a 469 MB
 * answer in the broker (4.1 GiB of heap, every tenant's calls held 27 s); a grep kept every
 * file's matches until the end. Each answer is now cut at a number of lines or entries (the
 * caller's `limit`) and at ANSWER_MAX_BYTES of text, whichever comes first, and says so
 * (`hasMore`/`truncated`, with where to go on: `nextOffset`).
 */

/** Lines a read answers when the caller names no limit (opencode's). */
export const READ_DEFAULT_LINES = 2000;

/**
 * Bytes of text one answer carries: a read's content, a list's or glob's paths, a grep's
 * paths and lines. opencode cuts its read at 50 KiB because the answer goes into a model's
 * context (50 KiB is some 12,000 tokens, already a large share of one); hutch answers the
 * same tools to the same agents, so it cuts where opencode does, for every tool. It also
 * keeps what a tenant can make the broker build, encode and hold per call to a size that
 * costs well under a millisecond and a few MiB for hundreds of calls at once.
 */
export const ANSWER_MAX_BYTES = 50 * 1024;

/**
 * Levels below its start a search tool's walk (list, glob, grep) descends. Source trees go
 * a few dozen levels deep; a tree deeper than this was made to be deep (a chain of
 * directories from a loop of `mkdir d; cd d`), and an answer that stops here says so
 * (`walkLimit: 'depth'`) instead of listing down to the 2,048 levels a path can name.
 */
export const WALK_MAX_DEPTH = 256;

/**
 * Directory entries a search tool's walk looks at (skipped and ignored ones included): the
 * default workspace quota's entry count, so a workspace within the default quota is always
 * searched whole, and one given a larger quota gets an answer marked `walkLimit: 'entries'`
 * instead of a call whose time grows with it.
 */
export const WALK_MAX_ENTRIES = 200_000;

/** What one path or line adds to an answer's text (as an agent prints it: one per line). */
export function textBytes(s: string): number {
  return Buffer.byteLength(s) + 1;
}

/**
 * Counts what goes into an answer: `take` says whether one more unit of `bytes` fits under
 * both caps. The first unit always fits (a line is cut at 2,000 characters and a path at
 * 4,096 bytes, far below the byte cap), so an answer never comes back empty for size alone.
 */
export class AnswerCap {
  units = 0;
  bytes = 0;
  /** Set once a unit did not fit: there is more than the answer holds. */
  full = false;

  constructor(
    readonly maxUnits: number,
    readonly maxBytes: number,
  ) {}

  take(bytes: number): boolean {
    if (this.full || this.units >= this.maxUnits || (this.units > 0 && this.bytes + bytes > this.maxBytes)) {
      this.full = true;
      return false;
    }
    this.units++;
    this.bytes += bytes;
    return true;
  }
}

interface Held<T> {
  item: T;
  units: number;
  bytes: number;
}

/**
 * Of items offered in any order, keeps only those that can still be part of an answer of
 * at most `maxUnits` units and `maxBytes` bytes, taken in `order` (negative: `a` first).
 * glob sorts by modification time and grep by its files' times, so nothing can be answered
 * before the walk ends; this holds at most one answer's worth (plus one item) meanwhile,
 * where the tools held every match of the tree. A max-heap on `order`: its root is the
 * item that would come last, dropped once the items before it fill the answer either way.
 */
export class BoundedAnswer<T> {
  private readonly heap: Array<Held<T>> = [];
  private heldUnits = 0;
  private heldBytes = 0;
  /** Units offered in all: more than the answer holds means it is truncated. */
  offered = 0;

  constructor(
    private readonly order: (a: T, b: T) => number,
    private readonly maxUnits: number,
    private readonly maxBytes: number,
  ) {}

  offer(item: T, units: number, bytes: number): void {
    this.offered += units;
    if (units === 0) return;
    this.push({ item, units, bytes });
    this.heldUnits += units;
    this.heldBytes += bytes;
    for (;;) {
      const last = this.heap[0] as Held<T>;
      if (this.heap.length === 1 || (this.heldUnits - last.units < this.maxUnits && this.heldBytes - last.bytes < this.maxBytes)) return;
      this.popRoot();
      this.heldUnits -= last.units;
      this.heldBytes -= last.bytes;
    }
  }

  /** The items held, in answer order. */
  sorted(): T[] {
    return this.heap.map((h) => h.item).sort(this.order);
  }

  private after(i: number, j: number): boolean {
    return this.order((this.heap[i] as Held<T>).item, (this.heap[j] as Held<T>).item) > 0;
  }

  private swap(i: number, j: number): void {
    const t = this.heap[i] as Held<T>;
    this.heap[i] = this.heap[j] as Held<T>;
    this.heap[j] = t;
  }

  private push(h: Held<T>): void {
    this.heap.push(h);
    for (let i = this.heap.length - 1; i > 0; ) {
      const parent = (i - 1) >> 1;
      if (!this.after(i, parent)) break;
      this.swap(i, parent);
      i = parent;
    }
  }

  private popRoot(): void {
    const end = this.heap.pop() as Held<T>;
    if (this.heap.length === 0) return;
    this.heap[0] = end;
    for (let i = 0; ; ) {
      const l = 2 * i + 1;
      const r = l + 1;
      let top = i;
      if (l < this.heap.length && this.after(l, top)) top = l;
      if (r < this.heap.length && this.after(r, top)) top = r;
      if (top === i) return;
      this.swap(i, top);
      i = top;
    }
  }
}
