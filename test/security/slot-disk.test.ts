import { afterAll, describe, expect, it } from 'vitest';
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { Hutch } from '../../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';
import { waitFor } from '../helpers/wait-for.ts';

/**
 * A snapshot slot holds a VM's RAM and swap (up to 1.1 GiB for the default 512 MiB VM) and
 * each session keeps two, with no bound but --max-sessions: a token holder whose 128
 * sessions each dirtied their VM and went idle could write a few hundred GB into the data
 * dir, the disk every tenant's workspace is on. Slots now take room in a budget per
 * principal (and in all, and never the free space kept for workspaces); a release that
 * finds none keeps its VM reclaimed, so the session still loses nothing.
 */
const ALICE = 'alice-token-0123456789abcdef';
const BOB = 'bob-token-0123456789abcdefgh';

describe('snapshot slots within a disk budget', { tags: ['vm'] }, () => {
  let b: TestBroker | undefined;
  afterAll(async () => b?.stop(), 120_000);

  it("a principal past its slot disk keeps its VM reclaimed instead: its state survives, another principal's slot is still written", async () => {
    const probe = await startBroker({ backend: 'qemu' });
    const slotMax = probe.backend.slotBytesMax?.({ memoryMiB: 256 });
    await probe.stop();
    if (slotMax === undefined) throw new Error('the qemu backend must bound its slots');
    // Room for one 256 MiB VM's slot per principal, not two (a written slot is more than 16 MiB).
    b = await startBroker({ backend: 'qemu', tokens: { alice: ALICE, bob: BOB }, slotDisk: { principalBytes: slotMax + 16 * 1024 * 1024, totalBytes: 100 * slotMax } });
    const url = b.url;
    const alice = await Hutch.connect(url, { token: ALICE });
    const bob = await Hutch.connect(url, { token: BOB });
    const metric = async (re: RegExp) => {
      const text = await (await fetch(`${url.replace('ws:', 'http:')}/metrics`, { headers: { authorization: `Bearer ${ALICE}` } })).text();
      return Number(re.exec(text)?.[1] ?? 0);
    };
    const released = (decision: string) => metric(new RegExp(`hutch_releases_total\\{decision="${decision}"\\} (\\d+)`));
    const idle = async (sb: Awaited<ReturnType<Hutch['create']>>, owner: Hutch) => {
      await sb.hint('idle');
      await waitFor(async () => (await owner.sessions()).find((x) => x.session === sb.id)?.live === false || (await released('reclaim')) > 0, 120_000);
    };
    const a1 = await alice.create({ memoryMiB: 256 });
    const a2 = await alice.create({ memoryMiB: 256 });
    const b1 = await bob.create({ memoryMiB: 256 });
    // A change outside /work: each release wants a slot.
    for (const [sb, who] of [[a1, 'a1'], [a2, 'a2'], [b1, 'b1']] as const) expect((await sb.run(`echo ${who} > ~/marker; echo ok`, { route: 'vm' })).stdout).toBe('ok\n');
    await idle(a1, alice);
    expect(await released('snapshot')).toBe(1);
    await idle(a2, alice);
    await waitFor(async () => (await released('reclaim')) === 1, 120_000);
    expect(await released('snapshot')).toBe(1);
    expect((await alice.sessions()).find((x) => x.session === a2.id)?.live).toBe(true);
    expect(existsSync(join(b.dataDir, 'sessions', a2.id, 'state', 'slots', 'current'))).toBe(false);
    // Bob's share is his own.
    await idle(b1, bob);
    await waitFor(async () => (await released('snapshot')) === 2, 120_000);
    expect(await metric(/hutch_slot_disk_bytes\{state="held"\} (\d+)/)).toBeGreaterThan(16 * 1024 * 1024);
    // Nothing was lost: the reclaimed VM and the slots answer with their home.
    for (const [sb, who] of [[a1, 'a1'], [a2, 'a2'], [b1, 'b1']] as const) {
      const r = await sb.run('cat ~/marker', { route: 'vm' });
      expect(r.stdout).toBe(`${who}\n`);
      expect(r.woke).toBe(true);
    }
    alice.close();
    bob.close();
  }, 900_000);
});
