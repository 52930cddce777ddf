import { HutchError } from './errors.ts';

/**
 * How much structure one request may carry before it is decoded. Decoding runs on the
 * broker's event loop and builds every value of a message at once: one 64 MiB WebSocket
 * frame of nested `[[[[...]]]]` held the loop for 17 s in JSON.parse, one of 64 million
 * empty msgpack maps for 11 s and gigabytes of heap, every session waiting. The size limit
 * of a frame bounds its bytes, not this. A check here walks the encoded bytes once, never
 * recursing, and stops at the first limit passed: strings and binaries are skipped by
 * their length (msgpack) or found by a native search (JSON), so a large file's content
 * costs next to nothing.
 */
export interface ShapeLimits {
  /** Containers (arrays, maps/objects) inside one another. */
  maxDepth: number;
  /** Values in all, containers and keys included. */
  maxValues: number;
  /**
   * msgpack only: values the decoder builds an object for (maps, arrays, binaries,
   * extensions), the costly ones: 180-350 ns each against ~20 for a number or a short
   * string. Unset: no limit beyond maxValues.
   */
  maxObjects?: number;
}

/**
 * Requests are a few dozen values (a call and its arguments); a multi-file write carries
 * two per file. 64 levels is far beyond any request a harness sends.
 */
export const DEFAULT_SHAPE_LIMITS: ShapeLimits = { maxDepth: 64, maxValues: 200_000 };

/**
 * What the broker decodes from a guest's agent (its frames, its sync records; 1 MiB each).
 * A guest that is no longer ours picks the costliest content: a frame of empty maps took
 * ~180 ms to decode, one of one-byte binaries ~100 ms. Within these a frame costs ~70 ms
 * at most (bench/guest-flood.ts). The agent's largest answers stay well inside them:
 * 1 MiB of listed paths or grep matches is under 60,000 entries (one map each, about
 * 290,000-370,000 values), a sync record of small files two objects per file.
 */
export const GUEST_FRAME_SHAPE_LIMITS: ShapeLimits = { maxDepth: 64, maxValues: 600_000, maxObjects: 128_000 };

function tooDeep(limits: ShapeLimits): HutchError {
  return new HutchError('bad_request', `the message nests deeper than ${limits.maxDepth} levels`, { limit: limits.maxDepth });
}

function tooManyObjects(limits: ShapeLimits): HutchError {
  return new HutchError('too_large', `the message has more than ${limits.maxObjects} maps, arrays, binaries and extensions`, { limit: limits.maxObjects });
}

function tooMany(limits: ShapeLimits): HutchError {
  return new HutchError('too_large', `the message has more than ${limits.maxValues} values (send large data as file content or an upload stream)`, { limit: limits.maxValues });
}

/**
 * Checks the msgpack values in `buf` against `limits` without decoding them. A truncated or
 * malformed buffer is left to the decoder to reject; this only refuses what would cost too
 * much to decode.
 */
