/**
 * `hutch serve` as a supervisor starts it: readiness as one line of JSON, no guest image
 * built behind its back (`./hutch serve` with the unsafe-local backend touches no guest
 * image; `--no-build` turns a missing image into a clear error instead of a build). Each
 * run gets an empty HUTCH_CACHE, so "nothing was built" is checked on disk.
 */
import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { Hutch } from '../host-broker/src/sdk/index.ts';
import { qemuAvailable } from '../host-broker/src/backends/registry.ts';

const repo = resolve(import.meta.dirname, '..');
const work = mkdtempSync(join(tmpdir(), 'hutch-serve-cli-'));
const token = 'serve-cli-test-token-0123';

afterAll(() => {
  rmSync(work, { recursive: true, force: true });
});

function startServe(cmd: string, args: string[], cache: string) {
  // Its own process group: `./hutch serve` runs the broker under npx and tsx, which do not
  // pass a signal on; the whole group is signalled so no broker outlives the test.
  const p = spawn(cmd, args, { cwd: repo, env: { ...process.env, HUTCH_CACHE: cache }, stdio: ['ignore', 'pipe', 'pipe'], detached: true });
  let stdout = '';
  let stderr = '';
  p.stdout.on('data', (d: Buffer) => (stdout += d.toString()));
  p.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
  const exited = new Promise<number | null>((res) => p.once('exit', res));
  const firstLine = new Promise<string>((res, rej) => {
    p.stdout.on('data', () => {
      const nl = stdout.indexOf('\n');
      if (nl >= 0) res(stdout.slice(0, nl));
    });
    void exited.then((code) => rej(new Error(`serve exited ${code} before a line: ${stderr.slice(-2000)}`)));
  });
  // Not every caller waits for a line (the --no-build case expects none).
  firstLine.catch(() => undefined);
  return { p, exited, firstLine, out: () => ({ stdout, stderr }) };
}

/** SIGTERM to the child's whole process group (see startServe). */
function stopGroup(p: { pid?: number | undefined; kill(sig: NodeJS.Signals): boolean }): void {
  try {
    if (p.pid !== undefined) process.kill(-p.pid, 'SIGTERM');
    else p.kill('SIGTERM');
  } catch {
    p.kill('SIGTERM');
  }
}

/** What the guest image builders would have left in the cache. */
function builtArtifacts(cache: string): string[] {
  return ['rootfs', 'rootfs-base', 'kernel', 'kernel-debian', 'snapshots'].filter((d) => existsSync(join(cache, d)) && readdirSync(join(cache, d)).length > 0);
}

