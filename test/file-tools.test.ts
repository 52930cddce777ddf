import { afterAll, beforeEach, describe, expect, it } from 'vitest';
import { execFileSync } from 'node:child_process';
import { chmodSync, closeSync, existsSync, linkSync, mkdirSync, mkdtempSync, readdirSync, openSync, readFileSync, rmSync, statSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Workspace } from '../guest-agent/src/workspace/confine.ts';
import { FileTools } from '../guest-agent/src/workspace/file-tools.ts';
import { compileGlob } from '../guest-agent/src/workspace/glob-match.ts';

const base = mkdtempSync(join(tmpdir(), 'hutch-files-'));
afterAll(() => rmSync(base, { recursive: true, force: true }));

let n = 0;
let root: string;
let tools: FileTools;
let secret: string;
beforeEach(() => {
  const dir = join(base, `case${n++}`);
  root = join(dir, 'ws');
  mkdirSync(root, { recursive: true });
  secret = join(dir, 'secret.txt');
  writeFileSync(secret, 'TOP SECRET\n');
  tools = new FileTools(new Workspace(root));
});

const codeOf = async (p: Promise<unknown>) => p.then(() => 'ok', (e: { code: string }) => e.code);

describe('read', () => {
  it('numbers lines, honours offset/limit and reports what is left', async () => {
    writeFileSync(join(root, 'a.txt'), Array.from({ length: 10 }, (_, i) => `line${i + 1}`).join('\n') + '\n');
    const r = await tools.read({ path: 'a.txt', offset: 2, limit: 3 });
    expect(r.content).toBe('00003| line3\n00004| line4\n00005| line5');
    expect(r).toMatchObject({ lines: 3, totalLines: 10, hasMore: true, offset: 2 });
    expect((await tools.read({ path: '/work/a.txt', numbered: false, offset: 9 })).content).toBe('line10');
  });

  it('refuses an offset past the end, a directory, a binary file and a missing file', async () => {
    writeFileSync(join(root, 'a.txt'), 'one\n');
    writeFileSync(join(root, 'bin'), Buffer.from([0x7f, 0x45, 0x4c, 0x46, 0, 1, 2]));
    mkdirSync(join(root, 'd'));
    expect(await codeOf(tools.read({ path: 'a.txt', offset: 5 }))).toBe('bad_request');
    expect(await codeOf(tools.read({ path: 'd' }))).toBe('is_a_directory');
    expect(await codeOf(tools.read({ path: 'bin' }))).toBe('binary_file');
    expect(await codeOf(tools.read({ path: 'nope.txt' }))).toBe('not_found');
  });

  it('cuts very long lines and refuses files above the size cap', async () => {
    writeFileSync(join(root, 'long.txt'), 'x'.repeat(5000) + '\n');
    const r = await tools.read({ path: 'long.txt' });
    expect(r.longLinesCut).toBe(1);
    const small = new FileTools(new Workspace(root), { maxFileBytes: 100 });
    expect(await codeOf(small.read({ path: 'long.txt' }))).toBe('too_large');
  });

  it('does not block on a FIFO', async () => {
    execFileSync('mkfifo', [join(root, 'pipe')]);
    expect(await codeOf(tools.read({ path: 'pipe' }))).toBe('bad_request');
  });
});

