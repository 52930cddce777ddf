import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import type { Hutch } from '../../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/**
 * The in-process read and edit load their file (up to 64 MiB) into the broker's memory. A
 * principal's sessions reading at once each held one: 128 sessions reading 64 MiB files
 * would hold 8 GiB. They now take room in a budget of file bytes first (1 GiB in all, 256 MiB
 * per principal) and wait for it.
 */
describe('file bytes the in-process tools hold at once', () => {
  let b: TestBroker;
  let hutch: Hutch;
  beforeAll(async () => {
    b = await startBroker();
    hutch = await b.connect();
  }, 120_000);
  afterAll(async () => b?.stop());

  it("six concurrent reads of 60 MB files by one principal hold at most its share, and all answer", async () => {
    const line = `${'x'.repeat(99)}\n`;
    const lines = 600_000; // 60 MB
    const sessions = [];
    for (let i = 0; i < 6; i++) {
      const sb = await hutch.create({});
      writeFileSync(join(b.dataDir, 'sessions', sb.id, 'workspace', 'big.txt'), line.repeat(lines));
      sessions.push(sb);
    }
    let peak = 0;
    const sample = setInterval(() => (peak = Math.max(peak, b.broker.fileBytes.inUse)), 1);
    const reads = await Promise.all(sessions.map((sb) => sb.files.read('big.txt', { offset: 5, limit: 1 })));
    clearInterval(sample);
    for (const r of reads) expect([r.totalLines, r.content]).toEqual([lines, `00006| ${'x'.repeat(99)}`]);
    expect(peak).toBeGreaterThan(0);
    expect(peak).toBeLessThanOrEqual(b.broker.fileBytes.perKeyBytes);
    expect(b.broker.fileBytes.inUse).toBe(0);
    // An edit holds room the same way, and gives it back.
    const e = await sessions[0]?.files.edit('big.txt', `${'x'.repeat(99)}\n${'x'.repeat(99)}\n`, 'two lines\n', { replaceAll: true });
    expect(e?.replacements).toBeGreaterThan(0);
    expect(b.broker.fileBytes.inUse).toBe(0);
    for (const sb of sessions) await sb.close();
  }, 120_000);

  it('six concurrent greps over 60 MB files hold at most the share while they wait for a worker, find their matches, and give the room back', async () => {
    const sessions = [];
    for (let i = 0; i < 6; i++) {
      const sb = await hutch.create({});
      const ws = join(b.dataDir, 'sessions', sb.id, 'workspace');
      writeFileSync(join(ws, 'big.txt'), `${'y'.repeat(99)}\n`.repeat(600_000) + `needle ${i}\n`);
      writeFileSync(join(ws, 'small.txt'), `needle small ${i}\n`);
      sessions.push(sb);
    }
    let peak = 0;
    const sample = setInterval(() => (peak = Math.max(peak, b.broker.fileBytes.inUse)), 1);
    const found = await Promise.all(sessions.map((sb) => sb.call('grep', { pattern: 'needle' })));
    clearInterval(sample);
    for (const [i, r] of found.entries()) {
      const matches = (r.result as { matches: Array<{ path: string; text: string }> }).matches.map((m) => `${m.path}: ${m.text}`).sort();
      expect(matches).toEqual([`big.txt: needle ${i}`, `small.txt: needle small ${i}`]);
    }
    expect(peak).toBeGreaterThan(0);
    expect(peak).toBeLessThanOrEqual(b.broker.fileBytes.perKeyBytes);
    expect(b.broker.fileBytes.inUse).toBe(0);
    for (const sb of sessions) await sb.close();
  }, 180_000);
});
