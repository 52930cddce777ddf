import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, renameSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createLogger } from '../../guest-agent/src/log.ts';
import { HutchError } from '../../guest-agent/src/protocol/errors.ts';
import { WORKSPACE_PATH_MAX_BYTES } from '../../guest-agent/src/workspace/names.ts';
import { walk } from '../../guest-agent/src/workspace/walk.ts';
import { Workspace } from '../../guest-agent/src/workspace/confine.ts';
import { FileTools } from '../../guest-agent/src/workspace/file-tools.ts';
import type { Hutch } from '../../host-broker/src/sdk/index.ts';
import { measureWorkspace } from '../../host-broker/src/sessions/workspace-quota.ts';
import { HostChangeTracker, MAX_WATCHED_DEPTH } from '../../host-broker/src/sync/host-changes.ts';
import { WatchBudget } from '../../host-broker/src/sync/watch-budget.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';
import { waitFor } from '../helpers/wait-for.ts';

/**
 * A tenant can make a tree far deeper than any path can name: mkdir and chdir, one level
 * at a time, from the fast path or inside its VM (a chain of 100,000 directories is within
 * the default entry quota). Before, every walk of the broker held one fd per level (the
 * broker's fds are every tenant's), paths past 4096 bytes failed the whole sync (every VM
 * call of the session failed from then on), and closing the session failed past PATH_MAX
 * (its directory stayed on the host disk).
 */

const DEPTH = 30_000;

/** A chain of `depth` directories named `a` under `dir`, made with relative names as a tenant would. */
function chain(dir: string, depth: number, leaf = 'f.txt'): void {
  execFileSync('python3', ['-c', `import os\nos.chdir(${JSON.stringify(dir)})\nfor _ in range(${depth}):\n    os.mkdir('a'); os.chdir('a')\nopen(${JSON.stringify(leaf)}, 'w').write('deep')`]);
}

const openFds = () => readdirSync('/proc/self/fd').length;
/** fs.rm and shutil.rmtree recurse per level (both overflow here); GNU rm walks by fds. */
const removeDeep = (d: string) => execFileSync('rm', ['-rf', '--', d]);

