import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { execFileSync } from 'node:child_process';
import { chmodSync, existsSync, lstatSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, readlinkSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Workspace } from '../guest-agent/src/workspace/confine.ts';
import { WorkspaceMirror } from '../host-broker/src/sync/workspace-mirror.ts';
import { startAgent, type AgentProcess } from './helpers/agent-process.ts';
import { countEntries, treeDigest } from './helpers/tree-digest.ts';

/** A host session layout (sessions/<id>/{workspace,state}) as the broker makes it. */
function hostSession(): { dir: string; root: string; stateDir: string; mirror: WorkspaceMirror } {
  const dir = mkdtempSync(join(tmpdir(), 'hutch-sync-host-'));
  const root = join(dir, 'workspace');
  const stateDir = join(dir, 'state');
  mkdirSync(root);
  mkdirSync(stateDir);
  return { dir, root, stateDir, mirror: new WorkspaceMirror(new Workspace(root), undefined, { stateDir }) };
}

const raw = (...parts: Array<string | number[] | Buffer>) => Buffer.concat(parts.map((p) => (typeof p === 'string' ? Buffer.from(p) : Buffer.from(p))));
const at = (root: string, rel: Buffer) => Buffer.concat([Buffer.from(root), Buffer.from('/'), rel]);
const names = (dir: string | Buffer) => (readdirSync(dir, { encoding: 'buffer' }) as Buffer[]).map((b) => b.toString('hex')).sort();

