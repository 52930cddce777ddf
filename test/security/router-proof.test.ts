import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { execFileSync } from 'node:child_process';
import { appendFileSync, chmodSync, existsSync, mkdirSync, mkdtempSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { FastPath } from '../../host-broker/src/fastpath/index.ts';
import { gitConfigHazard, initRouter, routeCall, type GitReach } from '../../host-broker/src/router/index.ts';
import { MAX_CONFIG_BYTES, MAX_ENTRIES, programKey } from '../../host-broker/src/router/git-config.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/**
 * Issue 12 item 8: with `core.fsmonitor` or `diff.external` in the workspace's .git/config
 * pointing at a script, `git status` and `git diff` ran that script on the fast path; the
 * call's env (LD_PRELOAD...) played no part in routing; `route: 'fastpath'` skipped the
 * router entirely.
 */
/** A repository with one modified file; `config` is appended to its .git/config. */
function repo(dir: string, config: string): void {
  mkdirSync(dir, { recursive: true });
  execFileSync('git', ['init', '-q', dir]);
  writeFileSync(join(dir, 'f.txt'), 'one\n');
  execFileSync('git', ['-C', dir, 'add', 'f.txt']);
  execFileSync('git', ['-C', dir, '-c', 'user.email=t@t', '-c', 'user.name=t', 'commit', '-qm', 'x']);
  writeFileSync(join(dir, 'f.txt'), 'two\n');
  appendFileSync(join(dir, '.git', 'config'), config);
}

describe('router: env, forced routes and repository configuration', () => {
  beforeAll(() => initRouter());

  it('takes the call environment into the decision', async () => {
    expect(await routeCall({ command: 'cat a.txt' })).toMatchObject({ route: 'fastpath' });
    expect(await routeCall({ command: 'cat a.txt', env: { LANG: 'C', LC_ALL: 'C.UTF-8', TZ: 'UTC' } })).toMatchObject({ route: 'fastpath' });
    for (const k of ['LD_PRELOAD', 'LD_LIBRARY_PATH', 'BASH_ENV', 'ENV', 'GIT_CONFIG_COUNT', 'GIT_EXTERNAL_DIFF', 'PATH', 'PAGER']) {
      expect(await routeCall({ command: 'cat a.txt', env: { [k]: '/tmp/x' } }), k).toMatchObject({ route: 'vm', code: 'call_env' });
    }
  });

  it('lets a caller force only the safer route', async () => {
    expect(await routeCall({ command: 'ls', forced: 'vm' })).toMatchObject({ route: 'vm', code: 'forced' });
    const d = await routeCall({ command: 'python3 -c "import os; os.system(\'id\')"', forced: 'fastpath' });
    expect(d.route).toBe('vm');
    expect(d.reason).toMatch(/only the VM can be forced/);
    expect(await routeCall({ command: 'ls', forced: 'fastpath' })).toMatchObject({ route: 'fastpath' });
  });

  it('reads the keys of a git config that run programs', () => {
    expect(programKey('[core]\n\tfsmonitor = /work/x.sh\n')).toBe('core.fsmonitor');
    expect(programKey('[core]\n\tfsmonitor = false\n')).toBeNull();
    expect(programKey('[diff]\n\texternal = ./d.sh\n')).toBe('diff.external');
    expect(programKey('[diff "pdf"]\n\ttextconv = ./t.sh\n')).toBe('diff.pdf.textconv');
    expect(programKey('[filter "lfs"]\n\tclean = ./c.sh %f\n')).toBe('filter.lfs.clean');
    expect(programKey('[include]\n\tpath = ../cfg\n')).toBe('include.path');
    expect(programKey('[Core] FSMonitor = x')).toBe('core.fsmonitor');
    expect(programKey('[core]\n\tbare = false\n\tfilemode = true\n[user]\n\tname = x\n')).toBeNull();
  });

  it('sends git to the VM where the repository names a program, and keeps it on the fast path otherwise', async () => {
    const ws = mkdtempSync(join(tmpdir(), 'hutch-gitcfg-'));
    repo(ws, '');
    const hazard = (r: GitReach) => gitConfigHazard(ws, r);
    expect(await routeCall({ command: 'git status', gitHazard: hazard })).toMatchObject({ route: 'fastpath' });
    writeFileSync(join(ws, '.git', 'config'), '[core]\n\trepositoryformatversion = 0\n\tfsmonitor = /work/mon.sh\n');
    expect(await routeCall({ command: 'git status', gitHazard: hazard })).toMatchObject({ route: 'vm', code: 'git_config', reason: expect.stringMatching(/core\.fsmonitor/) });
    // Commands without git are not held back by the repository.
    expect(await routeCall({ command: 'cat f.txt', gitHazard: hazard })).toMatchObject({ route: 'fastpath' });
    // A nested repository counts when the command changes directory.
    const ws2 = mkdtempSync(join(tmpdir(), 'hutch-gitcfg-'));
    repo(join(ws2, 'sub'), '[diff]\n\texternal = /work/sub/d.sh\n');
    expect(await routeCall({ command: 'git status', gitHazard: (r) => gitConfigHazard(ws2, r) })).toMatchObject({ route: 'fastpath' });
    expect(await routeCall({ command: 'cd sub && git diff', gitHazard: (r) => gitConfigHazard(ws2, r) })).toMatchObject({ route: 'vm', code: 'git_config' });
    expect(await routeCall({ command: 'git -C sub diff', gitHazard: (r) => gitConfigHazard(ws2, r) })).toMatchObject({ route: 'vm', code: 'git_config' });
  });

  it('reads a tenant-sized repository within bounds, and never through a symlink', async () => {
    const nested = (ws: string, command = 'cd sub && git status') => routeCall({ command, gitHazard: (r) => gitConfigHazard(ws, r) });
    // A configuration too large to read is a reason for the VM, not a read of it on the loop.
    const big = mkdtempSync(join(tmpdir(), 'hutch-gitcfg-'));
    repo(big, '');
    appendFileSync(join(big, '.git', 'config'), '[core]\n\tbare = false\n'.repeat(Math.ceil(MAX_CONFIG_BYTES / 20)));
    expect(await nested(big, 'git status')).toMatchObject({ route: 'vm', code: 'git_config', reason: expect.stringMatching(/\.git\/config is \d+ bytes, over/) });
    // A FIFO in a config's place is named, not opened (an open would wait for a writer).
    const fifo = mkdtempSync(join(tmpdir(), 'hutch-gitcfg-'));
    repo(fifo, '');
    execFileSync('mkfifo', [join(fifo, '.git', 'config.worktree')]);
    expect(await nested(fifo, 'git status')).toMatchObject({ route: 'vm', reason: expect.stringMatching(/config\.worktree is not a regular file/) });
    // Submodule configurations are read, a .git/modules past the entry budget is not walked to its end.
    const mods = mkdtempSync(join(tmpdir(), 'hutch-gitcfg-'));
    repo(mods, '');
    mkdirSync(join(mods, '.git', 'modules', 'lib'), { recursive: true });
    writeFileSync(join(mods, '.git', 'modules', 'lib', 'config'), '[core]\n\tpager = ./p.sh\n');
    expect(await nested(mods, 'git status')).toMatchObject({ route: 'vm', reason: expect.stringMatching(/modules\/lib\/config sets core\.pager/) });
    // Only the repositories git can reach are read: a big tree beside them costs nothing,
    // a .git/modules past the entry budget is not walked to its end.
    const wide = mkdtempSync(join(tmpdir(), 'hutch-gitcfg-'));
    repo(join(wide, 'sub'), '');
    mkdirSync(join(wide, 'many'));
    for (let i = 0; i <= MAX_ENTRIES; i++) writeFileSync(join(wide, 'many', `f${i}`), '');
    expect(await nested(wide, 'git status')).toMatchObject({ route: 'fastpath' });
    expect(await nested(wide)).toMatchObject({ route: 'fastpath' });
    execFileSync('mv', [join(wide, 'many'), join(wide, 'sub', '.git', 'modules')]);
    expect(await nested(wide)).toMatchObject({ route: 'vm', reason: expect.stringMatching(/too many entries/) });
    // A directory that is a symlink out of the workspace is not followed: the repository
    // behind it is never read (inside the fast path's sandbox the link leads nowhere).
    const outside = mkdtempSync(join(tmpdir(), 'hutch-gitcfg-out-'));
    repo(outside, '[core]\n\tfsmonitor = /x.sh\n');
    const linked = mkdtempSync(join(tmpdir(), 'hutch-gitcfg-'));
    mkdirSync(join(linked, 'real'));
    symlinkSync(outside, join(linked, 'sub'));
    const d = await nested(linked);
    expect(d.reason ?? '').not.toMatch(/fsmonitor/);
    symlinkSync(join(outside, '.git'), join(linked, 'real', '.git'));
    expect(await nested(linked, 'cd real && git status')).toMatchObject({ route: 'vm', reason: 'real/.git is a symlink' });
  }, 180_000);

  describe('through a broker', () => {
    let b: TestBroker;
    beforeAll(async () => {
      b = await startBroker();
    });
    afterAll(async () => b?.stop());

    it('git status and git diff with a program-naming config do not run on the fast path', async () => {
      const h = await b.connect();
      const sb = await h.create();
      const ws = join(b.dataDir, 'sessions', sb.id, 'workspace');
      repo(ws, '[core]\n\tfsmonitor = /work/mon.sh\n[diff]\n\texternal = /work/mon.sh\n');
      writeFileSync(join(ws, 'mon.sh'), '#!/bin/sh\necho ran >> /work/ran.txt\n');
      chmodSync(join(ws, 'mon.sh'), 0o755);
      for (const cmd of ['git status', 'git diff']) {
        const r = await sb.run(cmd);
        expect(r.route, cmd).toBe('vm');
        expect(r.reason).toMatch(/core\.fsmonitor|diff\.external/);
      }
      const forced = await sb.run('git status', { route: 'fastpath' });
      expect(forced.route).toBe('vm');
      const env = await sb.run('cat f.txt', { env: { LD_PRELOAD: '/work/evil.so' } });
      expect(env.route).toBe('vm');
      await sb.close();
    });
  });

  it("the fast path itself pins git's program keys (second layer)", async () => {
    const fp = await FastPath.create();
    try {
      const ws = mkdtempSync(join(tmpdir(), 'hutch-gitpin-'));
      repo(ws, '[core]\n\tfsmonitor = /work/mon.sh\n\thooksPath = /work/hooks\n');
      writeFileSync(join(ws, 'mon.sh'), '#!/bin/sh\necho ran >> /work/ran.txt\n');
      chmodSync(join(ws, 'mon.sh'), 0o755);
      let out = '';
      const r = await fp.run({ command: 'git status --short', workspace: ws, onStdout: (c) => void (out += c), onStderr: (c) => void (out += c) });
      expect(r.exitCode, out).toBe(0);
      expect(out).toContain('M f.txt');
      expect(existsSync(join(ws, 'ran.txt'))).toBe(false);
    } finally {
      await fp.close();
    }
  });
});
