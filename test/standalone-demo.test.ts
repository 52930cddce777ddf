/**
 * The Quick start in a fresh clone with nothing beside it: `git clone` of this repository's
 * HEAD into an empty directory, then `./hutch demo` there (it installs the npm packages
 * itself and takes the guest image from the cache in ~/.cache/hutch, keyed by its inputs).
 * Nothing outside the clone may be needed: the demo's workspaces come from examples/.
 */
import { execFileSync, spawn } from 'node:child_process';
import { existsSync, mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';

const repo = resolve(import.meta.dirname, '..');
// Made when the test runs (not when the file loads), so a skipped run leaves nothing behind.
let parent: string | undefined;

afterAll(() => {
  if (parent) rmSync(parent, { recursive: true, force: true });
});

describe('a fresh clone with nothing beside it', { tags: ['vm'] }, () => {
  it('runs ./hutch demo to the end: every route, the failing example tests, the snapshot slot', async () => {
    parent = mkdtempSync(join(tmpdir(), 'hutch-clone-'));
    const clone = join(parent, 'hutch');
    execFileSync('git', ['clone', '-q', '--no-hardlinks', repo, clone], { stdio: 'ignore' });
    expect(readdirSync(parent)).toEqual(['hutch']);
    expect(existsSync(join(clone, 'node_modules'))).toBe(false);
    const { code, out } = await new Promise<{ code: number | null; out: string }>((res, rej) => {
      // A clean environment apart from the cache location: no tsx or npm state from this run.
      const env: NodeJS.ProcessEnv = { PATH: process.env['PATH'] ?? '/usr/bin:/bin', HOME: process.env['HOME'] ?? '/root', LANG: 'C.UTF-8' };
      if (process.env['HUTCH_CACHE']) env['HUTCH_CACHE'] = process.env['HUTCH_CACHE'];
      const p = spawn('./hutch', ['demo'], { cwd: clone, env, stdio: ['ignore', 'pipe', 'pipe'] });
      let text = '';
      p.stdout.on('data', (d: Buffer) => (text += d.toString()));
      p.stderr.on('data', (d: Buffer) => (text += d.toString()));
      p.once('error', rej);
      p.once('exit', (c) => res({ code: c, out: text }));
    });
    expect(code, out.slice(-4000)).toBe(0);
    expect(out).toContain('demo finished');
    for (const route of ['inprocess', 'fastpath', 'vm']) expect(out, route).toMatch(new RegExp(`route=${route}\\b`));
    // Both example workspaces reached their test runners in a VM, and each has its failing test.
    expect(out).toMatch(/FAILED \(failures=1\).*invoicer ships with one failing test/);
    expect(out).toMatch(/# pass 3 # fail 1.*slugkit ships with one failing test/);
    // ~/.gitconfig written in the VM came back after release (snapshot slot).
    expect(out).toMatch(/git config --global user\.name .*-> Demo Agent/);
    expect(out).not.toMatch(/shared\/bench|not found in/);
  }, 3_600_000);
});
