import { afterEach, describe, expect, it } from 'vitest';
import { chmodSync, existsSync, mkdirSync, mkdtempSync, readFileSync, readlinkSync, rmSync, symlinkSync, unlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startAgent, type AgentProcess } from './helpers/agent-process.ts';
import { Workspace } from '../guest-agent/src/workspace/confine.ts';
import { WorkspaceMirror } from '../host-broker/src/sync/workspace-mirror.ts';
import type { SyncEntry } from '../guest-agent/src/protocol/methods.ts';

/**
 * Between two calls a guest can change /work on its own (a background server writing its
 * log) while the host changes it too (an edit tool). The next call pushes the host's
 * changes and takes a new sync marker; what the guest changed before that push must still
 * be pulled after the call, or it never reaches the host (the VM may be discarded later).
 */
async function changed(client: AgentProcess['client'], since: string): Promise<string[]> {
  const out: SyncEntry[] = [];
  await client.syncChanges({ since }, (b) => void out.push(...b.changes));
  return out.map((e) => `${e.kind}:${Buffer.from(e.path).toString()}`).sort();
}

function project(): string {
  const dir = mkdtempSync(join(tmpdir(), 'hutch-pushmark-'));
  mkdirSync(join(dir, 'src/lib'), { recursive: true });
  writeFileSync(join(dir, 'src/lib/a.py'), 'print(1)\n');
  writeFileSync(join(dir, 'src/main.py'), 'import lib\n');
  writeFileSync(join(dir, 'run.sh'), '#!/bin/sh\n', { mode: 0o755 });
  mkdirSync(join(dir, 'old/deep'), { recursive: true });
  writeFileSync(join(dir, 'old/deep/x.txt'), 'x');
  return dir;
}

