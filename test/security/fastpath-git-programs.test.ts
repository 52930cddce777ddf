import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { execFileSync } from 'node:child_process';
import { appendFileSync, chmodSync, cpSync, existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { FastPath } from '../../host-broker/src/fastpath/index.ts';
import { gitConfigHazard } from '../../host-broker/src/router/index.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';
import type { Sandbox } from '../../host-broker/src/sdk/index.ts';

/**
 * Issue 38 item 7: git on the fast path (the host kernel) ran programs a tenant named in
 * configuration the router never read: a global config planted in the fast path's HOME
 * (/tmp), a nested repository reached by `git "-C" sub` or `d=-C; git $d sub` (the `-C`
 * check was a regex on the text), a `.git/commondir` pointing at another git directory, a
 * submodule with its own `.git` under `git diff --submodule=diff`. And more of the same
 * kind: a submodule's clean filter run by a plain `git status`, a command that writes
 * `.git/config` before its own `git diff`, an upload that replaces `.git/config` while a
 * fast-path command is on its way to git, an implicit bare repository at the root, a
 * `gitdir:` file, a `cd` through a symlink, `%G?` (gpg) in a log format.
 *
 * Every case runs a real broker and the real fast path, with a marker script that, run,
 * appends where it ran to a file: `fastpath` where there is no procfs (the fast path has
 * none), `vm` otherwise (the unsafe-local backend stands in for the VM in these tests and
 * runs what it is given, as a VM would). The test asserts the route and that nothing ran
 * on the fast path.
 */
const MARK = '/work/mark.sh';

function git(dir: string, ...args: string[]): void {
  execFileSync('git', ['-C', dir, '-c', 'user.email=t@t', '-c', 'user.name=t', ...args], { stdio: 'pipe' });
}

/** A repository at `dir` with one committed file, then modified (so `git diff` has work). */
function repo(dir: string, config = '', objectFormat = 'sha1'): void {
  mkdirSync(dir, { recursive: true });
  execFileSync('git', ['init', '-q', `--object-format=${objectFormat}`, dir]);
  writeFileSync(join(dir, 'f.txt'), 'one\n');
  git(dir, 'add', 'f.txt');
  git(dir, 'commit', '-qm', 'x');
  writeFileSync(join(dir, 'f.txt'), 'two\n');
  if (config) appendFileSync(join(dir, '.git', 'config'), config);
}

const PROGRAM_CONFIG = `[diff]\n\texternal = ${MARK}\n`;

describe('fast-path git runs no program a tenant names', () => {
  let b: TestBroker;
  let sb: Sandbox;
  let ws: string;

  beforeAll(async () => {
    b = await startBroker();
    const h = await b.connect();
    sb = await h.create();
    ws = join(b.dataDir, 'sessions', sb.id, 'workspace');
  });
  afterAll(async () => b?.stop());

  /** Empties the workspace and puts the marker script in it. */
  function fresh(): void {
    for (const e of readdirSync(ws)) rmSync(join(ws, e), { recursive: true, force: true });
    writeFileSync(join(ws, 'mark.sh'), '#!/bin/sh\nif [ -d /proc/self ]; then echo vm; else echo fastpath; fi >> /work/marker\n');
    chmodSync(join(ws, 'mark.sh'), 0o755);
  }
  const marked = () => existsSync(join(ws, 'marker')) && readFileSync(join(ws, 'marker'), 'utf8').includes('fastpath');

  async function expectNotRun(command: string, route: 'fastpath' | 'vm' | 'either'): Promise<void> {
    const r = await sb.run(command);
    if (route !== 'either') expect(r.route, `${command}: ${r.reason}\n${r.stdout}${r.stderr}`).toBe(route);
    expect(marked(), `${command} ran the marker on the fast path (route ${r.route}: ${r.reason})`).toBe(false);
  }

  it('a global config planted in HOME or /tmp is not read', async () => {
    fresh();
    repo(ws);
    await expectNotRun(`printf '[diff]\\n\\texternal = ${MARK}\\n' > /tmp/.gitconfig && cat /tmp/.gitconfig && git diff`, 'fastpath');
    await expectNotRun(
      `mkdir /tmp/.config /tmp/.config/git && printf '[diff]\\n\\texternal = ${MARK}\\n' > /tmp/.config/git/config && cat /tmp/.config/git/config && git diff`,
      'fastpath',
    );
  });

  it('the directory git runs in is taken from parsed words, not the command text', async () => {
    fresh();
    repo(ws);
    repo(join(ws, 'sub'), PROGRAM_CONFIG);
    await expectNotRun('git "-C" sub diff', 'vm');
    await expectNotRun("git '-C' sub diff", 'vm');
    await expectNotRun('d=-C; git $d sub diff', 'vm');
    await expectNotRun('cd sub; git diff', 'vm');
    // A repository deeper than any search depth, below a directory a search would skip.
    rmSync(join(ws, 'sub'), { recursive: true, force: true });
    repo(join(ws, 'node_modules', 'a', 'b', 'c', 'd', 'e'), PROGRAM_CONFIG);
    await expectNotRun('cd node_modules/a/b/c/d/e && git diff', 'vm');
    await expectNotRun('git -C node_modules/a/b/c/d/e/ diff', 'vm');
    // Without any program in reach, the same commands stay on the fast path.
    rmSync(join(ws, 'node_modules'), { recursive: true, force: true });
    repo(join(ws, 'clean'));
    const ok = await sb.run('git -C clean diff --stat');
    expect(ok.route, ok.reason).toBe('fastpath');
    expect(ok.stdout).toContain('f.txt');
  });

  it('a commondir or a gitdir file pointing at another git directory', async () => {
    fresh();
    repo(ws);
    cpSync(join(ws, '.git'), join(ws, 'store'), { recursive: true });
    appendFileSync(join(ws, 'store', 'config'), PROGRAM_CONFIG);
    writeFileSync(join(ws, '.git', 'commondir'), '../store\n');
    await expectNotRun('git diff', 'vm');
    rmSync(join(ws, '.git', 'commondir'));
    // sub/.git is a file naming store/ as its git directory.
    mkdirSync(join(ws, 'sub'));
    writeFileSync(join(ws, 'sub', 'f.txt'), 'three\n');
    writeFileSync(join(ws, 'sub', '.git'), 'gitdir: ../store\n');
    await expectNotRun('cd sub && git diff', 'vm');
  });

  it('a submodule with its own .git: --submodule=diff, and the status that runs its filters', async () => {
    fresh();
    repo(ws);
    repo(join(ws, 'sub'));
    git(ws, 'add', 'sub');
    git(ws, 'commit', '-qm', 'embed');
    appendFileSync(join(ws, 'sub', '.git', 'config'), `${PROGRAM_CONFIG}[filter "ev"]\n\tclean = ${MARK}\n`);
    writeFileSync(join(ws, 'sub', '.gitattributes'), '* filter=ev\n');
    await expectNotRun('git diff --submodule=diff', 'vm');
    await expectNotRun('git status --short', 'vm');
    await expectNotRun('git diff', 'vm');
  });

  it('a command cannot write the configuration its own git reads', async () => {
    fresh();
    repo(ws);
    await expectNotRun(`printf '[diff]\\n\\texternal = ${MARK}\\n' >> .git/config && git diff`, 'vm');
    await expectNotRun(`ln -s .git/config c && printf '[diff]\\n\\texternal = ${MARK}\\n' >> c && git diff`, 'vm');
  });

  it('an upload cannot replace .git/config between the route and git', async () => {
    fresh();
    repo(ws);
    let uploaded: Promise<unknown> | undefined;
    const r = await sb.run('echo started; head -c 1000000000 /dev/zero | wc -c; git diff', {
      onStdout: (s) => {
        if (!uploaded && s.includes('started')) uploaded = sb.files.upload('.git/config', Buffer.from(`[core]\n\trepositoryformatversion = 0\n${PROGRAM_CONFIG}`));
      },
    });
    await uploaded;
    expect(r.route, r.reason).toBe('fastpath');
    expect(marked()).toBe(false);
    // The upload itself landed (after the command).
    const again = await sb.run('git diff');
    expect(again.route).toBe('vm');
  });

  it('an implicit bare repository, a cd through a symlink, a gpg format', async () => {
    fresh();
    // The workspace root is itself a bare repository whose textconv names the marker.
    const bare = mkdtempSync(join(tmpdir(), 'hutch-bare-'));
    repo(bare);
    git(bare, 'commit', '-qam', 'two');
    cpSync(join(bare, '.git'), ws, { recursive: true });
    appendFileSync(join(ws, 'config'), `[diff "m"]\n\ttextconv = ${MARK}\n`);
    mkdirSync(join(ws, 'info'), { recursive: true });
    writeFileSync(join(ws, 'info', 'attributes'), '* diff=m\n');
    await expectNotRun('git log -p', 'either');
    fresh();
    repo(join(ws, 'real'), PROGRAM_CONFIG);
    symlinkSync('real', join(ws, 'link'));
    await expectNotRun('cd link && git diff', 'vm');
    fresh();
    repo(ws, '[gpg]\n\tformat = openpgp\n');
    const g = await sb.run('git log --format=%G?');
    expect(g.route).toBe('vm');
  });
});

describe('the submodules an index lists', () => {
  it('are found in every index version and object format', async () => {
    for (const objectFormat of ['sha1', 'sha256']) {
      for (const version of ['2', '3', '4']) {
        const ws = mkdtempSync(join(tmpdir(), 'hutch-gitindex-'));
        repo(ws, '', objectFormat);
        repo(join(ws, 'deep', 'er', 'sub'), '', objectFormat);
        git(ws, 'add', 'deep/er/sub');
        // An intent-to-add entry carries extended flags (version 3 and up).
        writeFileSync(join(ws, 'later.txt'), 'x\n');
        if (version !== '2') git(ws, 'add', '-N', 'later.txt');
        git(ws, 'update-index', '--index-version', version);
        const where = `${version}/${objectFormat}`;
        expect(await gitConfigHazard(ws, { dirs: [''] }), where).toBeNull();
        appendFileSync(join(ws, 'deep', 'er', 'sub', '.git', 'config'), PROGRAM_CONFIG);
        expect(await gitConfigHazard(ws, { dirs: [''] }), where).toBe('deep/er/sub/.git/config sets diff.external, which makes git run a program');
        // Not checked out: git does not look into it, nor does the check.
        rmSync(join(ws, 'deep'), { recursive: true, force: true });
        expect(await gitConfigHazard(ws, { dirs: [''] }), where).toBeNull();
      }
    }
  });
});

describe('the fast path itself', () => {
  it('gives every run a fresh /tmp and a HOME nothing can be written to', async () => {
    const fp = await FastPath.create();
    try {
      const ws = mkdtempSync(join(tmpdir(), 'hutch-fp-home-'));
      const run = async (command: string) => {
        let out = '';
        const r = await fp.run({ command, workspace: ws, onStdout: (c) => void (out += c), onStderr: (c) => void (out += c) });
        return { code: r.exitCode, out };
      };
      expect((await run('echo x > /tmp/left && cat /tmp/left')).out).toBe('x\n');
      expect((await run('ls -A /tmp')).out).toBe('');
      const home = await run('echo "$HOME"; echo x > "$HOME/.gitconfig"');
      expect(home.code).not.toBe(0);
      expect(home.out).toMatch(/^\/home\/tenant\n.*Read-only file system/s);
      // git reads no global or system configuration, whatever HOME and XDG_CONFIG_HOME say.
      writeFileSync(join(ws, 'mark.sh'), '#!/bin/sh\necho fastpath >> /work/marker\n');
      chmodSync(join(ws, 'mark.sh'), 0o755);
      repo(join(ws, 'r'));
      const planted = await run(`mkdir -p /tmp/x/git && printf '[diff]\\n\\texternal = ${MARK}\\n' > /tmp/x/git/config && cd r && HOME=/tmp/x XDG_CONFIG_HOME=/tmp/x git diff --stat`);
      expect(planted.out).toContain('f.txt');
      expect(existsSync(join(ws, 'marker'))).toBe(false);
      // A directory that is a bare repository is not used without --git-dir (which the router refuses).
      const bare = join(ws, 'bare');
      cpSync(join(ws, 'r', '.git'), bare, { recursive: true });
      appendFileSync(join(bare, 'config'), `[diff "m"]\n\ttextconv = ${MARK}\n`);
      writeFileSync(join(bare, 'info', 'attributes'), '* diff=m\n');
      const implicit = await run('cd bare && git log -p');
      expect(implicit.out).toMatch(/cannot use bare repository/);
      expect(existsSync(join(ws, 'marker'))).toBe(false);
    } finally {
      await fp.close();
    }
  });
});
