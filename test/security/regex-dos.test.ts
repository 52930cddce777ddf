import { afterAll, describe, expect, it } from 'vitest';
import { spawn, type ChildProcess } from 'node:child_process';
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Workspace } from '../../guest-agent/src/workspace/confine.ts';
import { FileTools } from '../../guest-agent/src/workspace/file-tools.ts';

/**
 * Issue 12 item 4: one tenant's pattern must not stall the process that serves everyone.
 * Before: `grep '^(a+)+$'` backtracked exponentially on the event loop (a 40-character
 * line: hours), and the glob `*a*a*a*a*a*a*a*a*a*a*a*a*c` against a 41-character name took
 * 170 s. Now glob matching is a linear DFA, grep runs in a worker where V8 falls back to its
 * linear engine, and what cannot be linear ends with a typed `timeout` at its deadline while
 * the other calls are answered. The probe runs in a child process so that a stalled loop
 * fails this test (by its timeout) instead of hanging the test runner.
 */

const dir = mkdtempSync(join(tmpdir(), 'hutch-redos-'));
let probe: ChildProcess | undefined;
afterAll(() => {
  // A stalled probe never exits on its own: vitest's timeout fails the test, this kills it.
  probe?.kill('SIGKILL');
  rmSync(dir, { recursive: true, force: true });
});

interface Event {
  name: string;
  result?: unknown;
  code?: string;
}

function runProbe(): Promise<Event[]> {
  return new Promise((resolve, reject) => {
    const child = (probe = spawn(process.execPath, ['--import', 'tsx', join(import.meta.dirname, 'regex-dos.probe.ts'), dir], { stdio: ['ignore', 'pipe', 'inherit'] }));
    let out = '';
    child.stdout.on('data', (c: Buffer) => (out += c.toString()));
    child.on('error', reject);
    child.on('exit', (code) => {
      if (code !== 0) return reject(new Error(`probe exited ${code}: ${out}`));
      resolve(out.trim().split('\n').map((l) => JSON.parse(l) as Event));
    });
  });
}

describe('catastrophic patterns', () => {
  it('come back with a result or a typed timeout, and other calls are answered meanwhile', async () => {
    writeFileSync(join(dir, 'evil.txt'), `${'a'.repeat(40)}b\n${'a'.repeat(12)}\n`);
    writeFileSync(join(dir, 'short.txt'), 'hello\n');
    writeFileSync(join(dir, 'a'.repeat(41)), 'x\n');
    writeFileSync(join(dir, `${'a'.repeat(40)}c`), 'x\n');

    const events = await runProbe();
    expect(events.map((e) => e.name)).toEqual(['grep', 'glob', 'list', 'compileGlob', 'read', 'read', 'read', 'grep-i', 'grep-after']);
    const by = (n: string) => events.find((e) => e.name === n) as Event;
    // Linear-engine fallback: the right answer, not an error.
    expect(by('grep').result).toMatchObject({ matches: [{ path: 'evil.txt', line: 2, text: 'a'.repeat(12) }], truncated: false });
    expect(by('glob').result).toMatchObject({ files: [`${'a'.repeat(40)}c`] });
    expect((by('list').result as { entries: Array<{ path: string }> }).entries.map((e) => e.path).sort()).toEqual(['a'.repeat(41), 'evil.txt', 'short.txt']);
    expect(by('compileGlob').result).toEqual([false, true]);
    expect(events.filter((e) => e.name === 'read').map((e) => (e.result as { content: string }).content)).toEqual(['hello', 'hello', 'hello']);
    // Case-insensitive cannot use the linear engine: it ran off the loop until its deadline.
    expect(by('grep-i').code).toBe('timeout');
    expect(by('grep-after').result).toMatchObject({ matches: [{ path: 'short.txt', line: 1, text: 'hello' }] });
  }, 90_000);

  it('a walk over a big tree ends with a typed timeout at its budget instead of running on', async () => {
    const big = join(dir, 'big');
    mkdirSync(big);
    for (let i = 0; i < 10_000; i++) writeFileSync(join(big, `f${i}.txt`), '');
    const tools = new FileTools(new Workspace(big), { searchTimeoutMs: 1 });
    const codeOf = (p: Promise<unknown>) => p.then(() => 'ok', (e: { code: string }) => e.code);
    expect(await codeOf(tools.glob({ pattern: '*a*a*a*a*a*a*a*a*a*a*a*a*c' }))).toBe('timeout');
    expect(await codeOf(tools.list({ ignore: ['*.txt'] }))).toBe('timeout');
    expect(await codeOf(tools.grep({ pattern: 'x' }))).toBe('timeout');
  });
});
