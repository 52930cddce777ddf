import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { mkdirSync, utimesSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { ANSWER_MAX_BYTES } from '../../guest-agent/src/workspace/answer-bounds.ts';
import type { Hutch, Sandbox } from '../../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/**
 * Issue 38, item 1: one `read` of a file of 40 million empty lines with `limit: 2**31`
 * built a 469 MB answer in the broker (its heap from 264 MiB to 4.1 GiB, /healthz held
 * 27.6 s for every tenant). Every file tool's answer is now cut at a number of lines or
 * entries and at ANSWER_MAX_BYTES of text, says so, and says where to go on.
 */

/** Three directories of 240-byte names: what lies in them has a path of some 1,000 bytes. */
const LONG_DIRS = ['a', 'b', 'c'].map((c) => c.repeat(240)).join('/');

/** Bytes of text an answer carries, counted as the tools count it: one line per path or match. */
const textBytes = (s: string) => Buffer.byteLength(s) + 1;

describe('a file tool answer is bounded in bytes as well as lines or entries', () => {
  let b: TestBroker;
  let hutch: Hutch;
  let sb: Sandbox;
  let ws: string;
  beforeAll(async () => {
    b = await startBroker();
    hutch = await b.connect();
    sb = await hutch.create({});
    ws = join(b.dataDir, 'sessions', sb.id, 'workspace');
  }, 120_000);
  afterAll(async () => b?.stop());

  it('a read of two million empty lines asked whole answers at most the byte cap, and its nextOffset goes on where it stopped', async () => {
    writeFileSync(join(ws, 'lines.txt'), Buffer.alloc(2_000_000, 10));
    const r = await sb.files.read('lines.txt', { limit: 2 ** 31 });
    expect(r.totalLines).toBe(2_000_000);
    expect(Buffer.byteLength(r.content)).toBeLessThanOrEqual(ANSWER_MAX_BYTES);
    expect(r.lines).toBeGreaterThan(0);
    expect([r.hasMore, r.truncated, r.nextOffset]).toEqual([true, true, r.lines]);
    // `00001| `: an empty line numbered from 1; the last one answered is line `lines`.
    expect(r.content.split('\n').at(-1)).toBe(`${String(r.lines).padStart(5, '0')}| `);
    const next = await sb.files.read('lines.txt', { offset: r.nextOffset as number, limit: 2 ** 31 });
    expect(next.content.split('\n')[0]).toBe(`${String(r.lines + 1).padStart(5, '0')}| `);
    expect(next.offset).toBe(r.lines);
  }, 60_000);

  it('a read within the caps answers whole, says nothing is cut, and a limit still stops it', async () => {
    writeFileSync(join(ws, 'small.txt'), 'one\ntwo\nthree\n');
    const r = await sb.files.read('small.txt');
    expect([r.content, r.hasMore, r.truncated, r.nextOffset]).toEqual(['00001| one\n00002| two\n00003| three', false, false, undefined]);
    const two = await sb.files.read('small.txt', { limit: 2 });
    expect([two.lines, two.hasMore, two.truncated, two.nextOffset]).toEqual([2, true, false, 2]);
  });

  it('a read of long lines stops at the byte cap', async () => {
    writeFileSync(join(ws, 'long.txt'), `${'x'.repeat(1999)}\n`.repeat(200));
    const r = await sb.files.read('long.txt');
    expect(Buffer.byteLength(r.content)).toBeLessThanOrEqual(ANSWER_MAX_BYTES);
    expect(r.lines).toBeLessThan(200);
    expect([r.hasMore, r.truncated, r.nextOffset]).toEqual([true, true, r.lines]);
  });

  it('a list of long names stops at the byte cap, and its nextOffset lists the rest in the same order', async () => {
    // 120 paths of 1,000 bytes (a name is at most 255): 100 of them (the entry limit) are twice the byte cap.
    const dir = join(ws, 'names', LONG_DIRS);
    mkdirSync(dir, { recursive: true });
    const names = Array.from({ length: 120 }, (_, i) => `${String(i).padStart(3, '0')}${'n'.repeat(230)}`);
    for (const n of names) writeFileSync(join(dir, n), '');
    const levels = LONG_DIRS.split('/');
    const expected = [...levels.map((_, i) => levels.slice(0, i + 1).join('/')), ...names.map((n) => `${LONG_DIRS}/${n}`)];
    const first = await sb.files.list('names');
    expect(first.entries.reduce((t, e) => t + textBytes(e.path), 0)).toBeLessThanOrEqual(ANSWER_MAX_BYTES);
    expect(first.truncated).toBe(true);
    expect(first.nextOffset).toBe(first.entries.length);
    const seen = [...first.entries.map((e) => e.path)];
    for (let offset = first.nextOffset; offset !== undefined; ) {
      const page = await sb.files.list('names', { offset });
      seen.push(...page.entries.map((e) => e.path));
      offset = page.nextOffset;
    }
    expect(seen).toEqual(expected);
  });

  it('a glob of long names answers the newest first, at most the byte cap', async () => {
    const dir = join(ws, 'globbed', LONG_DIRS);
    mkdirSync(dir, { recursive: true });
    for (let i = 0; i < 120; i++) {
      const p = join(dir, `${String(i).padStart(3, '0')}${'g'.repeat(230)}.txt`);
      writeFileSync(p, '');
      utimesSync(p, 1_000_000 + i, 1_000_000 + i);
    }
    const r = await sb.files.glob('globbed/**/*.txt');
    expect(r.files.reduce((t, f) => t + textBytes(f), 0)).toBeLessThanOrEqual(ANSWER_MAX_BYTES);
    expect(r.files.length).toBeGreaterThan(0);
    expect(r.truncated).toBe(true);
    const prefix = `globbed/${LONG_DIRS}/`;
    expect(r.files.map((f) => f.slice(prefix.length, prefix.length + 3))).toEqual(r.files.map((_, i) => String(119 - i).padStart(3, '0')));
  });

  it('a grep of long matching lines answers the newest file first, at most the byte cap, and counts what it left out', async () => {
    const dir = join(ws, 'grepped');
    mkdirSync(dir);
    for (let i = 0; i < 30; i++) {
      const p = join(dir, `f${String(i).padStart(2, '0')}.txt`);
      writeFileSync(p, `needle ${'y'.repeat(1990)}\n`.repeat(10));
      utimesSync(p, 2_000_000 + i, 2_000_000 + i);
    }
    const r = await sb.files.grep('needle', { path: 'grepped' });
    const bytes = r.matches.reduce((t, m) => t + textBytes(m.path) + textBytes(m.text) + 8, 0);
    expect(bytes).toBeLessThanOrEqual(ANSWER_MAX_BYTES);
    expect(r.matches.length).toBeGreaterThan(0);
    expect(r.truncated).toBe(true);
    expect(r.filesSearched).toBe(30);
    // Newest file first, its lines in order.
    expect(r.matches[0]).toMatchObject({ path: 'grepped/f29.txt', line: 1 });
    expect(r.matches.slice(0, 10).map((m) => m.line)).toEqual([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
  });

  it('a grep over many files with many matches answers the newest ones, however the files were batched', async () => {
    const dir = join(ws, 'many');
    mkdirSync(dir);
    // 5,000 files: more than one batch of the search (4,096 files), each with 20 matches.
    for (let i = 0; i < 5000; i++) {
      const p = join(dir, `m${String(i).padStart(4, '0')}.txt`);
      writeFileSync(p, 'hit\n'.repeat(20));
      utimesSync(p, 3_000_000 + (i % 4999 === 0 ? 10_000 + i : i), 3_000_000 + (i % 4999 === 0 ? 10_000 + i : i));
    }
    const r = await sb.files.grep('hit', { path: 'many' });
    expect(r.matches.length).toBe(100);
    expect(r.truncated).toBe(true);
    expect(r.filesSearched).toBe(5000);
    // m4999 and m0000 were touched last; then m4998, m4997, ... (each 20 lines).
    const files = [...new Set(r.matches.map((m) => m.path))];
    expect(files).toEqual(['many/m4999.txt', 'many/m0000.txt', 'many/m4998.txt', 'many/m4997.txt', 'many/m4996.txt']);
  }, 120_000);
});
