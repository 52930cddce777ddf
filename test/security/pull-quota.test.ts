import { afterEach, describe, expect, it } from 'vitest';
import { execFileSync } from 'node:child_process';
import { existsSync, linkSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, symlinkSync, truncateSync, unlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startAgent, type AgentProcess } from '../helpers/agent-process.ts';
import { Workspace } from '../../guest-agent/src/workspace/confine.ts';
import { WorkspaceMirror } from '../../host-broker/src/sync/workspace-mirror.ts';
import { measureWorkspace } from '../../host-broker/src/sessions/workspace-quota.ts';

/**
 * What a guest's /work holds reaches the host only within bounds the tenant cannot move.
 * The guest's /work is sized to the session's quota, but what fits there is not what the
 * host stores: a file hard-linked N times there is N files on the host, and a sparse file is
 * written out in full. A pull stages at most the quota; past it the pull fails whole, typed,
 * the host workspace keeps what it had and the guest keeps its changes for a later pull.
 * (Before: 4 MB and 50 links in an 8 MiB-quota VM put 322 MB in the host workspace.)
 */
const KiB = 1024;
const MiB = 1024 * KiB;

describe('a pull stages at most the workspace quota', () => {
  let agent: AgentProcess | undefined;
  const dirs: string[] = [];
  afterEach(async () => {
    await agent?.stop();
    agent = undefined;
    for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
  });

  async function started(): Promise<{ host: string; state: string; guest: AgentProcess; mirror: WorkspaceMirror; marker: string }> {
    const guest = (agent = await startAgent());
    const base = mkdtempSync(join(tmpdir(), 'hutch-pullquota-'));
    dirs.push(base);
    const host = join(base, 'workspace');
    const state = join(base, 'state');
    mkdirSync(host);
    mkdirSync(state);
    writeFileSync(join(host, 'keep.txt'), 'kept\n');
    const mirror = new WorkspaceMirror(new Workspace(host), undefined, { stateDir: state, durable: false });
    const pushed = await mirror.push(guest.client, undefined, { fresh: true, mark: true });
    return { host, state, guest, mirror, marker: pushed.marker?.marker as string };
  }

  it('hard links of a streamed file: refused at the quota, nothing applied or left staged, carried once the links are gone', async () => {
    const { host, state, guest, mirror, marker } = await started();
    const content = Buffer.alloc(300 * KiB, 7); // above the inline limit: streamed
    writeFileSync(join(guest.root, 'big.bin'), content);
    for (let i = 0; i < 20; i++) linkSync(join(guest.root, 'big.bin'), join(guest.root, `link${i}`));
    const err = await mirror.pull(guest.client, marker, 64 * MiB, { quota: { bytes: 2 * MiB, files: 1000 } }).catch((e: unknown) => e);
    expect(err).toMatchObject({ code: 'quota_exceeded', context: { limit: 'bytes', quota: 2 * MiB } });
    expect(String((err as Error).message)).toMatch(/hard links and sparse files count in full/);
    // The host workspace is as it was; no staged file is left behind.
    expect(readdirSync(host)).toEqual(['keep.txt']);
    expect((await measureWorkspace(host)).bytes).toBeLessThanOrEqual(8 * KiB);
    expect(readdirSync(state, { recursive: true })).toEqual([]);
    // The guest's changes were not lost: without the links, the same marker carries the file.
    for (let i = 0; i < 20; i++) unlinkSync(join(guest.root, `link${i}`));
    const ok = await mirror.pull(guest.client, marker, 64 * MiB, { quota: { bytes: 2 * MiB, files: 1000 } });
    expect(ok.stats.errors).toEqual([]);
    expect(readFileSync(join(host, 'big.bin')).equals(content)).toBe(true);
    expect(readdirSync(host).sort()).toEqual(['big.bin', 'keep.txt']);
  });

  it('hard links of small inline files are counted as the files they become on the host', async () => {
    const { host, guest, mirror, marker } = await started();
    writeFileSync(join(guest.root, 'small.txt'), 'x'.repeat(100));
    for (let i = 0; i < 30; i++) linkSync(join(guest.root, 'small.txt'), join(guest.root, `l${i}`));
    await expect(mirror.pull(guest.client, marker, 64 * MiB, { quota: { bytes: 2 * MiB, files: 10 } })).rejects.toMatchObject({ code: 'quota_exceeded', context: { limit: 'files', quota: 10 } });
    await expect(mirror.pull(guest.client, marker, 64 * MiB, { quota: { bytes: 64 * KiB, files: 1000 } })).rejects.toMatchObject({ code: 'quota_exceeded', context: { limit: 'bytes', quota: 64 * KiB } });
    expect(readdirSync(host)).toEqual(['keep.txt']);
  });

  it('a sparse file is counted at the size the host writes: its stream is cut at the quota', async () => {
    const { host, guest, mirror, marker } = await started();
    writeFileSync(join(guest.root, 'sparse.img'), '');
    truncateSync(join(guest.root, 'sparse.img'), 40 * MiB); // no blocks in the guest
    const err = await mirror.pull(guest.client, marker, 64 * MiB, { quota: { bytes: 4 * MiB, files: 1000 } }).catch((e: unknown) => e);
    expect(err).toMatchObject({ code: 'quota_exceeded', context: { limit: 'bytes', quota: 4 * MiB, path: 'sparse.img' } });
    expect(existsSync(join(host, 'sparse.img'))).toBe(false);
    // Within the quota the same file comes back whole (and without a quota, as before).
    const ok = await mirror.pull(guest.client, marker, 64 * MiB, { quota: { bytes: 64 * MiB, files: 1000 } });
    expect(ok.stats.errors).toEqual([]);
    expect(readFileSync(join(host, 'sparse.img')).length).toBe(40 * MiB);
  });

  it('FIFOs (entries the sync cannot carry) count as entries; the result lists 100 and counts the rest; the mirror remembers at most 10,000', async () => {
    const { host, guest, mirror, marker } = await started();
    execFileSync('python3', ['-c', `import os\nfor i in range(10050): os.mkfifo(os.path.join(${JSON.stringify(guest.root)}, 'p%05d' % i))`]);
    await expect(mirror.pull(guest.client, marker, 64 * MiB, { quota: { bytes: 2 * MiB, files: 5000 } })).rejects.toMatchObject({ code: 'quota_exceeded', context: { limit: 'files', quota: 5000 } });
    expect(mirror.unpulled.size).toBe(0);
    const r = await mirror.pull(guest.client, marker, 64 * MiB, { quota: { bytes: 2 * MiB, files: 20_000 } });
    expect(r.stats.errors.length).toBe(100);
    expect(r.stats.errors.every((e) => e.code === 'unsupported_file_type')).toBe(true);
    expect(r.stats.errorsOmitted).toBe(9950);
    expect(r.stats.skipped.length).toBe(100);
    expect(mirror.unpulled.size).toBe(10_000);
    expect(mirror.unpulledOverflow).toBe(true);
    expect(readdirSync(host)).toEqual(['keep.txt']);
  });

  it('directories and symlinks count as entries; deletions cost nothing', async () => {
    const { host, guest, mirror, marker } = await started();
    for (let i = 0; i < 6; i++) mkdirSync(join(guest.root, `d${i}`));
    for (let i = 0; i < 6; i++) symlinkSync('keep.txt', join(guest.root, `s${i}`));
    unlinkSync(join(guest.root, 'keep.txt'));
    await expect(mirror.pull(guest.client, marker, 64 * MiB, { quota: { bytes: 2 * MiB, files: 11 } })).rejects.toMatchObject({ code: 'quota_exceeded', context: { limit: 'files' } });
    expect(readdirSync(host)).toEqual(['keep.txt']);
    const ok = await mirror.pull(guest.client, marker, 64 * MiB, { quota: { bytes: 2 * MiB, files: 12 } });
    expect(ok.stats.deleted).toBe(1);
    expect(readdirSync(host).length).toBe(12);
  });

  it('a compromised agent sending deletion records without end is stopped at what /work can hold, nothing applied', async () => {
    const { host, state, mirror } = await started();
    // Not our agent: a stand-in for one a guest kernel exploit took over, speaking the same
    // sync.changes records. An honest agent reports at most the entries its marker held.
    let sent = 0;
    const hostile = {
      connection: { isOpen: true },
      syncChanges: async (_p: unknown, onBatch: (b: { changes: unknown[]; skipped: unknown[] }) => Promise<void>) => {
        for (let b = 0; b < 1000; b++) {
          const changes = Array.from({ length: 1000 }, () => ({ path: Buffer.from(`gone/${'x'.repeat(200)}${sent++}`), kind: 'deleted' }));
          await onBatch({ changes, skipped: [] });
        }
        return { marker: 'never' };
      },
    } as unknown as Parameters<WorkspaceMirror['pull']>[0];
    const err = await mirror.pull(hostile, 'm', 64 * MiB, { quota: { bytes: 2 * MiB, files: 5000 } }).catch((e: unknown) => e);
    expect(err).toMatchObject({ code: 'quota_exceeded', context: { limit: 'files', quota: 5000 } });
    expect(String((err as Error).message)).toMatch(/more than 6024 deletions/);
    // Refused at the first record past the bound, not after a million.
    expect(sent).toBeLessThan(8000);
    expect(readdirSync(host)).toEqual(['keep.txt']);
    expect(readdirSync(state, { recursive: true })).toEqual([]);
  });
});
