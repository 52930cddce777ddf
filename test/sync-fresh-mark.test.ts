import { afterEach, describe, expect, it } from 'vitest';
import { mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startAgent, type AgentProcess } from './helpers/agent-process.ts';
import { Workspace } from '../guest-agent/src/workspace/confine.ts';
import { WorkspaceMirror } from '../host-broker/src/sync/workspace-mirror.ts';
import type { SyncEntry } from '../guest-agent/src/protocol/methods.ts';

/**
 * A wake's push into an empty /work takes its sync marker from what the agent recorded while
 * applying (no scan). That record must be exactly what a scan would have found: a path it
 * got wrong would come back on the next pull as a change the guest never made.
 */
async function changed(client: AgentProcess['client'], since: string): Promise<string[]> {
  const out: SyncEntry[] = [];
  await client.syncChanges({ since }, (b) => void out.push(...b.changes));
  return out.map((e) => `${e.kind}:${Buffer.from(e.path).toString()}`);
}

function project(): string {
  const dir = mkdtempSync(join(tmpdir(), 'hutch-fresh-'));
  mkdirSync(join(dir, 'src/lib'), { recursive: true });
  writeFileSync(join(dir, 'src/lib/a.py'), 'print(1)\n');
  writeFileSync(join(dir, 'src/main.py'), 'import lib\n');
  writeFileSync(join(dir, 'big.bin'), Buffer.alloc(300 * 1024, 7)); // streamed, not inline
  writeFileSync(join(dir, 'run.sh'), '#!/bin/sh\n', { mode: 0o755 });
  symlinkSync('src/main.py', join(dir, 'main-link'));
  mkdirSync(join(dir, 'empty'));
  return dir;
}

