/**
 * What a tenant holding a token would try against gateways and the brokers behind them:
 * another principal's session through either gateway, impersonation at a broker (the
 * principal header with its own token, a guessed gateway credential), the gateway's own
 * surface (/load, the credential as a tenant token), and floods of unauthenticated sockets
 * against a gateway (capped as on the broker: the gateway runs the same WsServer).
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { connect, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import WebSocket from 'ws';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createLogger } from '../../guest-agent/src/log.ts';
import { Principals } from '../../host-broker/src/api/principals.ts';
import { Gateway } from '../../host-broker/src/gateway/gateway.ts';
import { ClusterMember } from '../../host-broker/src/catalog/member.ts';
import { PRINCIPAL_HEADER } from '../../host-broker/src/gateway/credential.ts';
import { Hutch, HutchError } from '../../host-broker/src/sdk/index.ts';
import { clusterSkipReason, failure as failed, GATEWAY_CREDENTIAL, startCluster, until, TENANTS, type Broker, type Cluster, type GatewayProc } from '../helpers/cluster.ts';

const skip = clusterSkipReason();
if (skip) console.log(`SKIPPING test/security/gateway.test.ts: ${skip}`);

const work = mkdtempSync(join(tmpdir(), 'hutch-gateway-sec-'));
let cluster: Cluster;
let b1: Broker;
let g1: GatewayProc, g2: GatewayProc;

const failure = (p: Promise<unknown>) => failed<HutchError>(p);

/** The HTTP status a WebSocket upgrade gets, or 101 with the hello's principal. */
function upgrade(url: string, headers: Record<string, string>): Promise<{ status: number; principal?: string }> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(url, { headers });
    ws.once('unexpected-response', (_req, res) => {
      resolve({ status: res.statusCode ?? 0 });
      ws.terminate();
    });
    ws.once('message', (d) => {
      resolve({ status: 101, principal: (JSON.parse(String(d)) as { principal?: string }).principal });
      ws.close();
    });
    ws.once('error', reject);
  });
}

