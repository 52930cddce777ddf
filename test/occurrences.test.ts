import { describe, expect, it } from 'vitest';
import { firstOccurrence, splitOccurrences } from '../guest-agent/src/workspace/text.ts';

/** The edit tool's matching, in the file's bytes window by window, against String's own split and join. */
const tick = async () => undefined;
const MiB = 1024 * 1024;

async function both(text: string, from: string, to: string): Promise<void> {
  const buf = Buffer.from(text, 'utf8');
  const r = await splitOccurrences(buf, Buffer.from(from), Buffer.from(to), tick);
  const parts = text.split(from);
  expect(r.count).toBe(from === '' ? 0 : parts.length - 1);
  if (from !== '') expect(r.out?.equals(Buffer.from(parts.join(to), 'utf8'))).toBe(true);
  expect((await splitOccurrences(buf, Buffer.from(from), undefined, tick)).count).toBe(r.count);
  const first = text.indexOf(from);
  expect(await firstOccurrence(buf, Buffer.from(from), tick)).toBe(from === '' || first < 0 ? -1 : Buffer.byteLength(text.slice(0, first)));
}

describe('occurrences in bytes, window by window', () => {
  it('small cases: none, at the ends, overlapping candidates, multibyte characters, a needle longer than the text', async () => {
    for (const [t, f, r] of [
      ['', 'a', 'b'],
      ['abc', 'x', 'y'],
      ['abcabc', 'abc', ''],
      ['aaa', 'aa', 'b'],
      ['aaaa', 'aa', 'aaa'],
      ['héllo wörld é', 'é', 'e\u0301'],
      ['日本語の日本', '日本', 'にほん'],
      ['emoji 😀 and 😀', '😀', ':)'],
      ['short', 'a much longer needle', 'x'],
      ['line\nline\n', 'line\n', ''],
    ] as const) await both(t, f, r);
  });

  it('occurrences across window edges, at every offset around them, and a needle longer than a window', async () => {
    const needle = 'needle-across';
    for (let shift = -needle.length; shift <= needle.length; shift++) {
      const text = 'x'.repeat(MiB + shift) + needle + 'y'.repeat(10) + needle + 'z'.repeat(MiB - 7) + needle;
      await both(text, needle, 'R');
    }
    await both('ab'.repeat(MiB * 1.5) + 'a', 'aba', '-');
    const long = 'q'.repeat(MiB + 3);
    await both(`a${long}b${long}`, long, 'L');
  }, 60_000);

  it('keeps bytes that are not UTF-8 as they are (decoding whole would have made them U+FFFD)', async () => {
    const buf = Buffer.concat([Buffer.from('head '), Buffer.from([0xff, 0xfe, 0x80]), Buffer.from(' old tail old')]);
    const r = await splitOccurrences(buf, Buffer.from('old'), Buffer.from('new'), tick);
    expect(r.count).toBe(2);
    expect(r.out?.equals(Buffer.concat([Buffer.from('head '), Buffer.from([0xff, 0xfe, 0x80]), Buffer.from(' new tail new')]))).toBe(true);
  });
});
