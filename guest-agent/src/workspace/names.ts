/**
 * The longest workspace-relative path hutch addresses, in bytes: a tool's path, a sync
 * path, what a walk lists. A tenant can make deeper trees (through relative names); they
 * are walked for the quota but never listed, carried or named.
 */
export const WORKSPACE_PATH_MAX_BYTES = 4096;

/**
 * File names are bytes on Linux; tenant-facing paths are strings. The mapping between
 * the two is PEP 383's "surrogateescape" (what Python does for os.fsdecode): valid UTF-8
 * decodes as usual, and each byte that is not part of a valid UTF-8 sequence becomes the
 * lone surrogate U+DC80 + (byte - 0x80). Every byte string round-trips, ordinary names
 * look ordinary, and JSON carries the odd ones as "\udcXX" escapes.
 *
 * The agent protocol (msgpack) carries raw names as bytes: msgpack strings are UTF-8 and
 * would replace a lone surrogate.
 */

const decoder = new TextDecoder('utf-8', { fatal: true });

/** Raw name bytes -> string (surrogateescape). */
export function nameFromBytes(b: Uint8Array): string {
  try {
    return decoder.decode(b);
  } catch {
    return decodeSlow(b);
  }
}

/** String (possibly holding escaped bytes) -> the raw name bytes. */
export function nameToBytes(s: string): Buffer {
  if (!hasLoneSurrogate(s)) return Buffer.from(s, 'utf8');
  const parts: Buffer[] = [];
  let run = '';
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    if (c >= 0xdc80 && c <= 0xdcff && !(i > 0 && isHigh(s.charCodeAt(i - 1)))) {
      if (run) parts.push(Buffer.from(run, 'utf8'));
      run = '';
      parts.push(Buffer.from([c - 0xdc00]));
    } else run += s[i];
  }
  if (run) parts.push(Buffer.from(run, 'utf8'));
  return Buffer.concat(parts);
}

/** True when the string holds an escaped (non-UTF-8) byte. */
export function hasEscapedBytes(s: string): boolean {
  return hasLoneSurrogate(s);
}

function isHigh(c: number): boolean {
  return c >= 0xd800 && c <= 0xdbff;
}

function hasLoneSurrogate(s: string): boolean {
  // String.prototype.isWellFormed is Node 20+; the guest runs Node 18, so check by hand.
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    if (c < 0xd800 || c > 0xdfff) continue;
    if (isHigh(c) && i + 1 < s.length) {
      const d = s.charCodeAt(i + 1);
      if (d >= 0xdc00 && d <= 0xdfff) {
        i++;
        continue;
      }
    }
    return true;
  }
  return false;
}

function decodeSlow(b: Uint8Array): string {
  let out = '';
  let i = 0;
  while (i < b.length) {
    const n = validSequenceLength(b, i);
    if (n > 0) {
      out += Buffer.from(b.subarray(i, i + n)).toString('utf8');
      i += n;
    } else {
      out += String.fromCharCode(0xdc00 + (b[i] as number));
      i++;
    }
  }
  return out;
}

/** Length of the valid UTF-8 sequence starting at i, or 0 (bytes < 0x80 are escaped never). */
function validSequenceLength(b: Uint8Array, i: number): number {
  const c = b[i] as number;
  if (c < 0x80) return 1;
  const cont = (k: number, lo = 0x80, hi = 0xbf) => i + k < b.length && (b[i + k] as number) >= lo && (b[i + k] as number) <= hi;
  if (c >= 0xc2 && c <= 0xdf) return cont(1) ? 2 : 0;
  if (c === 0xe0) return cont(1, 0xa0) && cont(2) ? 3 : 0;
  if ((c >= 0xe1 && c <= 0xec) || c === 0xee || c === 0xef) return cont(1) && cont(2) ? 3 : 0;
  if (c === 0xed) return cont(1, 0x80, 0x9f) && cont(2) ? 3 : 0; // no encoded surrogates
  if (c === 0xf0) return cont(1, 0x90) && cont(2) && cont(3) ? 4 : 0;
  if (c >= 0xf1 && c <= 0xf3) return cont(1) && cont(2) && cont(3) ? 4 : 0;
  if (c === 0xf4) return cont(1, 0x80, 0x8f) && cont(2) && cont(3) ? 4 : 0;
  return 0;
}
