import { describe, expect, it } from 'vitest';
import { closeSync, mkdtempSync, openSync, readdirSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { walk } from '../guest-agent/src/workspace/walk.ts';
import { readDirAt } from '../guest-agent/src/workspace/fd-path.ts';
import { scanTree } from '../host-broker/src/sync/manifest.ts';
import { measureWorkspace } from '../host-broker/src/sessions/workspace-quota.ts';

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

  // A directory this wide is listed in batches and sorted in runs merged as the walk goes,
  // so that the broker's loop is never held for the whole of it (bench/loop-gaps.ts).
  it('a directory of 20,000 entries: every entry once, in byte order, with its type, through every walker', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'hutch-walkwide-'));
    try {
      const names: Buffer[] = [];
      for (let i = 0; i < 20_000; i++) {
        // Scrambled order, some high bytes, names of different lengths.
        const n = Buffer.from(`${((i * 7919) % 20_000).toString(36)}${i % 7 === 0 ? '-' : ''}`);
        names.push(i % 11 === 0 ? Buffer.concat([n, Buffer.from([0xe9])]) : n);
      }
      for (const n of names) closeSync(openSync(Buffer.concat([Buffer.from(`${dir}/`), n]), 'w'));
      writeFileSync(join(dir, 'zz-not-empty'), 'abc');
      names.push(Buffer.from('zz-not-empty'));
      // Larger than one readdir in one go (st_size above 256 KiB on ext4 and tmpfs alike).
      expect(statSync(dir).size).toBeGreaterThan(256 * 1024);
      const fd = openSync(dir, 'r');
      try {
        const listed = await readDirAt(fd);
        expect(listed.length).toBe(names.length);
        expect(new Set(listed.map((d) => d.name.toString('hex')))).toEqual(new Set(readdirSync(dir, { encoding: 'buffer' }).map((n) => n.toString('hex'))));
        expect(listed.every((d) => d.type === 'file')).toBe(true);
      } finally {
        closeSync(fd);
      }
      const expected = [...names].sort(Buffer.compare).map((n) => n.toString('hex'));
      const seen: string[] = [];
      let ticks = 0;
      for await (const e of walk(dir, { maxPathBytes: Infinity, tick: async () => void ticks++ })) seen.push(e.name.toString('hex'));
      expect(seen).toEqual(expected);
      expect(ticks).toBeGreaterThanOrEqual(names.length);
      expect((await scanTree(dir)).size).toBe(names.length);
      expect((await measureWorkspace(dir)).files).toBe(names.length);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  }, 120_000);
});
