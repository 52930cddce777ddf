import { closeSync, existsSync, openSync, readSync, writeSync } from 'node:fs';

/**
 * Idle page tracking (/sys/kernel/mm/page_idle/bitmap, CONFIG_IDLE_PAGE_TRACKING): one bit
 * per page frame. Writing 1 marks a page idle (and clears the accessed bits of its
 * mappings); any access afterwards clears the bit. Reading checks the accessed bits
 * through the reverse map. The file is read and written in 8-byte words (64 frames each),
 * at 8-byte aligned offsets.
 */
export const PAGE_IDLE_BITMAP = '/sys/kernel/mm/page_idle/bitmap';
/** Words whose offsets are this close are read or written in one syscall. */
const MAX_GAP_WORDS = 4;

export function pageIdleAvailable(): boolean {
  return existsSync(PAGE_IDLE_BITMAP);
}

/** Sorted unique word indices with the bit masks of the frames asked for (lo/hi 32-bit halves). */
function wordsOf(pfns: Iterable<number>): Map<number, [number, number]> {
  const words = new Map<number, [number, number]>();
  for (const pfn of pfns) {
    const w = Math.floor(pfn / 64);
    const bit = pfn % 64;
    let m = words.get(w);
    if (!m) words.set(w, (m = [0, 0]));
    if (bit < 32) m[0] = (m[0] | (1 << bit)) >>> 0;
    else m[1] = (m[1] | (1 << (bit - 32))) >>> 0;
  }
  return new Map([...words.entries()].sort((a, b) => a[0] - b[0]));
}

/** Runs of word indices close enough to share one read or write. */
function runs(words: number[]): Array<[number, number]> {
  const out: Array<[number, number]> = [];
  for (const w of words) {
    const last = out[out.length - 1];
    if (last && w - last[1] <= MAX_GAP_WORDS) last[1] = w;
    else out.push([w, w]);
  }
  return out;
}

export function markIdle(pfns: Iterable<number>): void {
  const words = wordsOf(pfns);
  if (words.size === 0) return;
  const fd = openSync(PAGE_IDLE_BITMAP, 'r+');
  try {
    for (const [a, b] of runs([...words.keys()])) {
      // Zero bits in the gap words are no-ops: only set bits mark frames idle.
      const buf = Buffer.alloc((b - a + 1) * 8);
      for (let w = a; w <= b; w++) {
        const m = words.get(w);
        if (!m) continue;
        buf.writeUInt32LE(m[0], (w - a) * 8);
        buf.writeUInt32LE(m[1], (w - a) * 8 + 4);
      }
      writeSync(fd, buf, 0, buf.length, a * 8);
    }
  } finally {
    closeSync(fd);
  }
}

/** The subset of `pfns` still idle (not accessed since they were marked). */
export function stillIdle(pfns: Iterable<number>): Set<number> {
  const words = wordsOf(pfns);
  const idle = new Set<number>();
  if (words.size === 0) return idle;
  const fd = openSync(PAGE_IDLE_BITMAP, 'r');
  try {
    for (const [a, b] of runs([...words.keys()])) {
      const buf = Buffer.alloc((b - a + 1) * 8);
      readSync(fd, buf, 0, buf.length, a * 8);
      for (let w = a; w <= b; w++) {
        const m = words.get(w);
        if (!m) continue;
        const lo = buf.readUInt32LE((w - a) * 8) & m[0];
        const hi = buf.readUInt32LE((w - a) * 8 + 4) & m[1];
        for (let bit = 0; bit < 32; bit++) {
          if (lo & (1 << bit)) idle.add(w * 64 + bit);
          if (hi & (1 << bit)) idle.add(w * 64 + 32 + bit);
        }
      }
    }
  } finally {
    closeSync(fd);
  }
  return idle;
}