describe('a push between calls keeps what the guest changed since the last pull', () => {
  let agent: AgentProcess | undefined;
  const dirs: string[] = [];
  afterEach(async () => {
    await agent?.stop();
    for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
  });

  async function started(): Promise<{ host: string; mirror: WorkspaceMirror; marker: string }> {
    agent = await startAgent();
    const host = project();
    dirs.push(host);
    const mirror = new WorkspaceMirror(new Workspace(host), undefined, { durable: false });
    const pushed = await mirror.push(agent.client, undefined, { fresh: true, mark: true });
    // A first call: the guest writes, the broker pulls.
    writeFileSync(join(agent.root, 'out.txt'), 'call 1');
    const pulled = await mirror.pull(agent.client, pushed.marker?.marker as string, 1 << 20);
    expect(readFileSync(join(host, 'out.txt'), 'utf8')).toBe('call 1');
    return { host, mirror, marker: pulled.marker };
  }

  it('host edits pushed with `since`: the marker builds on the last pull, the guest\'s own changes come back after the call', async () => {
    const { host, mirror, marker } = await started();
    const guest = agent as AgentProcess;
    // The guest, between calls: a log appears, a file changes, one goes away.
    writeFileSync(join(guest.root, 'server.log'), 'listening on :8000\n');
    writeFileSync(join(guest.root, 'out.txt'), 'rewritten by a background job');
    unlinkSync(join(guest.root, 'run.sh'));
    // The host, between calls: an edit, a new directory, a removed tree.
    writeFileSync(join(host, 'src/lib/a.py'), 'print(2)\n');
    mkdirSync(join(host, 'new'));
    writeFileSync(join(host, 'new/n.txt'), 'n');
    rmSync(join(host, 'old'), { recursive: true });
    const pushed = await mirror.push(guest.client, ['src/lib/a.py', 'new', 'old'], { mark: true, markOnlyIfSent: true, since: marker });
    expect(pushed.sent).toBe(4); // old removed, new, new/n.txt, a.py
    expect(pushed.marker?.markedBy).toBe('recorded');
    // What the host pushed is not a guest change; what the guest did is.
    expect(await changed(guest.client, pushed.marker?.marker as string)).toEqual(['deleted:run.sh', 'file:out.txt', 'file:server.log']);
    // The record equals what a scan finds now, apart from those three.
    const scanned = await guest.client.call('sync.mark', {});
    expect(pushed.marker?.entries).toBe(scanned.entries); // run.sh gone, server.log new: the same count
    const after = await mirror.pull(guest.client, pushed.marker?.marker as string, 1 << 20);
    expect(after.stats.errors).toEqual([]);
    expect(readFileSync(join(host, 'server.log'), 'utf8')).toBe('listening on :8000\n');
    expect(readFileSync(join(host, 'out.txt'), 'utf8')).toBe('rewritten by a background job');
    expect(existsSync(join(host, 'run.sh'))).toBe(false);
    expect(readFileSync(join(host, 'src/lib/a.py'), 'utf8')).toBe('print(2)\n');
    expect(existsSync(join(host, 'old'))).toBe(false);
    expect(await changed(guest.client, after.marker)).toEqual([]);
  });

  it('a host change the guest already has sends nothing and takes no marker: the last pull\'s marker still sees the guest\'s changes', async () => {
    const { host, mirror, marker } = await started();
    const guest = agent as AgentProcess;
    writeFileSync(join(guest.root, 'server.log'), 'up\n');
    // The watcher saw the pull's own write of out.txt: the host has what the guest has.
    const pushed = await mirror.push(guest.client, ['out.txt'], { mark: true, markOnlyIfSent: true, since: marker });
    expect(pushed.sent).toBe(0);
    expect(pushed.marker).toBeUndefined();
    expect(await changed(guest.client, marker)).toEqual(['file:server.log']);
    expect(existsSync(join(host, 'server.log'))).toBe(false);
  });

  it('a directory the host replaced by a file leaves nothing of its tree in the record', async () => {
    const { host, mirror, marker } = await started();
    const guest = agent as AgentProcess;
    rmSync(join(host, 'src/lib'), { recursive: true });
    writeFileSync(join(host, 'src/lib'), 'now a file\n');
    const pushed = await mirror.push(guest.client, ['src/lib'], { mark: true, markOnlyIfSent: true, since: marker });
    expect(pushed.marker?.markedBy).toBe('recorded');
    expect(readFileSync(join(guest.root, 'src/lib'), 'utf8')).toBe('now a file\n');
    expect(await changed(guest.client, pushed.marker?.marker as string)).toEqual([]);
    // The same without a delete first: a write straight over a directory replaces its tree.
    const direct = await guest.client.syncApply([{ op: 'write', path: Buffer.from('old'), mode: 0o644, data: Buffer.from('flat\n') }], { since: pushed.marker?.marker as string, mark: true });
    expect({ failed: direct.failed, markedBy: direct.markedBy }).toEqual({ failed: [], markedBy: 'recorded' });
    expect(await changed(guest.client, direct.marker as string)).toEqual([]);
  });

  it('a push that removes many directories (or removes one and fills it again) still records its marker, in one pass', async () => {
    const { host, mirror, marker } = await started();
    const guest = agent as AgentProcess;
    // A tenant can make the host side remove any number of directories before a call.
    for (let i = 0; i < 200; i++) {
      mkdirSync(join(host, `many/d${i}/sub`), { recursive: true });
      writeFileSync(join(host, `many/d${i}/sub/f.txt`), `${i}`);
    }
    const made = await mirror.push(guest.client, ['many'], { mark: true, markOnlyIfSent: true, since: marker });
    expect(made.marker?.markedBy).toBe('recorded');
    const paths = Array.from({ length: 200 }, (_, i) => `many/d${i}`);
    for (const p of paths) rmSync(join(host, p), { recursive: true });
    // One of them comes back with other contents; src/lib is replaced the same way.
    mkdirSync(join(host, 'many/d7'));
    writeFileSync(join(host, 'many/d7/new.txt'), 'new');
    rmSync(join(host, 'src/lib'), { recursive: true });
    mkdirSync(join(host, 'src/lib'));
    writeFileSync(join(host, 'src/lib/b.py'), 'print(3)\n');
    writeFileSync(join(guest.root, 'bg.txt'), 'written by the guest meanwhile');
    const removed = await mirror.push(guest.client, [...paths, 'src/lib'], { mark: true, markOnlyIfSent: true, since: made.marker?.marker as string });
    expect(removed.marker?.markedBy).toBe('recorded');
    // Nothing of the removed trees is left in the record; the guest's own write still shows.
    expect(await changed(guest.client, removed.marker?.marker as string)).toEqual(['file:bg.txt']);
    expect(readFileSync(join(guest.root, 'many/d7/new.txt'), 'utf8')).toBe('new');
    expect(existsSync(join(guest.root, 'many/d7/sub'))).toBe(false);
    expect(existsSync(join(guest.root, 'src/lib/a.py'))).toBe(false);
  });

  it('an entry a background process changed under the push is recorded as unknown: it and everything else the guest changed is still pulled', async () => {
    const { host, mirror, marker } = await started();
    const guest = agent as AgentProcess;
    // Between the pull and the push a background job writes a log and swaps run.sh for a link;
    // the host meanwhile only changes run.sh's mode, which the push applies as a chmod.
    writeFileSync(join(guest.root, 'bg.log'), 'job done\n');
    unlinkSync(join(guest.root, 'run.sh'));
    symlinkSync('src/main.py', join(guest.root, 'run.sh'));
    chmodSync(join(host, 'run.sh'), 0o700);
    const pushed = await guest.client.syncApply([{ op: 'chmod', path: Buffer.from('run.sh'), mode: 0o700 }], { since: marker, mark: true });
    expect(pushed.failed).toEqual([]);
    // A scan here would have taken bg.log as the baseline: it would never reach the host.
    expect(pushed.markedBy).toBe('recorded');
    expect(await changed(guest.client, pushed.marker as string)).toEqual(['file:bg.log', 'symlink:run.sh']);
    const after = await mirror.pull(guest.client, pushed.marker as string, 1 << 20);
    expect(after.stats.errors).toEqual([]);
    expect(readFileSync(join(host, 'bg.log'), 'utf8')).toBe('job done\n');
    expect(readlinkSync(join(host, 'run.sh'))).toBe('src/main.py');
    expect(await changed(guest.client, after.marker)).toEqual([]);
  });

  it('a file the guest rewrote since the pull, then chmod-ed by a push, still comes back with the guest\'s content', async () => {
    const { host, mirror, marker } = await started();
    const guest = agent as AgentProcess;
    writeFileSync(join(guest.root, 'out.txt'), 'rewritten by a background job, longer');
    // A chmod changes only the mode: the record must not take the rewritten file as pushed.
    const pushed = await guest.client.syncApply([{ op: 'chmod', path: Buffer.from('out.txt'), mode: 0o600 }], { since: marker, mark: true });
    expect({ failed: pushed.failed, markedBy: pushed.markedBy }).toEqual({ failed: [], markedBy: 'recorded' });
    expect(await changed(guest.client, pushed.marker as string)).toEqual(['file:out.txt']);
    const pulled = await mirror.pull(guest.client, pushed.marker as string, 1 << 20);
    expect(readFileSync(join(host, 'out.txt'), 'utf8')).toBe('rewritten by a background job, longer');
    // A chmod of an entry the guest left alone is recorded as pushed: nothing to pull.
    const again = await guest.client.syncApply([{ op: 'chmod', path: Buffer.from('src/main.py'), mode: 0o600 }], { since: pulled.marker, mark: true });
    expect(again.markedBy).toBe('recorded');
    expect(await changed(guest.client, again.marker as string)).toEqual([]);
  });

  it('an entry gone under the push is pulled as deleted, and a directory in doubt keeps its tree compared entry by entry', async () => {
    const { host, mirror, marker } = await started();
    const guest = agent as AgentProcess;
    // The guest removes src/lib's file and replaces the tree's root by a file of its own; the host chmods both.
    rmSync(join(guest.root, 'src/lib'), { recursive: true });
    writeFileSync(join(guest.root, 'src/lib'), 'a file now\n');
    unlinkSync(join(guest.root, 'src/main.py'));
    const pushed = await guest.client.syncApply(
      [
        { op: 'chmod', path: Buffer.from('src/lib'), mode: 0o750 },
        { op: 'chmod', path: Buffer.from('src/main.py'), mode: 0o600 },
      ],
      { since: marker, mark: true },
    );
    // chmod of a name that is gone fails the entry (and so the call): the record is dropped, as before.
    expect(pushed.failed.map((f) => Buffer.from(f.path).toString())).toEqual(['src/main.py']);
    expect(pushed.markedBy).toBe('scan');
    // Without the failing entry the record stays: the directory turned file is pulled, its old file deleted.
    const second = await guest.client.syncApply([{ op: 'chmod', path: Buffer.from('src/lib'), mode: 0o640 }], { since: marker, mark: true });
    expect({ failed: second.failed, markedBy: second.markedBy }).toEqual({ failed: [], markedBy: 'recorded' });
    expect(await changed(guest.client, second.marker as string)).toEqual(['deleted:src/lib/a.py', 'deleted:src/main.py', 'file:src/lib']);
    const after = await mirror.pull(guest.client, second.marker as string, 1 << 20);
    expect(after.stats.errors).toEqual([]);
    expect(readFileSync(join(host, 'src/lib'), 'utf8')).toBe('a file now\n');
    expect(existsSync(join(host, 'src/main.py'))).toBe(false);
  });

  it('an unknown `since` marker falls back to a scan (the marker is still right for what was pushed)', async () => {
    const { host, mirror } = await started();
    const guest = agent as AgentProcess;
    writeFileSync(join(host, 'src/main.py'), 'import lib  # host\n');
    const pushed = await mirror.push(guest.client, ['src/main.py'], { mark: true, markOnlyIfSent: true, since: 'feedfacefeedface' });
    expect(pushed.marker?.markedBy).toBe('scan');
    expect(await changed(guest.client, pushed.marker?.marker as string)).toEqual([]);
  });
});
