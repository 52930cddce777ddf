/** Text helpers shared by read, grep and edit. */

export const MAX_LINE_CHARS = 2000;

/**
 * Binary if the first 8 KiB hold a NUL byte or mostly control characters: the same
 * heuristic opencode and git use, cheap and right for source trees.
 */
export function looksBinary(buf: Uint8Array): boolean {
  const n = Math.min(buf.length, 8192);
  if (n === 0) return false;
  let control = 0;
  for (let i = 0; i < n; i++) {
    const b = buf[i] as number;
    if (b === 0) return true;
    if (b < 7 || (b > 14 && b < 32)) control++;
  }
  return control / n > 0.3;
}

/** Splits on \n keeping \r in place; a trailing newline does not make an extra line. */
/** Bytes scanned for newlines between two chances to yield. */
const SCAN_CHUNK_BYTES = 1 << 20;

/**
 * The lines `from` .. `from + count - 1` of a text buffer, decoded (each cut at
 * MAX_LINE_CHARS, with `cut` telling how many were), and how many lines it has: the text
 * split at '\n', a final newline ending the last line rather than starting an empty one
 * ('\n' is never part of a UTF-8 multibyte sequence, so the bytes split where the text
 * does). Works on the bytes: splitting a 64 MiB file of short lines into strings held the
 * loop for 760 ms and took 450 MB; this decodes only the lines asked for and calls `tick`
 * between megabytes (a LoopSlicer's, to let others run).
 */
export async function lineWindow(buf: Uint8Array, from: number, count: number, tick: () => Promise<void>): Promise<{ total: number; lines: string[]; cut: number }> {
  const spans: Array<[number, number]> = [];
  let line = 0;
  let start = 0;
  for (let base = 0; base < buf.length; base += SCAN_CHUNK_BYTES) {
    const end = Math.min(buf.length, base + SCAN_CHUNK_BYTES);
    for (let i = base; i < end; i++) {
      if (buf[i] !== 10) continue;
      if (line >= from && line - from < count) spans.push([start, i]);
      line++;
      start = i + 1;
    }
    if (end < buf.length) await tick();
  }
  if (start < buf.length) {
    if (line >= from && line - from < count) spans.push([start, buf.length]);
    line++;
  }
  // A character is at most 4 bytes: this many decode to more than MAX_LINE_CHARS if the line is longer.
  const maxBytes = MAX_LINE_CHARS * 4 + 4;
  let cut = 0;
  const dec = Buffer.from(buf.buffer, buf.byteOffset, buf.byteLength);
  const lines = spans.map(([a, b]) => {
    const l = dec.toString('utf8', a, Math.min(b, a + maxBytes));
    if (l.length <= MAX_LINE_CHARS && b - a <= maxBytes) return l;
    cut++;
    return `${l.slice(0, MAX_LINE_CHARS)}...`;
  });
  return { total: line, lines, cut };
}


/** Non-overlapping occurrences, as String.prototype.replaceAll would replace them. */
export function countOccurrences(haystack: string, needle: string): number {
  if (needle === '') return 0;
  let n = 0;
  for (let i = haystack.indexOf(needle); i !== -1; i = haystack.indexOf(needle, i + needle.length)) n++;
  return n;
}