describe('workspace sync: names as bytes, typed errors, scale (real agent process)', () => {
  let agent: AgentProcess;
  let host: ReturnType<typeof hostSession>;
  beforeAll(async () => {
    agent = await startAgent();
    host = hostSession();
    await host.mirror.push(agent.client);
  });
  afterAll(async () => {
    await agent.stop();
    rmSync(host.dir, { recursive: true, force: true });
  });

  it('pulls names that are not UTF-8 with their exact bytes, and pushes them back into a fresh guest', async () => {
    const { marker } = await agent.client.call('sync.mark', {});
    const bad = raw('bad', [0xfe]);
    const dir = raw('d', [0xff, 0x80]);
    writeFileSync(at(agent.root, bad), 'odd name\n');
    mkdirSync(at(agent.root, dir));
    writeFileSync(at(agent.root, raw(dir, '/inner', [0xc3, 0x28])), 'inside\n');
    symlinkSync(raw('target-', [0xfe]), at(agent.root, raw('lnk', [0xfd])));
    writeFileSync(join(agent.root, 'caf\u00e9.txt'), 'utf8 name\n');

    const pulled = await host.mirror.pull(agent.client, marker, 1 << 20);
    expect(pulled.stats.errors).toEqual([]);
    expect(readFileSync(at(host.root, bad), 'utf8')).toBe('odd name\n');
    expect(readFileSync(at(host.root, raw(dir, '/inner', [0xc3, 0x28])), 'utf8')).toBe('inside\n');
    expect(readlinkSync(at(host.root, raw('lnk', [0xfd])), { encoding: 'buffer' }).equals(raw('target-', [0xfe]))).toBe(true);
    expect(readFileSync(join(host.root, 'caf\u00e9.txt'), 'utf8')).toBe('utf8 name\n');
    expect(names(host.root)).toEqual(names(agent.root));
    // The manifest keys the name by its surrogateescape string, which is what the API shows.
    expect(host.mirror.guestView?.has('bad\udcfe')).toBe(true);

    // A release kills the VM; the next wake pushes the host workspace into a fresh guest.
    const fresh = await startAgent();
    try {
      const m2 = new WorkspaceMirror(new Workspace(host.root), undefined, { stateDir: host.stateDir });
      await m2.push(fresh.client);
      expect(treeDigest(fresh.root)).toBe(treeDigest(host.root));
      expect(readFileSync(at(fresh.root, bad), 'utf8')).toBe('odd name\n');
    } finally {
      await fresh.stop();
    }
  });

  it('reports what it cannot carry as typed errors, and a later push keeps the guest copy', async () => {
    writeFileSync(join(host.root, 'grows.bin'), 'small on the host\n');
    await host.mirror.push(agent.client, ['grows.bin']);
    const { marker } = await agent.client.call('sync.mark', {});
    execFileSync('mkfifo', [join(agent.root, 'pipe')]);
    writeFileSync(join(agent.root, 'grows.bin'), Buffer.alloc(300_000, 1));
    writeFileSync(join(agent.root, 'fine.txt'), 'carried\n');

    const pulled = await host.mirror.pull(agent.client, marker, 100_000);
    const byPath = Object.fromEntries(pulled.stats.errors.map((e) => [e.path, e.code]));
    expect(byPath).toEqual({ pipe: 'unsupported_file_type', 'grows.bin': 'too_large' });
    for (const e of pulled.stats.errors) expect(e.message).toContain(e.path);
    expect(readFileSync(join(host.root, 'fine.txt'), 'utf8')).toBe('carried\n');
    expect(existsSync(join(host.root, 'pipe'))).toBe(false);
    // The host keeps its own version; nothing was half-written or deleted.
    expect(readFileSync(join(host.root, 'grows.bin'), 'utf8')).toBe('small on the host\n');

    // A full push (as after a restore from a slot) must not clobber or delete what the guest could not send.
    await host.mirror.push(agent.client);
    expect(lstatSync(join(agent.root, 'grows.bin')).size).toBe(300_000);
    expect(lstatSync(join(agent.root, 'pipe')).isFIFO()).toBe(true);
    // What only the guest holds is known (a release that kills the VM would lose it).
    expect([...host.mirror.unpulled].sort()).toEqual(['grows.bin', 'pipe']);
    const m2 = await agent.client.call('sync.mark', {});
    rmSync(join(agent.root, 'pipe'));
    await host.mirror.pull(agent.client, m2.marker, 100_000);
    expect([...host.mirror.unpulled]).toEqual(['grows.bin']);
  });

  it('carries a 100,000-file change set in bounded batches, and the session keeps working', { timeout: 900_000, tags: ['scale'] }, async () => {
    const { marker } = await agent.client.call('sync.mark', {});
    const N = 100_000;
    for (let d = 0; d < 100; d++) {
      const dir = join(agent.root, 'node_modules', `pkg-${d}`);
      mkdirSync(dir, { recursive: true });
      for (let f = 0; f < N / 100; f++) writeFileSync(join(dir, `file-${f}.js`), `module.exports = ${d * 1000 + f};\n`);
    }
    const pulled = await host.mirror.pull(agent.client, marker, 1 << 20);
    expect(pulled.stats.errors).toEqual([]);
    expect(pulled.stats.files).toBe(N);
    expect(countEntries(join(host.root, 'node_modules'))).toBe(N + 100);
    expect(readFileSync(join(host.root, 'node_modules/pkg-42/file-7.js'), 'utf8')).toBe('module.exports = 42007;\n');
    // The connection is healthy: later calls of the session work.
    expect((await agent.client.call('ping', {})).uptimeMs).toBeGreaterThan(0);
    const next = await agent.client.call('sync.mark', {});
    const again = await host.mirror.pull(agent.client, next.marker, 1 << 20);
    expect(again.stats.files).toBe(0);
    // The host's watcher reports every file the pull landed; the next push must see that
    // nothing differs (and in one scan: checking 100,000 paths one by one against a
    // 100,000-entry view would be quadratic).
    const landed = [...(host.mirror.guestView?.keys() ?? [])].filter((k) => k.startsWith('node_modules/'));
    expect(landed.length).toBe(N + 100);
    const echo = await host.mirror.push(agent.client, landed);
    expect({ files: echo.files, removed: echo.removed }).toEqual({ files: 0, removed: 0 });

    // And the other way: 100,000 files pushed into a fresh guest, in bounded batches.
    const fresh = await startAgent();
    try {
      const m2 = new WorkspaceMirror(new Workspace(host.root), undefined, { stateDir: host.stateDir });
      const pushed = await m2.push(fresh.client);
      expect(pushed.files).toBeGreaterThanOrEqual(N);
      expect(countEntries(join(fresh.root, 'node_modules'))).toBe(N + 100);
      expect(treeDigest(fresh.root)).toBe(treeDigest(host.root));
    } finally {
      await fresh.stop();
    }
    // Deleting them all in the guest comes back as one deletion of the directory.
    const m3 = await agent.client.call('sync.mark', {});
    rmSync(join(agent.root, 'node_modules'), { recursive: true });
    const del = await host.mirror.pull(agent.client, m3.marker, 1 << 20);
    expect(del.stats.deleted).toBe(1);
    expect(existsSync(join(host.root, 'node_modules'))).toBe(false);
  });

  it('leaves no staging directory behind, in the state dir or the workspace', () => {
    expect(readdirSync(host.stateDir)).toEqual([]);
    expect(readdirSync(host.root).filter((n) => n.includes('hutch'))).toEqual([]);
  });

  it('masks modes on the host: no setuid, setgid or sticky bit from the guest', async () => {
    const { marker } = await agent.client.call('sync.mark', {});
    writeFileSync(join(agent.root, 'rootsh'), '#!/bin/sh\nid\n');
    chmodSync(join(agent.root, 'rootsh'), 0o6755);
    mkdirSync(join(agent.root, 'shared'));
    chmodSync(join(agent.root, 'shared'), 0o3777);
    const pulled = await host.mirror.pull(agent.client, marker, 1 << 20);
    expect(pulled.stats.errors).toEqual([]);
    expect(lstatSync(join(host.root, 'rootsh')).mode & 0o7777).toBe(0o755);
    expect(lstatSync(join(host.root, 'shared')).mode & 0o7777).toBe(0o777);
  });
});