describe('a tree deeper than any path', () => {
  let dir: string;
  beforeAll(() => {
    dir = mkdtempSync(join(tmpdir(), 'hutch-deep-'));
    chain(dir, DEPTH);
  }, 120_000);
  afterAll(() => {
    if (dir) removeDeep(dir);
  });

  it('is walked with a bounded number of fds, listing only what a path can name', async () => {
    const before = openFds();
    let most = 0;
    let listed = 0;
    let longest = 0;
    for await (const e of walk(dir)) {
      listed++;
      longest = Math.max(longest, e.raw.length);
      if (listed % 256 === 0) most = Math.max(most, openFds() - before);
    }
    // `a` is 1 byte: level k's path is 2k - 1 bytes, so 2048 levels are nameable.
    expect(listed).toBe(2048);
    expect(longest).toBeLessThanOrEqual(WORKSPACE_PATH_MAX_BYTES);
    // One fd per level would be 2,048 here (and 30,000 with the quota's walk below).
    expect(most).toBeLessThanOrEqual(70);
    expect(openFds()).toBe(before);
  }, 120_000);

  it('is counted whole by the quota, with the same bound on fds', async () => {
    const before = openFds();
    const usage = await measureWorkspace(dir);
    expect(usage.files).toBe(DEPTH + 1);
    expect(usage.bytes).toBeGreaterThanOrEqual(DEPTH * 4096);
    expect(openFds()).toBe(before);
  }, 120_000);

  it('is removed by the remove tool with a bounded number of fds, and a symlink in it is removed, never followed', async () => {
    const d = mkdtempSync(join(tmpdir(), 'hutch-deep-rm-'));
    const outside = mkdtempSync(join(tmpdir(), 'hutch-deep-rm-outside-'));
    try {
      writeFileSync(join(outside, 'keep.txt'), 'keep');
      mkdirSync(join(d, 'ws'));
      chain(join(d, 'ws'), DEPTH);
      symlinkSync(outside, join(d, 'ws', 'a', 'a', 'out'));
      const tools = new FileTools(new Workspace(join(d, 'ws')));
      const before = openFds();
      let most = 0;
      const sampler = setInterval(() => (most = Math.max(most, openFds() - before)), 5);
      try {
        await tools.remove({ path: 'a', recursive: true });
      } finally {
        clearInterval(sampler);
      }
      expect(readdirSync(join(d, 'ws'))).toEqual([]);
      expect(readFileSync(join(outside, 'keep.txt'), 'utf8')).toBe('keep');
      expect(most).toBeLessThanOrEqual(8);
      expect(openFds()).toBe(before);
    } finally {
      removeDeep(d);
      removeDeep(outside);
    }
  }, 120_000);

  it('a directory moved under a walk that parked its parent ends the walk with a typed error, never a partial listing', async () => {
    const d = mkdtempSync(join(tmpdir(), 'hutch-deep-move-'));
    try {
      chain(d, 100);
      const twelve = join(d, ...Array.from({ length: 12 }, () => 'a'));
      let moved = false;
      const seen: string[] = [];
      const err = await (async () => {
        for await (const e of walk(d)) {
          seen.push(e.rel);
          // Deep below: the walk's fd for level 11 is parked. Level 12 goes to the top.
          if (!moved && e.rel.split('/').length === 90) {
            renameSync(twelve, join(d, 'moved'));
            moved = true;
          }
        }
      })().catch((e: unknown) => e);
      expect(moved).toBe(true);
      expect(err).toBeInstanceOf(HutchError);
      expect((err as HutchError).code).toBe('busy');
      expect((err as HutchError).message).toContain('moved');
      expect(seen.every((r) => r === 'a' || r.startsWith('a/'))).toBe(true);
    } finally {
      removeDeep(d);
    }
  }, 60_000);
});

describe('a session whose workspace is deeper than any path', () => {
  let b: TestBroker;
  let hutch: Hutch;
  beforeAll(async () => {
    b = await startBroker();
    hutch = await b.connect();
  }, 120_000);
  afterAll(async () => b?.stop());

  it('works on, and closes leaving nothing on the host disk', async () => {
    const sb = await hutch.create({ workspace: { files: { 'a.txt': 'A\n' } } });
    const ws = join(b.dataDir, 'sessions', sb.id, 'workspace');
    chain(ws, DEPTH);
    // The tools list and search what they can name; the leaf is deeper than any path.
    const list = await sb.files.list();
    expect(list.entries.map((e) => e.path)).toContain('a.txt');
    expect(list.entries.every((e) => Buffer.byteLength(e.path) <= WORKSPACE_PATH_MAX_BYTES)).toBe(true);
    expect((await sb.files.glob('**/f.txt')).files).toEqual([]);
    expect((await sb.run('cat a.txt')).stdout).toBe('A\n');
    await sb.close();
    expect(existsSync(join(b.dataDir, 'sessions', sb.id))).toBe(false);
    expect(readdirSync(join(b.dataDir, 'sessions'))).toEqual([]);
  }, 300_000);

  it('a close the previous broker did not finish is finished by the next one', async () => {
    const dataDir = mkdtempSync(join(tmpdir(), 'hutch-deep-restart-'));
    const first = await startBroker({ dataDir });
    await first.stop({ keepData: true });
    // What a broker killed in the middle of removing a session leaves.
    const aside = join(dataDir, 'sessions', '.removing-s-0123456789ab');
    mkdirSync(join(aside, 'workspace'), { recursive: true });
    chain(join(aside, 'workspace'), 5_000);
    const next = await startBroker({ dataDir });
    try {
      await waitFor(async () => !existsSync(aside), 120_000, 'the half-removed session dir gone');
      expect(await (await next.connect()).sessions()).toEqual([]);
    } finally {
      await next.stop();
    }
  }, 300_000);
});