describe('a fresh push records its own sync marker', () => {
  let agent: AgentProcess | undefined;
  const dirs: string[] = [];
  afterEach(async () => {
    await agent?.stop();
    for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
  });

  it('into an empty /work: the marker is recorded, equals a scan, and sees later changes', async () => {
    agent = await startAgent();
    const host = project();
    dirs.push(host);
    const pushed = await new WorkspaceMirror(new Workspace(host)).push(agent.client, undefined, { fresh: true, mark: true });
    expect(pushed.marker?.markedBy).toBe('recorded');
    expect(pushed.marker?.entries).toBe(8);
    const scanned = await agent.client.call('sync.mark', {});
    expect(scanned.entries).toBe(pushed.marker?.entries);
    const marker = pushed.marker?.marker as string;
    expect(await changed(agent.client, marker)).toEqual([]);
    writeFileSync(join(agent.root, 'src/main.py'), 'import lib  # edited\n');
    writeFileSync(join(agent.root, 'new.txt'), 'x');
    expect((await changed(agent.client, marker)).sort()).toEqual(['file:new.txt', 'file:src/main.py']);
  });

  it('into a /work that is not empty: the agent scans instead, and nothing already there looks new', async () => {
    agent = await startAgent();
    writeFileSync(join(agent.root, 'left-behind.txt'), 'from before');
    const host = project();
    dirs.push(host);
    const pushed = await new WorkspaceMirror(new Workspace(host)).push(agent.client, undefined, { fresh: true, mark: true });
    expect(pushed.marker?.markedBy).toBe('scan');
    expect(pushed.marker?.entries).toBe(9);
    expect(await changed(agent.client, pushed.marker?.marker as string)).toEqual([]);
  });

  it('a name a scan skips (an in-flight temp file, and all under one) stays out of the record as out of a scan; a fresh push into a non-empty /work scans', async () => {
    agent = await startAgent();
    const b = (x: string) => Buffer.from(x);
    const r = await agent.client.syncApply(
      [
        { op: 'mkdir', path: b('d'), mode: 0o755 },
        { op: 'write', path: b('d/.x.hutch-abcdef.tmp'), mode: 0o644, data: b('looks like ours') },
        { op: 'mkdir', path: b('d/.t.hutch-abcdef.tmp'), mode: 0o755 },
        { op: 'write', path: b('d/.t.hutch-abcdef.tmp/inner.txt'), mode: 0o644, data: b('under a temp name') },
        { op: 'write', path: b('d/kept.txt'), mode: 0o644, data: b('k') },
      ],
      { fresh: true, mark: true },
    );
    expect(r.failed).toEqual([]);
    expect(r.markedBy).toBe('recorded');
    expect(r.entries).toBe(2);
    expect((await agent.client.call('sync.mark', {})).entries).toBe(2);
    expect(await changed(agent.client, r.marker as string)).toEqual([]);
    const d = await agent.client.syncApply([{ op: 'delete', path: b('d/kept.txt') }], { fresh: true, mark: true });
    expect(d.markedBy).toBe('scan');
    expect(await changed(agent.client, d.marker as string)).toEqual([]);
  });

  it('an empty workspace still gets a marker, and a push without mark gets none', async () => {
    agent = await startAgent();
    const host = mkdtempSync(join(tmpdir(), 'hutch-fresh-'));
    dirs.push(host);
    const pushed = await new WorkspaceMirror(new Workspace(host)).push(agent.client, undefined, { fresh: true, mark: true });
    expect(pushed.marker).toMatchObject({ entries: 0, markedBy: 'recorded' });
    writeFileSync(join(agent.root, 'later.txt'), 'x');
    expect(await changed(agent.client, pushed.marker?.marker as string)).toEqual(['file:later.txt']);
    writeFileSync(join(host, 'b.txt'), 'y');
    const m = new WorkspaceMirror(new Workspace(host));
    expect((await m.push(agent.client)).marker).toBeUndefined();
  });

  it('files land in place (no temporary names) with the host\'s content, mode and mtime; a name met twice takes the general path and the record still holds', async () => {
    agent = await startAgent();
    const b = (x: string) => Buffer.from(x);
    const mtimeMs = Date.UTC(2024, 0, 2, 3, 4, 5, 678);
    const r = await agent.client.syncApply(
      [
        // The file first: its parent is created on the way, so the mkdir after it finds the name taken.
        { op: 'write', path: b('p/q.txt'), mode: 0o640, mtimeMs, data: b('content of q') },
        { op: 'mkdir', path: b('p'), mode: 0o751 },
        { op: 'write', path: b('x.sh'), mode: 0o755, mtimeMs, data: b('#!/bin/sh\n') },
        // Written twice in one push: the second lands over the first (atomically, by the general path).
        { op: 'write', path: b('twice.txt'), mode: 0o644, data: b('one') },
        { op: 'write', path: b('twice.txt'), mode: 0o600, data: b('two') },
      ],
      { fresh: true, mark: true },
    );
    expect(r.failed).toEqual([]);
    expect(r.markedBy).toBe('recorded');
    expect(readFileSync(join(agent.root, 'p/q.txt'), 'utf8')).toBe('content of q');
    expect(readFileSync(join(agent.root, 'twice.txt'), 'utf8')).toBe('two');
    const st = statSync(join(agent.root, 'p/q.txt'));
    expect(st.mode & 0o7777).toBe(0o640);
    expect(Math.round(st.mtimeMs)).toBe(mtimeMs);
    expect(statSync(join(agent.root, 'p')).mode & 0o7777).toBe(0o751);
    expect(statSync(join(agent.root, 'x.sh')).mode & 0o7777).toBe(0o755);
    expect(statSync(join(agent.root, 'twice.txt')).mode & 0o7777).toBe(0o600);
    expect(readdirSync(agent.root).sort()).toEqual(['p', 'twice.txt', 'x.sh']);
    // The record is what a scan finds: nothing comes back as changed.
    expect(r.entries).toBe(4);
    expect(await changed(agent.client, r.marker as string)).toEqual([]);
  });
});
