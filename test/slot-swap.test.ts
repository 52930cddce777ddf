import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { qemuPids } from '../host-broker/src/vm/qemu-driver.ts';
import type { Hutch } from '../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from './helpers/broker.ts';
import { waitFor } from './helpers/wait-for.ts';

/**
 * A VM released into a snapshot slot keeps all of its memory, including the pages its
 * guest had swapped out to its swap disk: the slot's RAM stream does not carry block
 * devices, so the swap disk has to travel with the slot. Without it the restored guest
 * reads zeros where its swapped pages were: a file in HOME or /work (tmpfs, swap-backed)
 * silently corrupted, and /work's corruption pulled back to the host as the truth.
 */
describe('snapshot slots and the swap disk', { tags: ['vm'] }, () => {
  let b: TestBroker;
  let hutch: Hutch;
  beforeAll(async () => {
    b = await startBroker({ backend: 'qemu', idleMs: 3_600_000 });
    hutch = await b.connect();
  }, 1_800_000);
  afterAll(async () => {
    await b?.stop();
    expect(qemuPids(b.dataDir)).toEqual([]);
  });

  it('pages swapped out to disk before a snapshot release read back intact after the slot restore', async () => {
    const sb = await hutch.create({ workspace: { files: { 'a.txt': 'a\n' } } });
    // Incompressible data in HOME (outside /work: the release must snapshot); zswap rejects
    // incompressible pages, so reclaim writes them to the swap disk itself.
    const made = await sb.run('head -c 48M /dev/urandom > ~/blob && sha256sum ~/blob | cut -d" " -f1 && grep -E "^pswpout " /proc/vmstat', { route: 'vm', timeoutMs: 600_000 });
    expect(made.exitCode, made.stderr).toBe(0);
    const [sum, before] = made.stdout.trim().split('\n');
    expect(sum).toMatch(/^[0-9a-f]{64}$/);
    // The guest's own idle policy reclaims into zswap/swap (what a reclaim release does).
    const live = b.broker.sessions.get(sb.id).vm.liveSandbox();
    expect(live?.reclaim).toBeDefined();
    await live?.reclaim?.();
    const swapped = await sb.run('grep -E "^pswpout " /proc/vmstat', { route: 'vm' });
    const outPages = Number(swapped.stdout.trim().split(' ')[1]) - Number((before ?? '').split(' ')[1]);
    // Some of the blob went to the swap disk (if not, this test proves nothing: fail loudly).
    expect(outPages).toBeGreaterThan(1000);
    await sb.hint('idle');
    await waitFor(async () => !(await hutch.sessions()).find((x) => x.session === sb.id)?.live, 300_000);
    expect(b.broker.sessions.get(sb.id).vm.lastRelease?.decision).toBe('snapshot');
    const after = await sb.run('sha256sum ~/blob | cut -d" " -f1', { route: 'vm', timeoutMs: 600_000 });
    expect(after.woke).toBe(true);
    expect(after.stdout.trim()).toBe(sum);
    await sb.close();
  }, 1_200_000);
});
