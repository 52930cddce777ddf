import { describe, expect, it } from 'vitest';
import { Packr } from 'msgpackr';
import { HutchError } from '../guest-agent/src/protocol/errors.ts';
import { checkJsonShape, checkMsgpackShape, DEFAULT_SHAPE_LIMITS, GUEST_FRAME_SHAPE_LIMITS, parseJsonBounded } from '../guest-agent/src/protocol/value-shape.ts';
import { DEFAULT_MAX_FRAME_BYTES } from '../guest-agent/src/protocol/version.ts';

const packr = new Packr({ useRecords: false, moreTypes: false });

/**
 * The real depth, value count and object count (maps, arrays, binaries) of a decoded value,
 * as the checks count them (keys are values).
 */
function shape(v: unknown): { depth: number; values: number; objects: number } {
  if (Array.isArray(v)) {
    let depth = 0;
    let values = 1;
    let objects = 1;
    for (const x of v) {
      const s = shape(x);
      depth = Math.max(depth, s.depth);
      values += s.values;
      objects += s.objects;
    }
    return { depth: depth + 1, values, objects };
  }
  if (v && typeof v === 'object' && !Buffer.isBuffer(v)) {
    let depth = 0;
    let values = 1;
    let objects = 1;
    for (const [, x] of Object.entries(v)) {
      const s = shape(x);
      depth = Math.max(depth, s.depth);
      values += 1 + s.values;
      objects += s.objects;
    }
    return { depth: depth + 1, values, objects };
  }
  return { depth: 0, values: 1, objects: Buffer.isBuffer(v) ? 1 : 0 };
}

/** A deterministic pseudo-random value with every msgpack and JSON kind in it. */
function randomValue(seed: number, depth = 0): unknown {
  let x = seed;
  const next = () => (x = (x * 1103515245 + 12345) % 2147483648);
  const kind = next() % (depth > 6 ? 6 : 9);
  switch (kind) {
    case 0: return null;
    case 1: return next() % 2 === 0;
    case 2: return (next() % 2000) - 1000;
    case 3: return [0, 127, 128, 255, 256, 65535, 65536, 2 ** 32, -33, -129, -32769, 1.5, -(2 ** 40)][next() % 13];
    case 4: return ['', 'a', 'quote " and \\\\ slash \\', '"', '\\', 'é', 'x'.repeat(40), 'y'.repeat(300), 'z'.repeat(70_000), '"\\'.repeat(100) + '"', 'a"'.repeat(80) + '\\'][next() % 11];
    case 5: return next() % 2 === 0 ? JSON.stringify({ nested: 'text[{' }) : Buffer.alloc(next() % 300, 7);
    case 6: return Array.from({ length: next() % 20 }, (_, i) => randomValue(next() + i, depth + 1));
    case 7: return Object.fromEntries(Array.from({ length: next() % 20 }, (_, i) => [`k${i}"\\`, randomValue(next() + i, depth + 1)]));
    default: return [];
  }
}

function verdict(f: () => void): string {
  try {
    f();
    return 'ok';
  } catch (err) {
    if (!(err instanceof HutchError)) throw err;
    return err.code;
  }
}

