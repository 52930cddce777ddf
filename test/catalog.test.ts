/**
 * The catalog against a real redis-server: the RESP client (replies split across reads,
 * pipelining, errors, a lost connection), leases that lapse, first-writer-wins placement and
 * compare-and-delete.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Catalog } from '../host-broker/src/catalog/catalog.ts';
import { parseRedisUrl, RedisReplyError, RespClient } from '../host-broker/src/catalog/resp.ts';
import { clusterSkipReason, failure, startCluster, until, type Cluster } from './helpers/cluster.ts';

const skip = clusterSkipReason();
if (skip) console.log(`SKIPPING test/catalog.test.ts: ${skip}`);

const work = mkdtempSync(join(tmpdir(), 'hutch-catalog-'));
let cluster: Cluster;

describe.skipIf(skip !== undefined)('the Redis catalog', () => {
  beforeAll(async () => {
    cluster = await startCluster(work);
  }, 60_000);
  afterAll(async () => {
    await cluster?.stopAll();
    rmSync(work, { recursive: true, force: true });
  });

  it('parses redis:// addresses and refuses others', () => {
    expect(parseRedisUrl('redis://:s3cret@10.0.0.5:6380/2')).toEqual({ host: '10.0.0.5', port: 6380, password: 's3cret', db: 2 });
    expect(parseRedisUrl('redis://hutch-redis')).toEqual({ host: 'hutch-redis', port: 6379 });
    expect(() => parseRedisUrl('http://x:1')).toThrow(/redis:\/\//);
    expect(() => parseRedisUrl('redis://x/notanumber')).toThrow(/database/);
  });

  it('a reply larger than one read, many pipelined commands, and error replies come back matched to their command', async () => {
    const c = new RespClient(parseRedisUrl(cluster.redisUrl));
    const big = 'é'.repeat(700_000); // multi-byte, over a megabyte: split across many socket reads
    expect(await c.command('SET', 'big', big)).toBe('OK');
    expect(await c.command('GET', 'big')).toBe(big);
    const answers = await Promise.all(Array.from({ length: 500 }, (_, i) => c.command('ECHO', `n${i}`)));
    expect(answers).toEqual(Array.from({ length: 500 }, (_, i) => `n${i}`));
    expect(await failure(c.command('NOSUCHCOMMAND'))).toBeInstanceOf(RedisReplyError);
    expect(await c.command('ECHO', 'still in step')).toBe('still in step');
    expect(await c.command('GET', 'missing-key')).toBeNull();
    c.close();
  });

  it('a broker lease lapses unless renewed; a session id is placed once; only its own placement is forgotten', async () => {
    const cat = new Catalog(cluster.redisUrl, 'test:');
    const rec = { id: 'n1', url: 'ws://n1:7070', templates: [], startedAt: new Date().toISOString() };
    expect(await cat.putBroker(rec, 400)).toBe(true);
    expect(await cat.putBroker(rec, 400)).toBe(false); // a renewal
    expect((await cat.liveBrokers()).map((b) => b.id)).toEqual(['n1']);
    await until('the lease to lapse', async () => (await cat.liveBrokers()).length === 0);
    expect(await cat.putBroker(rec, 60_000)).toBe(true); // back: the caller republishes its sessions
    await cat.removeBroker('n1');
    expect(await cat.liveBrokers()).toEqual([]);

    // Two placements of one principal's id at once: exactly one wins.
    const results = await Promise.all([cat.claimSession('s-1', { broker: 'n1', principal: 'alice' }), cat.claimSession('s-1', { broker: 'n2', principal: 'alice' })]);
    expect(results.filter(Boolean)).toHaveLength(1);
    const owner = (await cat.session('alice', 's-1')) as { broker: string; principal: string };
    const other = { broker: owner.broker === 'n1' ? 'n2' : 'n1', principal: 'alice' };
    expect(await cat.releaseSession('s-1', other)).toBe(false);
    expect(await cat.session('alice', 's-1')).toEqual(owner);
    // Another principal's id is another key: neither sees nor takes alice's.
    expect(await cat.session('bob', 's-1')).toBeUndefined();
    expect(await cat.claimSession('s-1', { broker: 'n3', principal: 'bob' })).toBe(true);
    expect(await cat.session('alice', 's-1')).toEqual(owner);
    expect(await cat.session('bob', 's-1')).toEqual({ broker: 'n3', principal: 'bob' });
    expect(await cat.releaseSession('s-1', owner)).toBe(true);
    expect(await cat.session('alice', 's-1')).toBeUndefined();
    expect(await cat.session('bob', 's-1')).toEqual({ broker: 'n3', principal: 'bob' });
    cat.close();
  });

  it('a lost connection fails what is pending with unavailable, and the next command reconnects', async () => {
    const c = new RespClient(parseRedisUrl(cluster.redisUrl));
    expect(await c.command('SET', 'k', 'v')).toBe('OK');
    const blocked = failure<{ code?: string }>(c.command('BLPOP', 'never-pushed', 0)); // waits in Redis until the connection goes
    await cluster.restartRedis();
    const e = await blocked;
    expect(e.code).toBe('unavailable');
    expect(await c.command('GET', 'k')).toBeNull(); // a fresh, empty Redis
    expect(await c.command('PING')).toBe('PONG');
    c.close();
  });
});