describe('confinement', () => {
  it('refuses ../, absolute paths outside /work and /proc tricks', async () => {
    for (const p of ['../secret.txt', 'a/../../secret.txt', '/etc/passwd', '/work/../etc/passwd', '/proc/self/root/etc/passwd', '/work2/x']) {
      expect(await codeOf(tools.read({ path: p })), p).toBe('outside_workspace');
      expect(await codeOf(tools.write({ path: p, content: 'x' })), p).toBe('outside_workspace');
    }
  });

  it('never follows a symlink out of the workspace, however it is built', async () => {
    symlinkSync(secret, join(root, 'abs-link'));
    symlinkSync('../secret.txt', join(root, 'rel-link'));
    symlinkSync('/proc/self/root/etc/passwd', join(root, 'proc-link'));
    symlinkSync('/work/../secret.txt', join(root, 'work-dotdot'));
    mkdirSync(join(root, 'd'));
    symlinkSync('../..', join(root, 'd', 'up2'));
    symlinkSync('rel-link', join(root, 'chain'));
    symlinkSync(join(base), join(root, 'dir-out'));
    for (const p of ['abs-link', 'rel-link', 'proc-link', 'work-dotdot', 'd/up2/secret.txt', 'chain', 'dir-out/x']) {
      expect(await codeOf(tools.read({ path: p })), p).toBe('outside_workspace');
    }
    // `..` is applied to the path as written, so this names d/secret.txt: absent, not an escape.
    expect(await codeOf(tools.read({ path: 'd/up2/../secret.txt' }))).toBe('not_found');
    // Writes through such links are refused too, and the target is untouched.
    expect(await codeOf(tools.write({ path: 'abs-link', content: 'pwned' }))).toBe('outside_workspace');
    expect(await codeOf(tools.write({ path: 'dir-out/new.txt', content: 'pwned' }))).toBe('outside_workspace');
    expect(await codeOf(tools.edit({ path: 'rel-link', oldString: 'TOP', newString: 'pwned' }))).toBe('outside_workspace');
    expect(await codeOf(tools.grep({ pattern: 'SECRET', path: 'abs-link' }))).toBe('outside_workspace');
    expect(await codeOf(tools.list({ path: 'dir-out' }))).toBe('outside_workspace');
    expect(readFileSync(secret, 'utf8')).toBe('TOP SECRET\n');
    expect(existsSync(join(base, 'new.txt'))).toBe(false);
  });

  it('follows symlinks that stay inside, and walks never leave through one', async () => {
    mkdirSync(join(root, 'real'));
    writeFileSync(join(root, 'real', 'f.txt'), 'inside\n');
    symlinkSync('real/f.txt', join(root, 'link'));
    symlinkSync('/work/real', join(root, 'abs-inside'));
    symlinkSync(base, join(root, 'out'));
    expect((await tools.read({ path: 'link', numbered: false })).content).toBe('inside');
    expect((await tools.read({ path: 'abs-inside/f.txt', numbered: false })).content).toBe('inside');
    const g = await tools.grep({ pattern: 'SECRET|inside' });
    expect(g.matches.map((m) => m.path)).toEqual(['real/f.txt']);
    const gl = await tools.glob({ pattern: '**/*.txt' });
    expect(gl.files).toEqual(['real/f.txt']);
  });

  it('refuses symlink loops', async () => {
    symlinkSync('b', join(root, 'a'));
    symlinkSync('a', join(root, 'b'));
    expect(await codeOf(tools.read({ path: 'a' }))).toBe('outside_workspace');
  });

  it('a hard link is just a file of the workspace (and cannot be made across mounts)', async () => {
    writeFileSync(join(root, 'orig'), 'x\n');
    linkSync(join(root, 'orig'), join(root, 'hard'));
    expect((await tools.read({ path: 'hard', numbered: false })).content).toBe('x');
  });
});