describe('value shape checks (decoding a tenant message on the broker loop is bounded)', () => {
  it('count what the decoders would build, exactly, in msgpack and JSON', () => {
    for (let seed = 1; seed <= 300; seed++) {
      const v = randomValue(seed);
      const { depth, values } = shape(v);
      const bin = packr.pack(v);
      const json = JSON.stringify(v, (_k, x: unknown) => (x && typeof x === 'object' && (x as { type?: string }).type === 'Buffer' ? 'bytes' : x));
      for (const [d, n, want] of [
        [depth, values, 'ok'],
        [Math.max(depth - 1, 0), values, depth > 0 ? 'bad_request' : 'ok'],
        [depth, values - 1, 'too_large'],
      ] as const) {
        const limits = { maxDepth: d, maxValues: n };
        expect(verdict(() => checkMsgpackShape(bin, limits)), `msgpack seed ${seed} ${JSON.stringify(limits)}`).toBe(want);
        expect(verdict(() => checkJsonShape(json, limits)), `json seed ${seed} ${JSON.stringify(limits)}`).toBe(want);
      }
      const { objects } = shape(v);
      expect(verdict(() => checkMsgpackShape(bin, { maxDepth: depth, maxValues: values, maxObjects: objects }))).toBe('ok');
      if (objects > 0) expect(verdict(() => checkMsgpackShape(bin, { maxDepth: depth, maxValues: values, maxObjects: objects - 1 }))).toBe('too_large');
    }
  });

  it("the limits for a guest's frames pass the agent's densest 1 MiB answers and refuse the costliest content", () => {
    const fill = (make: (i: number) => unknown, wrap: (items: unknown[]) => unknown): Buffer => {
      // As many items as a 1 MiB frame holds (the agent's limit on what it sends).
      let lo = 1;
      let hi = 200_000;
      while (lo < hi) {
        const mid = Math.ceil((lo + hi) / 2);
        if (packr.pack(wrap(Array.from({ length: mid }, (_, i) => make(i)))).length <= DEFAULT_MAX_FRAME_BYTES - 64) lo = mid;
        else hi = mid - 1;
      }
      return packr.pack(wrap(Array.from({ length: lo }, (_, i) => make(i))));
    };
    const res = (r: unknown) => ({ t: 'res', id: 1, ep: 1, r });
    const answers = {
      list: fill((i) => ({ path: i.toString(36), type: 'file' }), (entries) => res({ path: '.', entries, truncated: true })),
      glob: fill((i) => i.toString(36), (files) => res({ files, truncated: true })),
      grep: fill((i) => ({ path: 'a', line: i, text: '' }), (matches) => res({ matches, truncated: true, filesSearched: 1 })),
      syncRecord: fill((i) => ({ path: i.toString(36), kind: 'file', mode: 0o644, size: 1, mtimeMs: 1.5, data: Buffer.from([i & 255]) }), (changes) => ({ changes, skipped: [] })),
    };
    for (const [name, buf] of Object.entries(answers)) expect(verdict(() => checkMsgpackShape(buf, GUEST_FRAME_SHAPE_LIMITS)), name).toBe('ok');
    const array = (item: number[]) => {
      const n = Math.floor((DEFAULT_MAX_FRAME_BYTES - 64) / item.length);
      const b = Buffer.alloc(5 + n * item.length);
      b[0] = 0xdd;
      b.writeUInt32BE(n, 1);
      for (let i = 0; i < n; i++) b.set(item, 5 + i * item.length);
      return b;
    };
    for (const item of [[0x80], [0x90], [0xc4, 0x01, 0x00], [0xd6, 0xff, 0, 0, 0, 1], [0x81, 0xa0, 0x00]]) {
      expect(verdict(() => checkMsgpackShape(array(item), GUEST_FRAME_SHAPE_LIMITS)), item.join(',')).toBe('too_large');
    }
  });

  it('refuse the frames that held the loop for seconds, and pass large content', () => {
    const deepJson = '['.repeat(1_000_000) + ']'.repeat(1_000_000);
    expect(() => parseJsonBounded(deepJson)).toThrow(/nests deeper than 64/);
    const zeros = Buffer.alloc(5 + 4_000_000);
    zeros[0] = 0xdd;
    zeros.writeUInt32BE(4_000_000, 1);
    expect(() => checkMsgpackShape(zeros)).toThrow(/more than 200000 values/);
    const emptyMaps = Buffer.alloc(5 + 4_000_000, 0x80);
    emptyMaps[0] = 0xdd;
    emptyMaps.writeUInt32BE(4_000_000, 1);
    expect(() => checkMsgpackShape(emptyMaps)).toThrow(HutchError);
    expect(() => checkJsonShape('{"args":[' + '0,'.repeat(DEFAULT_SHAPE_LIMITS.maxValues) + '0]}')).toThrow(/values/);
    // A 32 MiB file in a write: one value, whatever its bytes hold.
    const content = Buffer.alloc(32 * 1024 * 1024, 0x5b);
    expect(() => checkMsgpackShape(packr.pack({ t: 'req', id: 1, op: 'call', p: { tool: 'write', args: { path: 'a', content } } }))).not.toThrow();
    const text = '[{"\\\\'.repeat(4 * 1024 * 1024);
    expect(parseJsonBounded(JSON.stringify({ t: 'req', id: 1, p: { content: text } }))).toMatchObject({ p: { content: text } });
  });
});
