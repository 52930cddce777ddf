import { describe, expect, it } from 'vitest';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { lineWindow, MAX_LINE_CHARS } from '../guest-agent/src/workspace/text.ts';
import { FileTools } from '../guest-agent/src/workspace/file-tools.ts';
import { Workspace } from '../guest-agent/src/workspace/confine.ts';

/**
 * The read tool's lines come from the bytes (text.ts lineWindow) instead of splitting the
 * whole decoded file: a 64 MiB file of short lines held the broker's event loop for 760 ms
 * per read (every tenant waiting) and took 450 MB. The lines must be exactly what splitting
 * the text gave: this is that, as the reference.
 */
function reference(text: string, from: number, count: number): { total: number; lines: string[]; cut: number; full: boolean } {
  const all = text === '' ? [] : text.split('\n');
  if (all.length > 0 && all[all.length - 1] === '') all.pop();
  let cut = 0;
  const lines = all.slice(from, from + count).map((l) => {
    if (l.length <= MAX_LINE_CHARS) return l;
    cut++;
    return `${l.slice(0, MAX_LINE_CHARS)}...`;
  });
  return { total: all.length, lines, cut, full: false };
}

const noTick = async () => undefined;

describe('lineWindow', () => {
  const cases: Array<[string, Buffer]> = [
    ['empty', Buffer.alloc(0)],
    ['one line, no newline', Buffer.from('abc')],
    ['one newline', Buffer.from('\n')],
    ['trailing newline', Buffer.from('a\nb\n')],
    ['blank lines', Buffer.from('\n\na\n\n\nb')],
    ['multibyte', Buffer.from('héllo\nwörld ✓\n日本語\n')],
    ['invalid UTF-8 and a sequence cut by a newline', Buffer.from([0x61, 0xe2, 0x9c, 0x0a, 0xff, 0x62, 0x0a, 0xf0, 0x9f])],
    ['long ASCII line', Buffer.from(`${'x'.repeat(MAX_LINE_CHARS)}\n${'y'.repeat(MAX_LINE_CHARS + 1)}\nz`)],
    ['long multibyte line', Buffer.from(`${'é'.repeat(MAX_LINE_CHARS + 5)}\n${'✓'.repeat(MAX_LINE_CHARS)}\n${'😀'.repeat(MAX_LINE_CHARS)}\n`)],
    ['line of exactly the byte window', Buffer.from(`${'é'.repeat(MAX_LINE_CHARS * 2 + 2)}\n`)],
    ['many lines across scan chunks', Buffer.from(Array.from({ length: 300_000 }, (_, i) => `line ${i} ${'ab'.repeat(i % 7)}`).join('\n'))],
  ];
  for (const [name, buf] of cases) {
    it(`${name}: the same lines, count and cuts as splitting the text`, async () => {
      const text = buf.toString('utf8');
      for (const [from, count] of [[0, 2000], [0, 1], [1, 3], [2, 100], [150_000, 5], [299_999, 10], [5, 0]] as const) {
        expect(await lineWindow(buf, from, count, noTick), `${from}+${count}`).toEqual(reference(text, from, count));
      }
    });
  }

  it('hands the loop back every 64 KiB, and the read tool uses it on a 64 MiB file of short lines', async () => {
    const buf = Buffer.from('a\n'.repeat(32 * 1024 * 1024 - 1));
    let ticks = 0;
    const w = await lineWindow(buf, 5, 2, async () => void ticks++);
    expect([w.total, w.lines, ticks]).toEqual([32 * 1024 * 1024 - 1, ['a', 'a'], 1023]); // one per 64 KiB scanned but the last
    const dir = mkdtempSync(join(tmpdir(), 'hutch-linewindow-'));
    try {
      writeFileSync(join(dir, 'short.txt'), buf);
      const tools = new FileTools(new Workspace(dir), { maxFileBytes: 64 * 1024 * 1024 });
      const r = await tools.read({ path: 'short.txt', offset: 32 * 1024 * 1024 - 3 });
      expect([r.totalLines, r.lines, r.content, r.hasMore]).toEqual([32 * 1024 * 1024 - 1, 2, '33554430| a\n33554431| a', false]);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