describe.skipIf(skip !== undefined)('gateway security', () => {
  let aliceSession: string;

  beforeAll(async () => {
    cluster = await startCluster(work);
    b1 = await cluster.startBroker('b1');
    await cluster.startBroker('b2');
    [g1, g2] = await Promise.all([cluster.startGateway(), cluster.startGateway()]);
    const alice = await Hutch.connect(g1.url, { token: TENANTS.alice });
    aliceSession = (await alice.create({ workspace: { files: { 'secret.txt': 'alice only\n' } } })).id;
    alice.close();
  }, 120_000);

  afterAll(async () => {
    await cluster?.stopAll();
    rmSync(work, { recursive: true, force: true });
  }, 60_000);

  it("a tenant cannot reach another principal's session through either gateway: it answers like a missing one", async () => {
    for (const g of [g1, g2]) {
      const bob = await Hutch.connect(g.url, { token: TENANTS.bob });
      const missing = await failure(bob.attach('no-such-session'));
      for (const attempt of [
        bob.attach(aliceSession),
        bob.request('call', { session: aliceSession, tool: 'read', args: { filePath: 'secret.txt' } }),
        bob.request('close', { session: aliceSession }),
        bob.request('hint', { session: aliceSession, hint: 'idle' }),
      ]) {
        const e = await failure(attempt);
        expect(e.code).toBe(missing.code);
        expect(e.code).toBe('not_found');
        expect(e.message).toBe(`no session ${aliceSession}`);
      }
      // Taking the id over: no tenant names an id (test/security/catalog-planted-id.test.ts).
      expect((await failure(bob.request('create', { id: aliceSession }))).code).toBe('bad_request');
      expect((await bob.sessions()).map((s) => s.session)).not.toContain(aliceSession);
      bob.close();
    }
    const alice = await Hutch.connect(g2.url, { token: TENANTS.alice });
    expect((await (await alice.attach(aliceSession)).files.read('secret.txt')).content).toContain('alice only');
    alice.close();
  }, 60_000);

  it('malformed session ids, and any create id, are refused before they reach the catalog', async () => {
    const before = await cluster.catalog.command('DBSIZE');
    const bob = await Hutch.connect(g1.url, { token: TENANTS.bob });
    for (const session of ['x'.repeat(1_000_000), '../alice', 'A*', '', 42, { $ne: null }]) {
      const e = await failure(bob.request('call', { session, tool: 'read', args: { filePath: 'a' } }));
      expect(e.code).toBe('bad_request');
    }
    for (const id of ['x'.repeat(65), '../../etc', 'UPPER', 'hutch:broker:b1', 's-0123']) expect((await failure(bob.request('create', { id }))).code).toBe('bad_request');
    bob.close();
    expect(await cluster.catalog.command('DBSIZE')).toBe(before);
  });

  it("the E2B surface at a gateway: the API key is checked there, another principal's sandbox is missing, envd needs the sandbox's access token", async () => {
    const http = g1.url.replace(/^ws/, 'http');
    const api = `${http}/e2b/api`;
    expect((await fetch(`${api}/sandboxes`, { method: 'POST', body: '{}', headers: { 'content-type': 'application/json' } })).status).toBe(401);
    expect((await fetch(`${api}/sandboxes`, { headers: { 'x-api-key': GATEWAY_CREDENTIAL } })).status).toBe(401);
    const bob = { 'x-api-key': TENANTS.bob };
    expect((await fetch(`${api}/sandboxes/${aliceSession}`, { headers: bob })).status).toBe(404);
    expect((await fetch(`${api}/sandboxes/${aliceSession}`, { method: 'DELETE', headers: bob })).status).toBe(404);
    expect((await fetch(`${api}/sandboxes/${encodeURIComponent('../x')}`, { headers: bob })).status).toBe(400);
    expect(await cluster.catalog.command('EXISTS', `hutch:session:alice:${aliceSession}`)).toBe(1);
    // An E2B sandbox of alice's: envd by its id alone (no access token, or a wrong one) is refused by the broker that holds it.
    const made = await fetch(`${api}/sandboxes`, { method: 'POST', body: '{}', headers: { 'content-type': 'application/json', 'x-api-key': TENANTS.alice } });
    expect(made.status).toBeLessThan(300);
    const { sandboxID, envdAccessToken } = (await made.json()) as { sandboxID: string; envdAccessToken: string };
    const files = (token?: string) => fetch(`${http}/e2b/envd/health`, { headers: { 'e2b-sandbox-id': sandboxID, ...(token ? { 'x-access-token': token } : {}) } });
    const missing = await fetch(`${http}/e2b/envd/health`, { headers: { 'e2b-sandbox-id': 's-000000000000', 'x-access-token': envdAccessToken } });
    const refusal = { status: missing.status, body: await missing.text() };
    expect(refusal.status).toBe(502);
    for (const token of [undefined, `${envdAccessToken.slice(0, -1)}x`, TENANTS.alice]) {
      const r = await files(token);
      expect({ status: r.status, body: await r.text() }).toEqual(refusal);
    }
    expect((await files(envdAccessToken)).status).toBe(204);
    expect((await fetch(`${api}/sandboxes/${sandboxID}`, { headers: bob })).status).toBe(404);
    expect((await fetch(`${api}/sandboxes/${sandboxID}`, { method: 'DELETE', headers: { 'x-api-key': TENANTS.alice } })).status).toBe(204);
  });

  it('at a broker, the principal header with a tenant token is ignored: the connection stays that tenant', async () => {
    const r = await upgrade(b1.url.replace(/^ws/, 'ws'), { authorization: `Bearer ${TENANTS.bob}`, [PRINCIPAL_HEADER]: 'alice' });
    expect(r).toEqual({ status: 101, principal: 'bob' });
    // And through the SDK: bob at the broker directly, claiming alice, sees none of her sessions.
    const ws = new WebSocket(b1.url, { headers: { authorization: `Bearer ${TENANTS.bob}`, [PRINCIPAL_HEADER]: 'alice' } });
    const answer = await new Promise<{ e?: { code: string } }>((resolve) => {
      ws.on('message', (d) => {
        const m = JSON.parse(String(d)) as { t: string; e?: { code: string } };
        if (m.t === 'res') resolve(m);
      });
      ws.once('open', () => ws.send(JSON.stringify({ t: 'req', id: 1, op: 'attach', p: { session: aliceSession } })));
    });
    ws.close();
    expect(answer.e?.code).toBe('not_found');
  });

  it('a forged gateway credential, or the real one without a principal or with a bad name, is refused', async () => {
    const attempts: Array<Record<string, string>> = [
      { authorization: `Bearer ${GATEWAY_CREDENTIAL.slice(0, -1)}x`, [PRINCIPAL_HEADER]: 'alice' },
      { authorization: 'Bearer gateway-credential', [PRINCIPAL_HEADER]: 'alice' },
      { [PRINCIPAL_HEADER]: 'alice' },
      { authorization: `Bearer ${GATEWAY_CREDENTIAL}` },
      { authorization: `Bearer ${GATEWAY_CREDENTIAL}`, [PRINCIPAL_HEADER]: '../alice' },
      { authorization: `Bearer ${GATEWAY_CREDENTIAL}`, [PRINCIPAL_HEADER]: '' },
    ];
    for (const headers of attempts) {
      expect((await upgrade(b1.url, headers)).status).toBe(401);
    }
  });

  it("the gateway credential is not a tenant token at a gateway, and a tenant cannot name a principal there", async () => {
    expect((await upgrade(g1.url, { authorization: `Bearer ${GATEWAY_CREDENTIAL}`, [PRINCIPAL_HEADER]: 'alice' })).status).toBe(401);
    expect(await upgrade(g2.url, { authorization: `Bearer ${TENANTS.bob}`, [PRINCIPAL_HEADER]: 'alice' })).toEqual({ status: 101, principal: 'bob' });
  });

  it('a gateway refuses to start with a credential that is also a tenant token, or a short one', () => {
    const log = createLogger({ name: 'gateway-test', level: 'error' });
    const base = { port: 0, catalogUrl: cluster.redisUrl, log };
    expect(() => new Gateway({ ...base, principals: new Principals({ ...TENANTS, eve: GATEWAY_CREDENTIAL }), credential: GATEWAY_CREDENTIAL })).toThrow(/tenant token/);
    expect(() => new Gateway({ ...base, principals: new Principals(TENANTS), credential: 'short-credential-16' })).toThrow(/at least 32/);
    // And a broker, the same (its load source is not reached before the check).
    const member = (tokens: Record<string, string>, gatewayToken: string) => new ClusterMember({ catalogUrl: cluster.redisUrl, gatewayToken }, {} as never, new Principals(tokens), log);
    expect(() => member({ ...TENANTS, eve: GATEWAY_CREDENTIAL }, GATEWAY_CREDENTIAL)).toThrow(/tenant token/);
    expect(() => member(TENANTS, 'short-credential-16')).toThrow(/at least 32/);
  });

  it("a broker's /load is for gateways only", async () => {
    const http = b1.url.replace(/^ws/, 'http');
    expect((await fetch(`${http}/load`)).status).toBe(401);
    expect((await fetch(`${http}/load`, { headers: { authorization: `Bearer ${TENANTS.alice}` } })).status).toBe(401);
    const ok = await fetch(`${http}/load`, { headers: { authorization: `Bearer ${GATEWAY_CREDENTIAL}` } });
    expect(ok.status).toBe(200);
    expect(((await ok.json()) as { broker: string }).broker).toBe('b1');
  });

  describe('connection limits at a gateway (the same WsServer as the broker)', () => {
    let gw: Gateway;
    let url: string;
    const sockets: Socket[] = [];
    beforeAll(async () => {
      gw = new Gateway({
        port: 0,
        principals: new Principals(TENANTS),
        catalogUrl: cluster.redisUrl,
        credential: GATEWAY_CREDENTIAL,
        log: createLogger({ name: 'gateway-test', level: 'error' }),
        limits: { maxUnauthenticated: 20, handshakeTimeoutMs: 1500, maxConnectionsPerPrincipal: 3 },
      });
      url = `ws://127.0.0.1:${await gw.start()}`;
    });
    afterAll(async () => {
      for (const s of sockets) s.destroy();
      await gw?.stop();
    });

    it('half-open sockets are capped and dropped; a client with a token still gets in', async () => {
      const port = Number(new URL(url).port);
      let closed = 0;
      await Promise.all(
        Array.from({ length: 200 }, () =>
          new Promise<void>((resolve) => {
            const s = connect({ port, host: '127.0.0.1' });
            sockets.push(s);
            s.on('close', () => closed++);
            s.on('error', () => undefined);
            s.once('connect', () => {
              s.write('GET / HTTP/1.1\r\nHost: x\r\n');
              resolve();
            });
            s.once('error', () => resolve());
          }),
        ),
      );
      await until('the gateway to drop the oldest half-open sockets', () => closed >= 180);
      expect((gw as unknown as { server: { unauthenticated: number } }).server.unauthenticated).toBeLessThanOrEqual(20);
      const alice = await Hutch.connect(url, { token: TENANTS.alice });
      expect((await (await alice.attach(aliceSession)).files.read('secret.txt')).content).toContain('alice only');
      alice.close();
      // The rest time out unauthenticated.
      await until('the rest to time out', () => closed >= 200);
    }, 60_000);

    it('a principal holds a bounded number of connections to a gateway', async () => {
      const held = await Promise.all([0, 1, 2].map(() => Hutch.connect(url, { token: TENANTS.bob })));
      const e = await failure(Hutch.connect(url, { token: TENANTS.bob }));
      expect(e.code).toBe('busy');
      expect(e.message).toContain('429');
      // Another principal is not locked out by bob.
      const alice = await Hutch.connect(url, { token: TENANTS.alice });
      alice.close();
      for (const h of held) h.close();
    });
  });
});