describe('write and edit', () => {
  it('writes atomically, creates parents, keeps the mode of a replaced file', async () => {
    const w = await tools.write({ path: 'x/y/z.txt', content: 'hello' });
    expect(w).toEqual({ path: 'x/y/z.txt', bytes: 5, created: true });
    writeFileSync(join(root, 'run.sh'), 'echo 1\n');
    chmodSync(join(root, 'run.sh'), 0o755);
    const w2 = await tools.write({ path: 'run.sh', content: 'echo 2\n' });
    expect(w2.created).toBe(false);
    expect(statSync(join(root, 'run.sh')).mode & 0o777).toBe(0o755);
    expect(readdirSync(root).filter((f) => f.includes('.hutch-'))).toEqual([]);
  });

  it('edit replaces exactly one match, or all with replaceAll, and says how many matched otherwise', async () => {
    writeFileSync(join(root, 'e.py'), 'a = 1\nb = 1\nc = 2\n');
    expect(await tools.edit({ path: 'e.py', oldString: 'c = 2', newString: 'c = 3' })).toMatchObject({ replacements: 1 });
    const multi = await tools.edit({ path: 'e.py', oldString: '= 1', newString: '= 9' }).catch((e) => e);
    expect(multi).toMatchObject({ code: 'multiple_matches', context: { matches: 2 } });
    expect(multi.message).toMatch(/2 times/);
    const none = await tools.edit({ path: 'e.py', oldString: 'zzz', newString: 'y' }).catch((e) => e);
    expect(none).toMatchObject({ code: 'no_match', context: { matches: 0 } });
    expect(await tools.edit({ path: 'e.py', oldString: '= 1', newString: '= $&$1', replaceAll: true })).toMatchObject({ replacements: 2 });
    expect(readFileSync(join(root, 'e.py'), 'utf8')).toBe('a = $&$1\nb = $&$1\nc = 3\n');
    expect(await codeOf(tools.edit({ path: 'e.py', oldString: 'a', newString: 'a' }))).toBe('bad_request');
  });

  it('an empty oldString creates a file but never clobbers one', async () => {
    expect(await tools.edit({ path: 'new.txt', oldString: '', newString: 'fresh' })).toMatchObject({ bytes: 5 });
    expect(await codeOf(tools.edit({ path: 'new.txt', oldString: '', newString: 'again' }))).toBe('already_exists');
    expect(readFileSync(join(root, 'new.txt'), 'utf8')).toBe('fresh');
  });

  it('a full disk fails the write cleanly and leaves the old content and no temp files', async () => {
    const mnt = join(base, `tiny${n}`);
    mkdirSync(mnt);
    execFileSync('mount', ['-t', 'tmpfs', '-o', 'size=256k', 'tmpfs', mnt]);
    try {
      const t = new FileTools(new Workspace(mnt));
      await t.write({ path: 'keep.txt', content: 'original' });
      expect(await codeOf(t.write({ path: 'keep.txt', content: Buffer.alloc(1024 * 1024, 1) }))).toBe('no_space');
      expect(readFileSync(join(mnt, 'keep.txt'), 'utf8')).toBe('original');
      expect(readdirSync(mnt)).toEqual(['keep.txt']);
    } finally {
      execFileSync('umount', [mnt]);
    }
  });

  it('refuses writing over a directory or the root', async () => {
    mkdirSync(join(root, 'dir'));
    expect(await codeOf(tools.write({ path: 'dir', content: 'x' }))).toBe('is_a_directory');
    expect(await codeOf(tools.write({ path: '.', content: 'x' }))).toBe('is_a_directory');
    writeFileSync(join(root, 'file'), 'x');
    expect(await codeOf(tools.write({ path: 'file/child', content: 'x' }))).toBe('not_a_directory');
  });
});

