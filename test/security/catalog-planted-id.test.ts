/**
 * A planted session id must not take over another tenant's routing. Bob, holding a valid
 * token, created a session straight on a broker with the id of Alice's session (placed on
 * another broker through a gateway). When the catalog was rebuilt (Redis restarted empty,
 * the brokers re-publishing first come, first served), Bob's broker could publish first:
 * Alice then got not_found and the id served Bob's copy. Now no tenant names an id (the
 * broker or a gateway draws 128 random bits), and the catalog keys each session by its
 * principal, so a re-publication never hands one principal's id to another.
 */
import { readFileSync, renameSync, writeFileSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Hutch, type HutchError } from '../../host-broker/src/sdk/index.ts';
import { clusterSkipReason, failure as failed, startCluster, TENANTS, until, type Broker, type Cluster, type GatewayProc } from '../helpers/cluster.ts';

const skip = clusterSkipReason();
if (skip) console.log(`SKIPPING test/security/catalog-planted-id.test.ts: ${skip}`);

const work = mkdtempSync(join(tmpdir(), 'hutch-planted-'));
let cluster: Cluster;
let b1: Broker, b2: Broker;
let g1: GatewayProc;
let aliceSession: string;

const failure = (p: Promise<unknown>) => failed<HutchError>(p);

describe.skipIf(skip !== undefined)('a session id planted by another principal', () => {
  beforeAll(async () => {
    cluster = await startCluster(work);
    b1 = await cluster.startBroker('b1');
    g1 = await cluster.startGateway();
    // b1 is the only broker yet: Alice's session is placed there.
    const alice = await Hutch.connect(g1.url, { token: TENANTS.alice });
    aliceSession = (await alice.create({ workspace: { files: { 'secret.txt': 'alice only\n' } } })).id;
    alice.close();
    b2 = await cluster.startBroker('b2');
  }, 120_000);

  afterAll(async () => {
    b1?.kill('SIGCONT');
    await cluster?.stopAll();
    rmSync(work, { recursive: true, force: true });
  }, 60_000);

  it('a session id is 128 random bits, and no tenant can name one: not at a gateway, not at any broker', async () => {
    expect(aliceSession).toMatch(/^s-[0-9a-f]{32}$/);
    for (const url of [g1.url, b1.url, b2.url]) {
      const bob = await Hutch.connect(url, { token: TENANTS.bob });
      for (const id of [aliceSession, 'bobs-own-name']) {
        const e = await failure(bob.request('create', { id }));
        expect(e.code, `${url} ${id}`).toBe('bad_request');
        expect(e.message).toMatch(/chosen by the broker/);
      }
      bob.close();
    }
    const direct = await Hutch.connect(b2.url, { token: TENANTS.bob });
    expect((await direct.sessions()).map((s) => s.session)).not.toContain(aliceSession);
    direct.close();
  }, 60_000);

  it("a rebuilt catalog routes each principal's id to its own session, whichever broker publishes first", async () => {
    // Bob's session under Alice's id on b2, as one planted before ids were the broker's alone:
    // a session of his renamed on disk while b2 was stopped.
    const bob = await Hutch.connect(b2.url, { token: TENANTS.bob });
    const planted = (await bob.create({ workspace: { files: { 'secret.txt': 'bob copy\n' } } })).id;
    bob.close();
    b2.kill('SIGTERM');
    await b2.exited;
    const sessions = join(b2.dataDir, 'sessions');
    renameSync(join(sessions, planted), join(sessions, aliceSession));
    const metaPath = join(sessions, aliceSession, 'session.json');
    writeFileSync(metaPath, JSON.stringify({ ...(JSON.parse(readFileSync(metaPath, 'utf8')) as object), id: aliceSession }));
    b2 = await cluster.startBroker('b2', { dataDir: b2.dataDir });

    // The catalog loses its data while Alice's broker is stopped: Bob's broker publishes first.
    b1.kill('SIGSTOP');
    await cluster.restartRedis();
    await until('b2 to re-publish its session', async () => ((await cluster.catalog.command('KEYS', 'hutch:session:*')) as unknown[]).length > 0);
    b1.kill('SIGCONT');
    await until('b1 to register again', async () => (await cluster.catalog.command('EXISTS', 'hutch:broker:b1')) === 1);

    // A gateway with nothing cached routes by the rebuilt catalog alone.
    const g2 = await cluster.startGateway();
    const alice = await Hutch.connect(g2.url, { token: TENANTS.alice });
    let content = '';
    await until(
      "Alice's session to answer through a fresh gateway",
      async () => {
        try {
          content = (await (await alice.attach(aliceSession)).files.read('secret.txt')).content;
          return true;
        } catch {
          return false;
        }
      },
      30_000,
    );
    expect(content).toContain('alice only');
    expect((await alice.sessions()).map((s) => s.session)).toEqual([aliceSession]);
    alice.close();
    // Bob's id of the same name reaches his own session on b2, never Alice's.
    const bobAgain = await Hutch.connect(g2.url, { token: TENANTS.bob });
    const his = await (await bobAgain.attach(aliceSession)).files.read('secret.txt');
    expect(his.content).toContain('bob copy');
    expect(his.content).not.toContain('alice only');
    bobAgain.close();
  }, 120_000);
});
