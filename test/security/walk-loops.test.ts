import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { execFileSync } from 'node:child_process';
import { closeSync, mkdirSync, mkdtempSync, openSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { HutchError } from '../../guest-agent/src/protocol/errors.ts';
import { WALK_MAX_DEPTH } from '../../guest-agent/src/workspace/answer-bounds.ts';
import { Workspace } from '../../guest-agent/src/workspace/confine.ts';
import { FileTools } from '../../guest-agent/src/workspace/file-tools.ts';
import { initRouter, routeCommand } from '../../host-broker/src/router/index.ts';
import type { Hutch, Sandbox } from '../../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/**
 * Issue 38, item 4: with `a -> .` in the workspace, fast-path `grep -r` and `find -L` ran
 * until the client gave up at 60 s; `list` on a 10,000-deep chain had not answered after
 * 120 s. GNU tools stop at a link back into a directory they are in, but not at a fan-out
 * of links (each level's `x` and `y` both naming the next: 2^40 paths from 40 directories):
 * the forms that follow links while they walk now go to the VM, a fast-path command stops
 * at the fast path's own time (a typed `timeout`, well before a client's 60 s), and the file
 * tools' walks stop at a depth and an entry budget with an answer that says so.
 */

/** Directories l0..l{n}: l{i}/x and l{i}/y both link to l{i+1}, so l0 reaches l{n} by 2^n paths. */
function linkFanOut(dir: string, n: number): void {
  for (let i = 0; i <= n; i++) mkdirSync(join(dir, `l${i}`));
  for (let i = 0; i < n; i++) for (const l of ['x', 'y']) symlinkSync(`../l${i + 1}`, join(dir, `l${i}`, l));
  writeFileSync(join(dir, `l${n}`, 'f.txt'), 'deep\n');
}

/** A chain of `depth` directories named `d` under `dir`, made one mkdir and chdir at a time as a tenant would. */
function chain(dir: string, depth: number, leaves: Record<number, string> = {}): void {
  const files = JSON.stringify(leaves);
  execFileSync('python3', ['-c', `import os, json\nos.chdir(${JSON.stringify(dir)})\nleaves = {int(k): v for k, v in json.loads(${JSON.stringify(files)}).items()}\nfor i in range(1, ${depth} + 1):\n    os.mkdir('d'); os.chdir('d')\n    if i in leaves: open(leaves[i], 'w').write('deep\\n')`]);
}

const FOLLOWING = [
  'grep -R needle .',
  'grep -rnR needle .',
  'egrep --dereference-recursive needle',
  'fgrep --deref needle .',
  'find -L . -name f.txt',
  'find -H -L l0',
  'find l0 -follow -name f.txt',
  'ls -RL l0',
  'ls -lR --dereference l0',
  'du -L l0',
  'du -shL l0',
  'cp -rL l0 copy',
  'cp -aL l0 copy',
  'cp --recursive --dereference l0 copy',
  'diff -r l0 l1',
  'diff --recursive l0 l1',
];
/** The same commands without following: they stay on the fast path. */
const NOT_FOLLOWING = ['grep -rn needle .', 'find . -name f.txt', 'find -H l0 -name f.txt', 'ls -R l0', 'ls -L l0', 'du -sh l0', 'du -D l0', 'cp -r l0 copy', 'cp -L l0/f.txt copy', 'diff -r --no-dereference l0 l1', 'diff l0/x l1/x'];

describe('symbolic link loops and fan-outs', () => {
  let b: TestBroker;
  let hutch: Hutch;
  let sb: Sandbox;
  beforeAll(async () => {
    await initRouter();
    b = await startBroker({ fastPathMaxMs: 1500 });
    hutch = await b.connect();
    sb = await hutch.create({ workspace: { files: { 'a.txt': 'needle\n' } } });
    const ws = join(b.dataDir, 'sessions', sb.id, 'workspace');
    linkFanOut(ws, 40);
    symlinkSync('.', join(ws, 'self'));
    execFileSync('mkfifo', [join(ws, 'pipe')]);
  }, 120_000);
  afterAll(async () => b?.stop());

  it('every command that follows links while it walks goes to the VM', () => {
    for (const c of FOLLOWING) expect(routeCommand(c), c).toMatchObject({ route: 'vm', code: 'option', reason: expect.stringContaining('follows symbolic links') });
  });

  it('the same commands without following stay on the fast path', () => {
    for (const c of NOT_FOLLOWING) expect(routeCommand(c).route, c).toBe('fastpath');
  });

  it('through the broker, find -L on a fan-out of 2^40 paths is routed to the VM', async () => {
    // unsafe-local runs the VM route in the same sandbox: the call ends at its own timeout there.
    const r = await sb.run('find -L l0 -name f.txt', { timeoutMs: 2000 });
    expect(r.route).toBe('vm');
    expect(r.reason).toContain('follows symbolic links');
  }, 60_000);

  it('a fast-path command that runs past the fast path time fails `timeout`, with what it printed', async () => {
    // A FIFO nobody writes: `cat` waits on it for as long as it is let.
    const err = await sb.run('echo before; cat pipe', { timeoutMs: 20_000 }).then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(HutchError);
    expect((err as HutchError).code).toBe('timeout');
    expect((err as HutchError).message).toContain("route: 'vm'");
    expect((err as HutchError).context).toMatchObject({ route: 'fastpath', limitMs: 1500, result: { stdout: 'before\n', timedOut: true } });
    // The caller's own, shorter, timeout still answers as before: a result that says it timed out.
    const own = await sb.run('cat pipe', { timeoutMs: 500 });
    expect([own.route, own.timedOut]).toEqual(['fastpath', true]);
  }, 60_000);

  it('the file tools never follow a link, and answer at once beside a loop and a fan-out', async () => {
    expect((await sb.files.list()).entries.map((e) => e.path)).toEqual(expect.arrayContaining(['self', 'l0/x', 'l0/y']));
    expect((await sb.files.glob('**/f.txt')).files).toEqual(['l40/f.txt']);
    expect((await sb.files.grep('deep')).matches).toEqual([{ path: 'l40/f.txt', line: 1, text: 'deep' }]);
  });
});

describe('deep trees', () => {
  let b: TestBroker;
  let hutch: Hutch;
  let sb: Sandbox;
  beforeAll(async () => {
    b = await startBroker();
    hutch = await b.connect();
    sb = await hutch.create({ workspace: { files: { 'a.txt': 'A\n' } } });
    const ws = join(b.dataDir, 'sessions', sb.id, 'workspace');
    mkdirSync(join(ws, 'chain'));
    chain(join(ws, 'chain'), 10_000, { 100: 'shallow.txt', [WALK_MAX_DEPTH + 50]: 'deep.txt' });
  }, 300_000);
  afterAll(async () => b?.stop());

  it('list of a 10,000-deep chain answers its first page with where to go on, and past the depth budget says so', async () => {
    const first = await sb.files.list('chain');
    expect(first.entries).toHaveLength(100);
    expect(first.entries[99]).toEqual({ path: Array.from({ length: 100 }, () => 'd').join('/'), type: 'dir' });
    expect([first.truncated, first.nextOffset, first.walkLimit]).toEqual([true, 100, undefined]);
    // Levels 1..WALK_MAX_DEPTH are listed (shallow.txt among them); the walk goes no deeper.
    const last = await sb.files.list('chain', { offset: WALK_MAX_DEPTH - 5 });
    expect(last.entries).toHaveLength(6);
    expect(last.entries.at(-1)?.path.split('/')).toHaveLength(WALK_MAX_DEPTH);
    expect([last.truncated, last.nextOffset, last.walkLimit]).toEqual([true, undefined, 'depth']);
  }, 60_000);

  it('glob and grep find what is within the depth budget, and say the walk stopped short', async () => {
    const g = await sb.files.glob('**/*.txt');
    expect(g.files.sort()).toEqual(['a.txt', `chain/${Array.from({ length: 100 }, () => 'd').join('/')}/shallow.txt`]);
    expect([g.truncated, g.walkLimit]).toEqual([true, 'depth']);
    const r = await sb.files.grep('deep');
    expect(r.matches.map((m) => m.path.split('/').at(-1))).toEqual(['shallow.txt']);
    expect([r.truncated, r.walkLimit]).toEqual([true, 'depth']);
  }, 60_000);

  it('a workspace of more entries than the walk budget gets an answer marked so, not a walk as long as the tree', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'hutch-walk-budget-'));
    try {
      mkdirSync(join(dir, 'wide'));
      for (let i = 0; i < 1500; i++) closeSync(openSync(join(dir, 'wide', `f${String(i).padStart(4, '0')}`), 'w'));
      writeFileSync(join(dir, 'wide', 'zz-needle.txt'), 'needle\n');
      const tools = new FileTools(new Workspace(dir), { walk: { maxEntries: 1000 } });
      const g = await tools.glob({ pattern: '**/*.txt' });
      expect([g.files, g.truncated, g.walkLimit]).toEqual([[], true, 'entries']);
      const r = await tools.grep({ pattern: 'needle' });
      expect([r.matches, r.truncated, r.walkLimit]).toEqual([[], true, 'entries']);
      const l = await tools.list({ ignore: ['f*'] });
      expect([l.entries.map((e) => e.path), l.truncated, l.walkLimit]).toEqual([['wide'], true, 'entries']);
      // Within the budget, the same tree is searched whole.
      const whole = new FileTools(new Workspace(dir), { walk: { maxEntries: 2000 } });
      expect(await whole.glob({ pattern: '**/*.txt' })).toEqual({ files: ['wide/zz-needle.txt'], truncated: false });
    } finally {
      execFileSync('rm', ['-rf', '--', dir]);
    }
  }, 60_000);
});