describe('glob, grep, list', () => {
  beforeEach(() => {
    for (const f of ['src/a.py', 'src/b.py', 'src/sub/c.py', 'README.md', 'node_modules/x/y.py', '.git/config', 'build/out.txt']) {
      mkdirSync(join(root, f, '..'), { recursive: true });
      writeFileSync(join(root, f), `content of ${f}\nTODO: fix ${f}\n`);
    }
  });

  it('glob matches with ripgrep semantics and skips .git and node_modules', async () => {
    expect((await tools.glob({ pattern: '**/*.py' })).files.sort()).toEqual(['src/a.py', 'src/b.py', 'src/sub/c.py']);
    expect((await tools.glob({ pattern: '*.py' })).files.sort()).toEqual(['src/a.py', 'src/b.py', 'src/sub/c.py']);
    expect((await tools.glob({ pattern: 'src/*.py' })).files.sort()).toEqual(['src/a.py', 'src/b.py']);
    expect((await tools.glob({ pattern: '*.{md,txt}' })).files.sort()).toEqual(['README.md', 'build/out.txt']);
    expect((await tools.glob({ pattern: '*.py', path: 'src/sub' })).files).toEqual(['src/sub/c.py']);
    expect((await tools.glob({ pattern: '**/*.py', limit: 2 })).truncated).toBe(true);
    expect(await codeOf(tools.glob({ pattern: '*', path: 'README.md' }))).toBe('not_a_directory');
  });

  it('grep over a directory of 150,000 empty files finds the one match (their answers overflowed the stack as spread arguments)', async () => {
    mkdirSync(join(root, 'many'));
    for (let i = 0; i < 150_000; i++) closeSync(openSync(join(root, 'many', `f${i}`), 'w'));
    writeFileSync(join(root, 'many', 'needle.txt'), 'hay\nneedle here\n');
    const r = await tools.grep({ pattern: 'needle here', path: 'many' });
    expect(r.matches).toEqual([{ path: 'many/needle.txt', line: 2, text: 'needle here' }]);
    expect(r.filesSearched).toBe(150_001);
  }, 120_000);

  it('grep finds lines by regex with include and limit, and rejects a bad regex', async () => {
    const r = await tools.grep({ pattern: 'TODO: fix src/.*\\.py', include: '*.py' });
    expect(r.matches.map((m) => `${m.path}:${m.line}`).sort()).toEqual(['src/a.py:2', 'src/b.py:2', 'src/sub/c.py:2']);
    expect((await tools.grep({ pattern: 'todo', ignoreCase: true, limit: 2 })).truncated).toBe(true);
    expect((await tools.grep({ pattern: 'content', path: 'README.md' })).matches).toHaveLength(1);
    expect(await codeOf(tools.grep({ pattern: '(unclosed' }))).toBe('bad_request');
  });

  it('list walks the tree, skipping ignored directories', async () => {
    const r = await tools.list({});
    const paths = r.entries.map((e) => e.path);
    expect(paths).toContain('src/sub/c.py');
    expect(paths.some((p) => p.startsWith('node_modules') || p.startsWith('.git') || p.startsWith('build'))).toBe(false);
    expect((await tools.list({ path: 'src', ignore: ['sub'] })).entries.map((e) => e.path)).toEqual(['a.py', 'b.py']);
  });

  it('glob patterns compile as documented', () => {
    expect(compileGlob('**/test_*.py')('tests/test_x.py')).toBe(true);
    expect(compileGlob('**/test_*.py')('test_x.py')).toBe(true);
    expect(compileGlob('src/**')('src/a/b')).toBe(true);
    expect(compileGlob('*.[ch]')('x/y.h')).toBe(true);
    expect(compileGlob('*.[!ch]')('y.h')).toBe(false);
    expect(() => compileGlob('{a,b')).toThrow(/unterminated/);
  });

  it('glob matching covers braces, classes, escapes and ** in the middle', () => {
    const cases: Array<[string, string, boolean]> = [
      ['src/**/*.ts', 'src/a.ts', true],
      ['src/**/*.ts', 'src/x/y/a.ts', true],
      ['src/**/*.ts', 'srcx/a.ts', false],
      ['a/**', 'a/b/c', true],
      ['a/**', 'b/a/c', false],
      ['*.{ts,{m,c}js}', 'x/y.mjs', true],
      ['*.{ts,{m,c}js}', 'y.js', false],
      ['{a,b}/*.py', 'b/c.py', true],
      ['{a,b}/*.py', 'c/b/c.py', false],
      ['src/*', 'src/a/b', false],
      ['?.txt', 'ab.txt', false],
      ['?.txt', 'é.txt', true],
      ['[a-c]x', 'bx', true],
      ['[!a-c]x', 'dx', true],
      ['[!a-c]x', 'ax', false],
      ['a[!x]b', 'a/b', false],
      ['[]]', ']', true],
      ['\\*.md', '*.md', true],
      ['\\*.md', 'a.md', false],
      ['}', '}', true],
      ['a,b', 'a,b', true],
      ['*', '', true],
      ['**', 'x/y/z', true],
      ['*a*a*a*a*a*a*a*a*a*a*a*a*c', 'a'.repeat(41), false],
      ['*a*a*a*a*a*a*a*a*a*a*a*a*c', `${'a'.repeat(40)}c`, true],
    ];
    for (const [g, name, want] of cases) expect(compileGlob(g)(name), `${g} vs ${name}`).toBe(want);
  });
});

describe('stat, mkdir, remove, move', () => {
  it('work inside and refuse what would escape or destroy the root', async () => {
    await tools.mkdir({ path: 'a/b', parents: true });
    expect(await codeOf(tools.mkdir({ path: 'a/b' }))).toBe('already_exists');
    await tools.write({ path: 'a/b/f', content: '1' });
    symlinkSync('/etc/passwd', join(root, 'l'));
    expect(await tools.stat({ path: 'l' })).toMatchObject({ type: 'symlink', target: '/etc/passwd' });
    expect(await codeOf(tools.move({ from: 'a', to: 'a/b/c' }))).toBe('bad_request');
    await tools.move({ from: 'a/b/f', to: 'g/h' });
    expect(readFileSync(join(root, 'g/h'), 'utf8')).toBe('1');
    expect(await codeOf(tools.remove({ path: 'a' }))).toBe('not_empty');
    await tools.remove({ path: 'a', recursive: true });
    await tools.remove({ path: 'l' }); // removes the link, not /etc/passwd
    expect(existsSync('/etc/passwd')).toBe(true);
    expect(await codeOf(tools.remove({ path: '.' , recursive: true }))).toBe('bad_request');
    expect(await codeOf(tools.move({ from: 'g/h', to: '../escaped' }))).toBe('outside_workspace');
  });
});
