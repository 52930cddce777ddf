import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { lstatSync, mkdirSync, readFileSync, readlinkSync, statSync, symlinkSync, unlinkSync, writeFileSync, existsSync } from 'node:fs';
import { randomBytes, createHash } from 'node:crypto';
import { join } from 'node:path';
import { startAgent, type AgentProcess } from './helpers/agent-process.ts';
import type { SyncEntry, SyncSkipped } from '../guest-agent/src/protocol/methods.ts';

const sha = (b: Uint8Array) => createHash('sha256').update(b).digest('hex');
/** Sync paths and symlink targets are bytes on the wire. */
const b = (s: string) => Buffer.from(s);
const str = (u: Uint8Array | undefined) => (u ? Buffer.from(u).toString() : undefined);

/** Collects a whole change set from the stream (tests only: the mirror consumes it batch by batch). */
async function changesSince(client: AgentProcess['client'], since: string, inlineMaxBytes?: number) {
  const changes: SyncEntry[] = [];
  const skipped: SyncSkipped[] = [];
  const r = await client.syncChanges({ since, ...(inlineMaxBytes !== undefined ? { inlineMaxBytes } : {}) }, (batch) => {
    changes.push(...batch.changes);
    skipped.push(...batch.skipped);
  });
  return { ...r, changes, skippedEntries: skipped };
}

describe('workspace sync through the agent', () => {
  let agent: AgentProcess;
  beforeAll(async () => {
    agent = await startAgent();
  });
  afterAll(async () => agent.stop());

  it('applies a batch: writes (inline and streamed), dirs, symlinks stored verbatim, chmod, deletes', async () => {
    const big = randomBytes(3 * 1024 * 1024 + 17);
    writeFileSync(join(agent.root, 'doomed.txt'), 'bye');
    const r = await agent.client.syncApply([
      { op: 'mkdir', path: b('pkg'), mode: 0o755 },
      { op: 'write', path: b('pkg/a.py'), mode: 0o644, data: Buffer.from('print(1)\n'), mtimeMs: 1_700_000_000_000 },
      { op: 'write', path: b('pkg/deep/b.bin'), mode: 0o600, source: (async function* () { for (let o = 0; o < big.length; o += 65536) yield big.subarray(o, o + 65536); })() },
      { op: 'symlink', path: b('to-shadow'), target: b('/etc/shadow') },
      { op: 'symlink', path: b('pkg/rel'), target: b('a.py') },
      { op: 'write', path: b('run.sh'), mode: 0o644, data: Buffer.from('#!/bin/sh\n') },
      { op: 'chmod', path: b('run.sh'), mode: 0o755 },
      { op: 'delete', path: b('doomed.txt') },
      { op: 'delete', path: b('never-existed') },
    ]);
    expect(r.failed).toEqual([]);
    expect(r.applied).toBe(9);
    expect(readFileSync(join(agent.root, 'pkg/a.py'), 'utf8')).toBe('print(1)\n');
    expect(statSync(join(agent.root, 'pkg/a.py')).mtimeMs).toBe(1_700_000_000_000);
    expect(sha(readFileSync(join(agent.root, 'pkg/deep/b.bin')))).toBe(sha(big));
    expect(statSync(join(agent.root, 'pkg/deep/b.bin')).mode & 0o777).toBe(0o600);
    expect(readlinkSync(join(agent.root, 'to-shadow'))).toBe('/etc/shadow');
    expect(statSync(join(agent.root, 'run.sh')).mode & 0o777).toBe(0o755);
    expect(existsSync(join(agent.root, 'doomed.txt'))).toBe(false);
  });

  it('never writes through a symlink planted in the workspace', async () => {
    const outside = join(agent.dir, 'outside');
    mkdirSync(outside);
    symlinkSync(outside, join(agent.root, 'trap'));
    writeFileSync(join(agent.dir, 'victim.txt'), 'safe');
    symlinkSync(join(agent.dir, 'victim.txt'), join(agent.root, 'victim-link'));
    const r = await agent.client.syncApply([
      { op: 'write', path: b('trap/evil.txt'), mode: 0o644, data: Buffer.from('evil') },
      { op: 'write', path: b('victim-link'), mode: 0o644, data: Buffer.from('overwritten?') },
      { op: 'delete', path: b('trap') },
      { op: 'write', path: b('../escape.txt'), mode: 0o644, data: Buffer.from('x') },
    ]);
    expect(r.failed.map((f) => [f.index, f.code])).toEqual([[0, 'outside_workspace'], [3, 'outside_workspace']]);
    expect(str(r.failed[0]?.path)).toBe('trap/evil.txt');
    // The link itself was replaced by a file; its old target is untouched.
    expect(readFileSync(join(agent.dir, 'victim.txt'), 'utf8')).toBe('safe');
    expect(lstatSync(join(agent.root, 'victim-link')).isFile()).toBe(true);
    expect(existsSync(join(outside, 'evil.txt'))).toBe(false);
    expect(existsSync(outside)).toBe(true); // deleting the link removed the link only
    expect(existsSync(join(agent.dir, 'escape.txt'))).toBe(false);
  });

  it('reports changes since a marker: new, modified, deleted, type changes, with small content inline', async () => {
    const { marker } = await agent.client.call('sync.mark', {});
    const run = await agent.client.run({
      command: 'echo new > created.txt && echo more >> pkg/a.py && rm -r pkg/deep && mkdir -p out/x && echo r > out/x/r.txt && ln -s created.txt lnk && head -c 200000 /dev/urandom > out/big.bin && rm run.sh && mkdir run.sh',
    });
    expect(run.exitCode).toBe(0);
    const ch = await changesSince(agent.client, marker, 1024);
    const byPath = new Map(ch.changes.map((c) => [str(c.path) as string, c]));
    expect(byPath.get('created.txt')).toMatchObject({ kind: 'file', size: 4 });
    expect(Buffer.from(byPath.get('created.txt')?.data ?? []).toString()).toBe('new\n');
    expect(byPath.get('pkg/a.py')?.kind).toBe('file');
    expect(byPath.get('pkg/deep')?.kind).toBe('deleted');
    expect(byPath.has('pkg/deep/b.bin')).toBe(false); // implied by its directory
    expect(byPath.get('lnk')?.kind).toBe('symlink');
    expect(str(byPath.get('lnk')?.target)).toBe('created.txt');
    expect(byPath.get('out/big.bin')?.data).toBeUndefined(); // above inlineMaxBytes: fetch with sync.read
    expect(byPath.get('run.sh')?.kind).toBe('dir');
    // Deletions come first, then parents before children.
    const order = ch.changes.map((c) => str(c.path));
    expect(order.indexOf('pkg/deep')).toBeLessThan(order.indexOf('created.txt'));
    expect(order.indexOf('out')).toBeLessThan(order.indexOf('out/x/r.txt'));
    // A fresh marker: no changes now.
    const again = await changesSince(agent.client, ch.marker);
    expect(again.changes).toEqual([]);

    const parts: Uint8Array[] = [];
    const bytes = await agent.client.syncRead('out/big.bin', (c) => void parts.push(c));
    expect(bytes).toBe(200_000);
    expect(sha(Buffer.concat(parts))).toBe(sha(readFileSync(join(agent.root, 'out/big.bin'))));
  });

  it('refuses an unknown marker and reading a symlink as content', async () => {
    await expect(changesSince(agent.client, 'nope')).rejects.toMatchObject({ code: 'not_found' });
    await expect(agent.client.syncRead('lnk', () => undefined)).rejects.toMatchObject({ code: 'bad_request' });
    unlinkSync(join(agent.root, 'lnk'));
  });
});