describe('hutch serve for a supervisor', () => {
  it('./hutch serve with unsafe-local prints one JSON line when listening and builds no guest image', async () => {
    const cache = mkdtempSync(join(work, 'cache-'));
    const s = startServe('./hutch', ['serve', '--port', '0', '--token', token, '--data-dir', join(work, 'data-local'), '--backend', 'unsafe-local', '--i-know-unsafe-local', '--ready-json', '--log-level', 'error'], cache);
    try {
      const line = await s.firstLine;
      const ready = JSON.parse(line) as { url: string; port: number; token?: string };
      expect(ready.url).toBe(`ws://127.0.0.1:${ready.port}`);
      expect(ready.token).toBeUndefined();
      const hutch = await Hutch.connect(ready.url, { token });
      const sb = await hutch.create({ workspace: { files: { 'a.txt': 'A\n' } } });
      const r = await sb.run('cat a.txt; python3 -c "print(1 + 1)"');
      expect(r.stdout).toBe('A\n2\n');
      await sb.close();
      hutch.close();
    } finally {
      stopGroup(s.p);
      await s.exited;
    }
    expect(builtArtifacts(cache)).toEqual([]);
  }, 180_000);

  it('prints the generated token in the ready line when none was given', async () => {
    const cache = mkdtempSync(join(work, 'cache-'));
    const env = { ...process.env };
    delete env['HUTCH_TOKEN'];
    const p = spawn(process.execPath, ['--import', 'tsx', 'host-broker/src/cli.ts', 'serve', '--port', '0', '--data-dir', join(work, 'data-gen'), '--backend', 'unsafe-local', '--i-know-unsafe-local', '--ready-json', '--log-level', 'error'], {
      cwd: repo,
      env: { ...env, HUTCH_CACHE: cache },
      stdio: ['ignore', 'pipe', 'inherit'],
    });
    try {
      const line = await new Promise<string>((res, rej) => {
        let out = '';
        p.stdout.on('data', (d: Buffer) => {
          out += d.toString();
          if (out.includes('\n')) res(out.slice(0, out.indexOf('\n')));
        });
        p.once('exit', (c) => rej(new Error(`exited ${c}`)));
      });
      const ready = JSON.parse(line) as { url: string; token: string };
      const hutch = await Hutch.connect(ready.url, { token: ready.token });
      expect(Array.isArray(await hutch.sessions())).toBe(true);
      hutch.close();
    } finally {
      stopGroup(p);
      if (p.exitCode === null) await new Promise((r) => p.once('exit', r));
    }
  }, 120_000);

  it.skipIf(!qemuAvailable())('--no-build with no cached guest image fails clearly and builds nothing', async () => {
    const cache = mkdtempSync(join(work, 'cache-'));
    const s = startServe(process.execPath, ['--import', 'tsx', 'host-broker/src/cli.ts', 'serve', '--port', '0', '--token', token, '--data-dir', join(work, 'data-nb'), '--backend', 'qemu', '--no-build', '--log-level', 'error'], cache);
    const code = await s.exited;
    const { stdout, stderr } = s.out();
    expect(code, stderr).not.toBe(0);
    expect(stdout).toBe('');
    expect(stderr).toMatch(/unavailable: .* is not in the cache .* building is off \(--no-build\): run \.\/hutch setup/);
    expect(builtArtifacts(cache)).toEqual([]);
  }, 120_000);

  it('--standby takes 0 to 16 standby VMs; anything else is refused before any work, and --help says what it costs', async () => {
    for (const bad of ['abc', '17', '1.5', '-1']) {
      const cache = mkdtempSync(join(work, 'cache-'));
      const s = startServe(process.execPath, ['--import', 'tsx', 'host-broker/src/cli.ts', 'serve', '--port', '0', '--token', token, '--data-dir', join(work, 'data-sb'), `--standby=${bad}`, '--log-level', 'error'], cache);
      const code = await s.exited;
      const { stdout, stderr } = s.out();
      expect(code, stderr).not.toBe(0);
      expect(stdout).toBe('');
      expect(stderr).toContain(`--standby must be a whole number from 0 to 16, got "${bad}"`);
      expect(builtArtifacts(cache)).toEqual([]);
    }
    const help = startServe(process.execPath, ['--import', 'tsx', 'host-broker/src/cli.ts', 'serve', '--help'], mkdtempSync(join(work, 'cache-')));
    expect(await help.exited).toBe(0);
    expect(help.out().stdout).toMatch(/--standby N\s+VMs kept restored and warmed for the next wake \(default 1; 0 = none;/);
  }, 120_000);

  it('--session-memory-mib, --session-cpus, --principal-memory-mib and --max-sessions that are not whole numbers in range are refused before any work', async () => {
    for (const [flag, bad, says] of [
      ['--session-memory-mib', '512,abc', 'takes whole numbers separated by commas'],
      ['--session-memory-mib', '32', 'memoryMiB 32 is not a whole number from 64'],
      ['--session-cpus', '128', 'cpus 128 is not a whole number from 1 to 64'],
      ['--principal-memory-mib', '0', '--principal-memory-mib must be a whole number > 0'],
      ['--max-sessions', 'many', '--max-sessions must be a whole number > 0'],
    ] as const) {
      const cache = mkdtempSync(join(work, 'cache-'));
      const s = startServe(process.execPath, ['--import', 'tsx', 'host-broker/src/cli.ts', 'serve', '--port', '0', '--token', token, '--data-dir', join(work, 'data-sz'), `${flag}=${bad}`, '--log-level', 'error'], cache);
      const code = await s.exited;
      const { stdout, stderr } = s.out();
      expect(code, stderr).not.toBe(0);
      expect(stdout).toBe('');
      expect(stderr).toContain(says);
      expect(builtArtifacts(cache)).toEqual([]);
    }
  }, 120_000);

  it('--memory-budget-mib sets the budget /metrics reports; a value that is not a positive whole number is refused before any work', async () => {
    for (const bad of ['0', 'abc', '1.5', '-512']) {
      const cache = mkdtempSync(join(work, 'cache-'));
      const s = startServe(process.execPath, ['--import', 'tsx', 'host-broker/src/cli.ts', 'serve', '--port', '0', '--token', token, '--data-dir', join(work, 'data-mb'), `--memory-budget-mib=${bad}`, '--log-level', 'error'], cache);
      const code = await s.exited;
      const { stdout, stderr } = s.out();
      expect(code, stderr).not.toBe(0);
      expect(stdout).toBe('');
      expect(stderr).toContain(`--memory-budget-mib must be a whole number > 0, got "${bad}"`);
      expect(builtArtifacts(cache)).toEqual([]);
    }
    const s = startServe(process.execPath, ['--import', 'tsx', 'host-broker/src/cli.ts', 'serve', '--port', '0', '--token', token, '--data-dir', join(work, 'data-mb-ok'), '--backend', 'unsafe-local', '--i-know-unsafe-local', '--memory-budget-mib', '3000', '--ready-json', '--log-level', 'error'], mkdtempSync(join(work, 'cache-')));
    try {
      const ready = JSON.parse(await s.firstLine) as { url: string };
      const text = await (await fetch(`${ready.url.replace('ws:', 'http:')}/metrics`, { headers: { authorization: `Bearer ${token}` } })).text();
      expect(text).toMatch(/^hutch_memory_budget_mib 3000$/m);
      expect(text).toMatch(/^hutch_memory_reserved_mib\{holder="vm"\} 0$/m);
      expect(text).toMatch(/^hutch_memory_reserved_mib\{holder="standby"\} 0$/m);
      // Half the user's inotify watches, the other half left to everything else it runs.
      const maxWatches = Number(readFileSync('/proc/sys/fs/inotify/max_user_watches', 'utf8'));
      expect(text).toMatch(new RegExp(`^hutch_watched_dirs\\{state="max"\\} ${Math.floor(maxWatches / 2)}$`, 'm'));
    } finally {
      stopGroup(s.p);
      await s.exited;
    }
  }, 120_000);
});
