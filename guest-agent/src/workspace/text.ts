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
export function splitLines(text: string): string[] {
  if (text === '') return [];
  const lines = text.split('\n');
  if (lines[lines.length - 1] === '') lines.pop();
  return lines;
}

/** Non-overlapping occurrences, as String.prototype.replaceAll would replace them. */
export function countOccurrences(haystack: string, needle: string): number {
  if (needle === '') return 0;
  let n = 0;
  for (let i = haystack.indexOf(needle); i !== -1; i = haystack.indexOf(needle, i + needle.length)) n++;
  return n;
}