describe('watching a workspace', () => {
  it('stops at its directory budget and then answers that everything may have changed, until watched again', async () => {
    const d = mkdtempSync(join(tmpdir(), 'hutch-watch-'));
    try {
      for (let i = 0; i < 60; i++) mkdirSync(join(d, `d${i}`));
      const t = new HostChangeTracker(d, createLogger({ name: 'test', level: 'error' }), 20);
      t.watch();
      await waitFor(async () => !t.watching, 30_000, 'the watcher giving up past 20 directories');
      expect(t.take()).toEqual({ kind: 'all' });
      // Still 'all' on every take while nothing is watched: each VM call scans.
      expect(t.take()).toEqual({ kind: 'all' });
      // The root counts as one.
      for (let i = 10; i < 60; i++) rmSync(join(d, `d${i}`), { recursive: true });
      t.watch();
      expect(t.watching).toBe(true);
      await new Promise((r) => setTimeout(r, 1000));
      expect(t.take()).toEqual({ kind: 'none' });
      mkdirSync(join(d, 'fresh'));
      await waitFor(async () => {
        const c = t.take();
        return c.kind === 'paths' && c.paths.includes('fresh');
      }, 30_000, 'the new directory reported');
      await t.close();
      expect(t.watching).toBe(false);
    } finally {
      rmSync(d, { recursive: true, force: true });
    }
  }, 60_000);
});

describe('watching a deep workspace', () => {
  it(`stops below ${MAX_WATCHED_DEPTH} levels and answers that everything may have changed; a shallower tree is watched`, async () => {
    const log = createLogger({ name: 'test', level: 'error' });
    const budget = new WatchBudget(10_000);
    const deep = mkdtempSync(join(tmpdir(), 'hutch-watch-deep-'));
    const shallow = mkdtempSync(join(tmpdir(), 'hutch-watch-shallow-'));
    try {
      chain(deep, MAX_WATCHED_DEPTH + 2);
      chain(shallow, MAX_WATCHED_DEPTH - 1);
      const t = new HostChangeTracker(deep, log, 1000, budget);
      t.watch();
      await waitFor(async () => !t.watching, 30_000, 'the watcher giving up past the depth');
      expect(t.take()).toEqual({ kind: 'all' });
      expect(budget.used).toBe(0);
      const s = new HostChangeTracker(shallow, log, 1000, budget);
      s.watch();
      await new Promise((r) => setTimeout(r, 1500));
      expect(s.watching).toBe(true);
      expect(s.take()).toEqual({ kind: 'none' });
      await s.close();
    } finally {
      removeDeep(deep);
      removeDeep(shallow);
    }
  }, 60_000);
});

describe('the broker-wide watch budget', () => {
  it('is shared: a workspace that finds it spent scans instead, and gets watched again once another gives its directories back', async () => {
    const budget = new WatchBudget(30);
    const log = createLogger({ name: 'test', level: 'error' });
    const made: string[] = [];
    const tree = (n: number) => {
      const d = mkdtempSync(join(tmpdir(), 'hutch-budget-'));
      for (let i = 0; i < n; i++) mkdirSync(join(d, `d${i}`));
      made.push(d);
      return d;
    };
    try {
      const first = new HostChangeTracker(tree(19), log, 1000, budget);
      first.watch();
      await waitFor(async () => budget.used === 20, 30_000, 'the first workspace charged');
      const second = new HostChangeTracker(tree(19), log, 1000, budget);
      second.watch();
      await waitFor(async () => !second.watching, 30_000, 'the second giving up on the spent budget');
      expect(second.take()).toEqual({ kind: 'all' });
      expect(budget.used).toBe(20);
      await first.close();
      expect(budget.used).toBe(0);
      second.watch();
      await waitFor(async () => budget.used === 20, 30_000, 'the second charged once there is room');
      expect(second.watching).toBe(true);
      await second.close();
      expect(budget.used).toBe(0);
    } finally {
      for (const d of made) rmSync(d, { recursive: true, force: true });
    }
  }, 60_000);
});
