/** Text helpers shared by read, grep and edit. */
import { AnswerCap, textBytes } from './answer-bounds.ts';

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

/**
 * Bytes scanned for newlines between two chances to yield. Small enough for the scan's
 * first, unoptimised run: V8 interprets the loop at ~100 ns a byte until it has compiled
 * it, so a first megabyte held the loop 100-180 ms (7 ms once compiled).
 */
const SCAN_CHUNK_BYTES = 64 * 1024;

export interface LineWindowOptions {
  /**
   * Bytes the window's lines may take, joined by '\n' with their prefixes: lines stop at the
   * first that would pass it (`full`), though the first always comes.
   */
  maxBytes?: number;
  /** Text put before each line, given its 0-based index in the file (read's `00012| `). */
  prefix?: (line: number) => string;
}

export interface LineWindow {
  /** Lines in the file. */
  total: number;
  /** The window's lines, decoded and prefixed. */
  lines: string[];
  /** How many of them were longer than MAX_LINE_CHARS and cut. */
  cut: number;
  /** The byte limit stopped the window before `count` lines or the end of the file. */
  full: boolean;
}

/**
 * The lines `from` .. `from + count - 1` of a text buffer, decoded (each cut at
 * MAX_LINE_CHARS, with `cut` telling how many were) as far as `maxBytes` allows, and how many
 * lines it has: the text split at '\n', a final newline ending the last line rather than
 * starting an empty one ('\n' is never part of a UTF-8 multibyte sequence, so the bytes
 * split where the text does). Works on the bytes: splitting a 64 MiB file of short lines into
 * strings held the loop for 760 ms and took 450 MB; this decodes each line of the window as
 * the scan passes it, none once the window is full, and calls `tick` every 64 KiB (a
 * LoopSlicer's, to let others run). So what it holds is the answer, never the file's lines:
 * 40 million empty lines asked for whole made 40 million spans and strings (4 GiB of heap).
 */
export async function lineWindow(buf: Uint8Array, from: number, count: number, tick: () => Promise<void>, opts: LineWindowOptions = {}): Promise<LineWindow> {
  const dec = Buffer.from(buf.buffer, buf.byteOffset, buf.byteLength);
  // A character is at most 4 bytes: this many decode to more than MAX_LINE_CHARS if the line is longer.
  const maxLineBytes = MAX_LINE_CHARS * 4 + 4;
  const answer = new AnswerCap(count, opts.maxBytes ?? Infinity);
  const lines: string[] = [];
  let cut = 0;
  const take = (a: number, b: number, index: number) => {
    let l = dec.toString('utf8', a, Math.min(b, a + maxLineBytes));
    const long = l.length > MAX_LINE_CHARS || b - a > maxLineBytes;
    if (long) l = `${l.slice(0, MAX_LINE_CHARS)}...`;
    const text = opts.prefix ? opts.prefix(index) + l : l;
    // Each line after the first adds its '\n' (textBytes counts one per line).
    if (!answer.take(textBytes(text) - (lines.length === 0 ? 1 : 0))) return;
    lines.push(text);
    if (long) cut++;
  };
  let line = 0;
  let start = 0;
  for (let base = 0; base < buf.length; base += SCAN_CHUNK_BYTES) {
    const end = Math.min(buf.length, base + SCAN_CHUNK_BYTES);
    for (let i = base; i < end; i++) {
      if (buf[i] !== 10) continue;
      if (line >= from && line - from < count && !answer.full) take(start, i, line);
      line++;
      start = i + 1;
    }
    if (end < buf.length) await tick();
  }
  if (start < buf.length) {
    if (line >= from && line - from < count && !answer.full) take(start, buf.length, line);
    line++;
  }
  return { total: line, lines, cut, full: answer.full };
}


/** Bytes scanned at a time: the loop gets a turn between windows. */
const SCAN_WINDOW = 1024 * 1024;

/**
 * The first occurrence of `needle` in `buf` (-1 if none), window by window, ticking between
 * windows. A UTF-8 needle matches whole characters only.
 */
export async function firstOccurrence(buf: Buffer, needle: Buffer, tick: () => Promise<void>): Promise<number> {
  if (needle.length === 0) return -1;
  for (let pos = 0; pos <= buf.length - needle.length; ) {
    const end = Math.min(buf.length, pos + SCAN_WINDOW + needle.length - 1);
    const i = buf.subarray(pos, end).indexOf(needle);
    if (i >= 0) return pos + i;
    pos = end - needle.length + 1;
    await tick();
  }
  return -1;
}

/**
 * Counts the non-overlapping occurrences of `from` in `buf`, left to right (as
 * String.prototype.replaceAll would replace them), and with `to` also builds `buf` with all
 * of them replaced. Window by window, ticking between windows: an edit of a 60 MB file held
 * the broker's loop 300 ms (decoding it whole, replacing, encoding it again), and 900 ms
 * with ten million matches. Each window is a latin1 string (one character per byte), so the
 * native split and join work on the exact bytes, and bytes that are not UTF-8 are kept.
 */
export async function splitOccurrences(buf: Buffer, from: Buffer, to: Buffer | undefined, tick: () => Promise<void>): Promise<{ count: number; out?: Buffer }> {
  if (from.length === 0) return { count: 0 };
  const needle = from.toString('latin1');
  const repl = to?.toString('latin1');
  const out: Buffer[] = [];
  let count = 0;
  // The end of a window may begin an occurrence the next one completes: carried over.
  let carry = '';
  for (let pos = 0; pos < buf.length; pos += SCAN_WINDOW) {
    const last = pos + SCAN_WINDOW >= buf.length;
    const parts = (carry + buf.toString('latin1', pos, Math.min(buf.length, pos + SCAN_WINDOW))).split(needle);
    count += parts.length - 1;
    const tail = parts.pop() as string;
    const cut = last ? tail.length : Math.max(0, tail.length - (needle.length - 1));
    carry = tail.slice(cut);
    if (repl !== undefined) {
      parts.push(tail.slice(0, cut));
      out.push(Buffer.from(parts.join(repl), 'latin1'));
    }
    await tick();
  }
  return repl === undefined ? { count } : { count, out: Buffer.concat(out) };
}
