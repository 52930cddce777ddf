import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { existsSync, readdirSync } from 'node:fs';
import { join } from 'node:path';
import type { Hutch } from '../../host-broker/src/sdk/index.ts';
import { DEFAULT_SESSION_SIZES, parseSizeList, sessionSize, validateSessionSizes } from '../../host-broker/src/sessions/session-sizes.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/**
 * Each VM size a session wakes with is a pristine snapshot of its own: a cold boot and a
 * memory image in the cache. A token holder could name any size from 64 MiB to 1 TiB and 1
 * to 64 vCPUs, so sessions of 513, 514, 515... MiB had the broker boot guests and grow its
 * cache without end. Now a create names one of the operator's sizes or is refused typed,
 * before anything is made.
 */
describe('session sizes a tenant may ask for', () => {
  let b: TestBroker;
  let hutch: Hutch;
  beforeAll(async () => {
    b = await startBroker();
    hutch = await b.connect();
  }, 120_000);
  afterAll(async () => b?.stop());

  const sessionDirs = () => (existsSync(join(b.dataDir, 'sessions')) ? readdirSync(join(b.dataDir, 'sessions')) : []);

  it('a size outside the list is bad_request naming the list, and nothing is created', async () => {
    const before = sessionDirs();
    for (const asked of [{ memoryMiB: 513 }, { memoryMiB: 1024 * 1024 }, { memoryMiB: 64 }, { cpus: 64 }, { cpus: 3 }, { memoryMiB: 512, cpus: 16 }]) {
      const err = await hutch.create(asked).catch((e: unknown) => e);
      const k = 'cpus' in asked && asked.cpus !== 1 && asked.cpus !== 2 ? 'cpus' : 'memoryMiB';
      expect(err, JSON.stringify(asked)).toMatchObject({ code: 'bad_request', context: { allowed: [...DEFAULT_SESSION_SIZES[k]] } });
      expect(String((err as Error).message)).toMatch(k === 'cpus' ? /--session-cpus/ : /--session-memory-mib/);
    }
    expect(sessionDirs()).toEqual(before);
    expect((await hutch.sessions()).length).toBe(0);
  });

  it('a listed size is taken as asked; none named is 512 MiB and 1 vCPU', async () => {
    const big = await hutch.create({ memoryMiB: 2048, cpus: 2 });
    const plain = await hutch.create({});
    const info = new Map((await hutch.sessions()).map((s) => [s.session, s]));
    expect([info.get(big.id)?.memoryMiB, info.get(big.id)?.cpus]).toEqual([2048, 2]);
    expect([info.get(plain.id)?.memoryMiB, info.get(plain.id)?.cpus]).toEqual([512, 1]);
    await big.close();
    await plain.close();
  });

  it("the operator's own list: a create naming nothing gets the smallest listed when 512 / 1 are not", async () => {
    const own = await startBroker({ sessionSizes: validateSessionSizes({ memoryMiB: [4096, 1024], cpus: [4, 2] }) });
    try {
      const h = await own.connect();
      const s = await h.create({});
      const [info] = await h.sessions();
      expect([info?.memoryMiB, info?.cpus]).toEqual([1024, 2]);
      await expect(h.create({ memoryMiB: 512 })).rejects.toMatchObject({ code: 'bad_request', context: { allowed: [1024, 4096] } });
      await s.close();
    } finally {
      await own.stop();
    }
  }, 120_000);

  it('lists are checked: whole numbers within the protocol bounds, at least one', () => {
    expect(parseSizeList('--session-memory-mib', '512, 256,1024')).toEqual([512, 256, 1024]);
    for (const bad of ['', '512,', 'abc', '1.5', '-1', '512,,1024']) expect(() => parseSizeList('--session-cpus', bad), bad).toThrow(/--session-cpus takes whole numbers/);
    expect(() => validateSessionSizes({ memoryMiB: [32], cpus: [1] })).toThrow(/memoryMiB 32 is not a whole number from 64/);
    expect(() => validateSessionSizes({ memoryMiB: [512], cpus: [65] })).toThrow(/cpus 65/);
    expect(() => validateSessionSizes({ memoryMiB: [], cpus: [1] })).toThrow(/no memoryMiB listed/);
    expect(validateSessionSizes({ memoryMiB: [1024, 256, 1024], cpus: [2, 1] })).toEqual({ memoryMiB: [256, 1024], cpus: [1, 2] });
    expect(sessionSize(DEFAULT_SESSION_SIZES, {})).toEqual({ memoryMiB: 512, cpus: 1 });
  });
});
