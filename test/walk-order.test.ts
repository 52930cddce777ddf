import { describe, expect, it } from 'vitest';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { walk } from '../guest-agent/src/workspace/walk.ts';

describe('walk order', () => {
  it('lists a directory in byte order of its names (sorted as latin1 keys, the same as Buffer.compare)', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'hutch-walkorder-'));
    try {
      const names = ['b', 'a', 'ab', 'a.b', 'A', 'Z', '_', '~', 'é', 'ñ', '日本', 'a b', '0', '10', '9'].map((n) => Buffer.from(n));
      names.push(Buffer.from([0x61, 0xff]), Buffer.from([0x80]), Buffer.from([0xfe, 0x41]), Buffer.from([0x7f]));
      for (const n of names) writeFileSync(Buffer.concat([Buffer.from(`${dir}/`), n]), '');
      const seen: string[] = [];
      for await (const e of walk(dir)) seen.push(e.name.toString('hex'));
      expect(seen).toEqual([...names].sort(Buffer.compare).map((n) => n.toString('hex')));
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
