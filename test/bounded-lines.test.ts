import { describe, expect, it } from 'vitest';
import { PassThrough } from 'node:stream';
import { boundedLines } from '../host-broker/src/util/bounded-lines.ts';
import { DAEMON_MAX_LINE_BYTES, startDaemon } from '../host-broker/src/util/daemon.ts';
import type { Logger } from '../guest-agent/src/log.ts';

/**
 * Lines of output the broker does not control (a guest's serial console through QEMU,
 * QEMU's monitor socket). readline held a line whole until its newline: a guest writing
 * its console as root without one grew the broker's heap without bound.
 */
function collect(chunks: Array<string | Buffer>, max: number): { lines: Array<[string, number]>; overflows: number } {
  const input = new PassThrough();
  const lines: Array<[string, number]> = [];
  let overflows = 0;
  boundedLines(input, max, (l, cut) => void lines.push([l, cut]), () => void overflows++);
  for (const c of chunks) input.write(c);
  input.end();
  return { lines, overflows };
}

async function settle(): Promise<void> {
  await new Promise((r) => setImmediate(r));
}

describe('boundedLines', () => {
  it('splits lines across chunk boundaries, drops one CR before LF, keeps a last line without newline', async () => {
    const r = collect(['ab', 'c\r\nde', 'f\n\n', 'g'], 100);
    await settle();
    expect(r.lines).toEqual([['abc', 0], ['def', 0], ['', 0], ['g', 0]]);
    expect(r.overflows).toBe(0);
  });

  it('joins a multibyte character split between chunks', async () => {
    const b = Buffer.from('héllo ✓\n');
    const r = collect([b.subarray(0, 2), b.subarray(2, 9), b.subarray(9)], 100);
    await settle();
    expect(r.lines).toEqual([['héllo ✓', 0]]);
  });

  it('keeps the first max bytes of a long line and counts the rest, telling once when it passes', async () => {
    const r = collect(['x'.repeat(30), 'y'.repeat(30), 'z'.repeat(30) + '\nshort\n' + 'w'.repeat(50)], 40);
    await settle();
    expect(r.lines).toEqual([['x'.repeat(30) + 'y'.repeat(10), 50], ['short', 0], ['w'.repeat(40), 10]]);
    expect(r.overflows).toBe(2);
  });
});

describe("a daemon's output", () => {
  it('a process writing 32 MiB without a newline and then thousands of matching lines: lines cut, the log sampled', async () => {
    const logged: Array<Record<string, unknown>> = [];
    const log = {
      debug: () => undefined,
      info: (msg: string, f: Record<string, unknown> = {}) => void (msg === 'daemon.output' && logged.push(f)),
      warn: () => undefined,
      error: () => undefined,
      child: () => log,
    } as unknown as Logger;
    const seen: string[] = [];
    const d = startDaemon({
      argv: ['python3', '-c', "import sys\nsys.stdout.write('e' * (32 << 20))\nsys.stdout.write('\\n')\nfor i in range(5000): sys.stdout.write('error %d\\n' % i)\n"],
      log,
      interesting: /^e/,
      onLine: (l) => void seen.push(l),
    });
    expect((await d.exited).code).toBe(0);
    await new Promise((r) => setTimeout(r, 100)); // the last lines after the exit
    expect(seen).toHaveLength(5001);
    expect(seen[0]).toBe(`${'e'.repeat(DAEMON_MAX_LINE_BYTES)}... (${(32 << 20) - DAEMON_MAX_LINE_BYTES} bytes cut)`);
    expect(seen.at(-1)).toBe('error 4999');
    // 100 in full, then every 1,000th (the 1,000th ... 5,000th of 5,001 matching lines; the long one is the first).
    expect(logged).toHaveLength(105);
    expect(logged.at(-1)).toMatchObject({ line: 'error 4998', interestingLines: 5000 });
    expect(d.tail().every((l) => l.length < DAEMON_MAX_LINE_BYTES + 64)).toBe(true);
  });
});