describe('sync.changes is bounded by progress, not by a total deadline', () => {
  // Deadlines at 0.3 of their size: sync.changes' idle limit is 6 s here, well above the
  // agent's 1 s keepalive even on a loaded two-core host.
  const deadlines = { scale: 0.3 };

  it('a slow consumer on the broker side is not a stuck guest; a stopped guest is, with a typed error', { timeout: 120_000 }, async () => {
    const agent = await startAgent({ client: { deadlines, deadAfterMs: 60_000 } });
    try {
      const { marker } = await agent.client.call('sync.mark', {});
      for (let i = 0; i < 1500; i++) writeFileSync(join(agent.root, `f${i}.txt`), Buffer.alloc(300, 97));
      // Staging on the host may take longer than the idle limit per batch: that time is the broker's.
      let batches = 0;
      const r = await agent.client.syncChanges({ since: marker }, async () => {
        batches++;
        await new Promise((res) => setTimeout(res, 7000));
      });
      expect(batches).toBeGreaterThan(1);
      expect(r.changes).toBe(1500);
      expect(r.entries).toBe(1500);

      // A guest that stops mid-stream (SIGSTOP) is unresponsive: a typed error, not a hang.
      const m2 = await agent.client.call('sync.mark', {});
      for (let i = 0; i < 1500; i++) writeFileSync(join(agent.root, `g${i}.txt`), Buffer.alloc(300, 98));
      let stopped = false;
      const failed = await agent.client
        .syncChanges({ since: m2.marker }, () => {
          if (!stopped) {
            stopped = true;
            agent.proc.kill('SIGSTOP');
          }
        })
        .then(
          () => undefined,
          (e: unknown) => e,
        );
      agent.proc.kill('SIGCONT');
      expect(failed).toMatchObject({ code: 'guest_unresponsive' });
    } finally {
      agent.proc.kill('SIGCONT');
      await agent.stop();
    }
  });
});