export function checkMsgpackShape(buf: Uint8Array, limits: ShapeLimits = DEFAULT_SHAPE_LIMITS): void {
  // Values still expected in each open container, innermost last.
  const open: number[] = [];
  let values = 0;
  let objects = 0;
  const maxObjects = limits.maxObjects ?? Infinity;
  let p = 0;
  const n = buf.length;
  const u16 = (at: number) => ((buf[at] as number) << 8) | (buf[at + 1] as number);
  const u32 = (at: number) => ((buf[at] as number) * 0x1000000) + (((buf[at + 1] as number) << 16) | ((buf[at + 2] as number) << 8) | (buf[at + 3] as number));
  while (p < n) {
    if (++values > limits.maxValues) throw tooMany(limits);
    const b = buf[p] as number;
    let items = -1; // >= 0: a container of this many values starts here
    if (b <= 0x7f || b >= 0xe0 || b === 0xc0 || b === 0xc2 || b === 0xc3) p += 1;
    else if (b <= 0x8f) (items = (b & 0x0f) * 2), (p += 1);
    else if (b <= 0x9f) (items = b & 0x0f), (p += 1);
    else if (b <= 0xbf) p += 1 + (b & 0x1f);
    else
      switch (b) {
        case 0xc4: case 0xd9: p += 2 + (buf[p + 1] ?? 0); break; // bin8, str8
        case 0xc5: case 0xda: p += 3 + u16(p + 1); break; // bin16, str16
        case 0xc6: case 0xdb: p += 5 + u32(p + 1); break; // bin32, str32
        case 0xc7: p += 3 + (buf[p + 1] ?? 0); break; // ext8
        case 0xc8: p += 4 + u16(p + 1); break; // ext16
        case 0xc9: p += 6 + u32(p + 1); break; // ext32
        case 0xcc: case 0xd0: p += 2; break;
        case 0xcd: case 0xd1: p += 3; break;
        case 0xca: case 0xce: case 0xd2: p += 5; break;
        case 0xcb: case 0xcf: case 0xd3: p += 9; break;
        case 0xd4: p += 3; break;
        case 0xd5: p += 4; break;
        case 0xd6: p += 6; break;
        case 0xd7: p += 10; break;
        case 0xd8: p += 18; break;
        case 0xdc: (items = u16(p + 1)), (p += 3); break;
        case 0xdd: (items = u32(p + 1)), (p += 5); break;
        case 0xde: (items = u16(p + 1) * 2), (p += 3); break;
        case 0xdf: (items = u32(p + 1) * 2), (p += 5); break;
        default: return; // 0xc1 is never used: the decoder says what is wrong
      }
    // Containers, bin8-32 and ext8-32 (0xc4-0xc9), fixext1-16 (0xd4-0xd8).
    if (items >= 0 || (b >= 0xc4 && b <= 0xc9) || (b >= 0xd4 && b <= 0xd8)) {
      if (++objects > maxObjects) throw tooManyObjects(limits);
    }
    // This value fills one slot of its container; full containers close.
    let top = open.length - 1;
    if (top >= 0) {
      open[top] = (open[top] as number) - 1;
    }
    if (items >= 0 && open.length >= limits.maxDepth) throw tooDeep(limits);
    if (items > 0) {
      open.push(items);
      continue;
    }
    while (top >= 0 && open[top] === 0) {
      open.pop();
      top--;
    }
  }
}

/**
 * Checks JSON text against `limits` without parsing it (see checkMsgpackShape). Values are
 * counted as there: each string (keys too), number, literal and container.
 */
export function checkJsonShape(text: string, limits: ShapeLimits = DEFAULT_SHAPE_LIMITS): void {
  let depth = 0;
  let values = 0;
  let inScalar = false;
  const n = text.length;
  for (let i = 0; i < n; i++) {
    const c = text.charCodeAt(i);
    if (c <= 0x20 || c === 0x2c || c === 0x3a) {
      inScalar = false;
      continue;
    }
    if (c === 0x22) {
      inScalar = false;
      if (++values > limits.maxValues) throw tooMany(limits);
      const end = stringEnd(text, i + 1);
      if (end === -1) return; // unterminated: the parser says so
      i = end;
    } else if (c === 0x5b || c === 0x7b) {
      inScalar = false;
      if (++values > limits.maxValues) throw tooMany(limits);
      if (++depth > limits.maxDepth) throw tooDeep(limits);
    } else if (c === 0x5d || c === 0x7d) {
      inScalar = false;
      depth--;
    } else if (!inScalar) {
      if (++values > limits.maxValues) throw tooMany(limits);
      inScalar = true;
    }
  }
}

/**
 * The index of the quote that ends the JSON string whose body starts at `from`, or -1. A
 * native search for the next quote skips plain text at memory speed; a string dense with
 * escaped quotes (`\"\"\"...`) would cost a search per quote, so past a few of them
 * the rest is read a character at a time.
 */
function stringEnd(text: string, from: number): number {
  let j = text.indexOf('"', from);
  for (let escaped = 0; escaped < 64; escaped++) {
    if (j === -1) return -1;
    let b = j - 1;
    while (text.charCodeAt(b) === 0x5c) b--;
    if ((j - 1 - b) % 2 === 0) return j;
    j = text.indexOf('"', j + 1);
  }
  if (j === -1) return -1;
  // From the start again, escapes read in order (the part already searched is read twice at most).
  for (let k = from; k < text.length; k++) {
    const c = text.charCodeAt(k);
    if (c === 0x5c) k++;
    else if (c === 0x22) return k;
  }
  return -1;
}

/** JSON.parse of a message whose shape is checked first. */
export function parseJsonBounded(text: string, limits: ShapeLimits = DEFAULT_SHAPE_LIMITS): unknown {
  checkJsonShape(text, limits);
  return JSON.parse(text);
}
