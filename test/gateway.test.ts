/**
 * Many hosts behind gateways, with real processes: redis-server as the catalog, three
 * brokers (unsafe-local: file calls are in-process anyway), two gateways. Placement by load,
 * sticky routing whichever gateway a call enters by, and the failure semantics: a gateway
 * killed loses nothing, a broker killed answers `unavailable` naming it, a drained broker
 * finishes its call in flight, deregisters, and gets its sessions back when it restarts.
 */
import { createHash, randomBytes } from 'node:crypto';
import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Hutch, HutchError, type TelemetryEvent } from '../host-broker/src/sdk/index.ts';
import { Sandbox as E2bSandbox } from 'e2b';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { Catalog } from '../host-broker/src/catalog/catalog.ts';
import { place } from '../host-broker/src/gateway/placement.ts';
import { clusterSkipReason, failure as failed, GATEWAY_CREDENTIAL, startCluster, TENANTS, until, type Broker, type Cluster, type GatewayProc } from './helpers/cluster.ts';

const skip = clusterSkipReason();
if (skip) console.log(`SKIPPING test/gateway.test.ts: ${skip}`);

const work = mkdtempSync(join(tmpdir(), 'hutch-gateway-'));
let cluster: Cluster;
let b1: Broker, b2: Broker, b3: Broker;
let g1: GatewayProc, g2: GatewayProc;
/** Session id -> broker id, as placed through the gateways. */
const placed = new Map<string, string>();

/** The catalog's key of a principal's session. */
const sessionKey = (sid: string, principal = 'alice') => `hutch:session:${principal}:${sid}`;

async function brokerOf(sid: string, principal = 'alice'): Promise<string> {
  const v = await cluster.catalog.command('GET', sessionKey(sid, principal));
  return (JSON.parse(String(v)) as { broker: string }).broker;
}

const failure = (p: Promise<unknown>) => failed<HutchError>(p);

describe.skipIf(skip !== undefined)('hutch gateway in front of three brokers', () => {
  beforeAll(async () => {
    cluster = await startCluster(work);
    [b1, b2, b3] = await Promise.all([cluster.startBroker('b1', { templates: ['python'] }), cluster.startBroker('b2'), cluster.startBroker('b3', { leaseMs: 60_000 })]);
    [g1, g2] = await Promise.all([cluster.startGateway(), cluster.startGateway()]);
  }, 120_000);

  afterAll(async () => {
    await cluster?.stopAll();
    rmSync(work, { recursive: true, force: true });
  }, 60_000);

  it('places 30 sessions made through both gateways by load: a broker already carrying sessions gets fewer', async () => {
    // Load b1 first, directly: its /load then reports 12 sessions more than the others.
    const direct = await Hutch.connect(b1.url, { token: TENANTS.alice });
    const pre = new Set<string>();
    for (let i = 0; i < 12; i++) pre.add((await direct.create()).id);
    direct.close();
    const via = [await Hutch.connect(g1.url, { token: TENANTS.alice }), await Hutch.connect(g2.url, { token: TENANTS.alice })];
    for (let i = 0; i < 30; i++) {
      const sb = await (via[i % 2] as Hutch).create({ workspace: { files: { 'who.txt': `session ${i}\n` } } });
      placed.set(sb.id, await brokerOf(sb.id));
    }
    for (const h of via) h.close();
    const count = (b: string) => [...placed.values()].filter((x) => x === b).length;
    // Each gateway counts its placements per broker; together they placed all 30.
    let counted = 0;
    for (const g of [g1, g2]) {
      const text = await (await fetch(`${g.url.replace(/^ws/, 'http')}/metrics`, { headers: { authorization: `Bearer ${TENANTS.alice}` } })).text();
      for (const m of text.matchAll(/^hutch_gateway_placements_total\{broker="b\d"\} (\d+)$/gm)) counted += Number(m[1]);
    }
    expect(counted).toBe(30);
    expect(placed.size).toBe(30);
    expect(count('b2')).toBeGreaterThan(0);
    expect(count('b3')).toBeGreaterThan(0);
    expect(count('b1')).toBeLessThan(Math.min(count('b2'), count('b3')));
    // The catalog says what the brokers hold: each broker lists exactly the sessions placed on it.
    for (const b of [b1, b2, b3]) {
      const h = await Hutch.connect(b.url, { token: TENANTS.alice });
      const ids = (await h.sessions()).map((s) => s.session).filter((s) => !pre.has(s));
      h.close();
      expect(ids.sort()).toEqual([...placed].filter(([, x]) => x === b.id).map(([s]) => s).sort());
    }
  }, 120_000);

  it('every call of a session reaches the broker that owns it, whichever gateway it enters by', async () => {
    const [a, b] = [await Hutch.connect(g1.url, { token: TENANTS.alice }), await Hutch.connect(g2.url, { token: TENANTS.alice })];
    for (const [sid, broker] of placed) {
      const w = await a.attach(sid);
      await w.files.write('marker.txt', `written via g1 for ${sid}\n`);
      const r = await (await b.attach(sid)).files.read('marker.txt');
      expect(r.content).toContain(`written via g1 for ${sid}`);
      // On disk only on the owning node.
      for (const node of [b1, b2, b3]) expect(existsSync(join(node.dataDir, 'sessions', sid, 'workspace', 'marker.txt'))).toBe(node.id === broker);
    }
    a.close();
    b.close();
  }, 120_000);

  it('streamed output comes through a gateway whole and in order, in either encoding', async () => {
    const sid = [...placed.keys()][0] as string;
    for (const encoding of ['msgpack', 'json'] as const) {
      const h = await Hutch.connect(g1.url, { token: TENANTS.alice, encoding });
      const chunks: string[] = [];
      const r = await (await h.attach(sid)).run('seq 1 200000; echo end >&2', { onStdout: (c) => void chunks.push(c), maxOutputBytes: 4 * 1024 * 1024 });
      const expected = Array.from({ length: 200000 }, (_, i) => `${i + 1}\n`).join('');
      expect(chunks.join('')).toBe(expected);
      expect(r.stdout).toBe(expected);
      expect(r.stderr).toBe('end\n');
      h.close();
    }
  }, 60_000);

  it('streamed uploads and downloads (ops added to the protocol after the gateway) are routed by their session field', async () => {
    const [sid, owner] = [...placed][1] as [string, string];
    const data = randomBytes(3 * 1024 * 1024 + 17);
    const digest = createHash('sha256').update(data).digest('hex');
    for (const encoding of ['msgpack', 'json'] as const) {
      const up = await Hutch.connect(g1.url, { token: TENANTS.alice, encoding });
      const r = await (await up.attach(sid)).files.upload(`big-${encoding}.bin`, data, { size: data.length });
      expect(r.sha256).toBe(digest);
      up.close();
      expect(createHash('sha256').update(readFileSync(join(work, `data-${owner}`, 'sessions', sid, 'workspace', `big-${encoding}.bin`))).digest('hex')).toBe(digest);
      const down = await Hutch.connect(g2.url, { token: TENANTS.alice, encoding });
      const parts: Buffer[] = [];
      for await (const c of (await down.attach(sid)).files.download(`big-${encoding}.bin`)) parts.push(c);
      expect(createHash('sha256').update(Buffer.concat(parts)).digest('hex')).toBe(digest);
      down.close();
    }
  }, 60_000);

  it('MCP over HTTP at a gateway: its tools reach sessions on any broker, as the caller', async () => {
    const mcp = async (g: GatewayProc, token: string) => {
      const client = new Client({ name: 'gateway-test', version: '1' });
      await client.connect(new StreamableHTTPClientTransport(new URL(`${g.url.replace(/^ws/, 'http')}/mcp`), { requestInit: { headers: { authorization: `Bearer ${token}` } } }));
      return client;
    };
    const alice = await mcp(g1, TENANTS.alice);
    const made = (await alice.callTool({ name: 'create_sandbox', arguments: {} })) as { structuredContent?: { sandbox_id?: string } };
    const id = made.structuredContent?.sandbox_id as string;
    expect(placed.has(id)).toBe(false);
    expect(['b1', 'b2', 'b3']).toContain(await brokerOf(id));
    // A session made over the harness API, used over MCP at the other gateway.
    const [sid] = [...placed.keys()] as [string];
    const alice2 = await mcp(g2, TENANTS.alice);
    const read = (await alice2.callTool({ name: 'run_command', arguments: { sandbox_id: sid, command: 'cat who.txt' } })) as { content: Array<{ text: string }> };
    expect(read.content.map((c) => c.text).join('')).toMatch(/session \d+/);
    const bob = await mcp(g2, TENANTS.bob);
    const denied = (await bob.callTool({ name: 'run_command', arguments: { sandbox_id: sid, command: 'cat who.txt' } })) as { isError?: boolean; content: Array<{ text: string }> };
    expect(denied.isError).toBe(true);
    expect(denied.content.map((c) => c.text).join('')).toContain('not_found');
    await alice.callTool({ name: 'close_sandbox', arguments: { sandbox_id: id } });
    expect(await cluster.catalog.command('EXISTS', sessionKey(id))).toBe(0);
    for (const c of [alice, alice2, bob]) await c.close();
  }, 60_000);

  it('a session closed through one gateway answers not_found through another that had its placement cached', async () => {
    const [a1, a2] = [await Hutch.connect(g1.url, { token: TENANTS.alice }), await Hutch.connect(g2.url, { token: TENANTS.alice })];
    for (let i = 0; i < 4; i++) {
      const sb = await a1.create({ workspace: { files: { 'owner.txt': 'alice\n' } } });
      expect((await (await a2.attach(sb.id)).files.read('owner.txt')).content).toContain('alice'); // g2 now remembers the placement
      await sb.close();
      expect((await failure(a2.request('call', { session: sb.id, tool: 'read', args: { filePath: 'owner.txt' } }))).code).toBe('not_found');
      expect((await failure(a2.attach(sb.id))).code).toBe('not_found');
    }
    for (const h of [a1, a2]) h.close();
  }, 60_000);

  it('a create naming a template goes only to a broker advertising it', async () => {
    // The placement itself, against the live brokers' real /load (the unsafe-local brokers here
    // cannot boot a template, so a create with one is refused by the broker it lands on).
    const catalog = new Catalog(cluster.redisUrl);
    const live = await catalog.liveBrokers();
    catalog.close();
    expect(live.map((b) => b.id).sort()).toEqual(['b1', 'b2', 'b3']);
    for (let i = 0; i < 10; i++) {
      const p = await place(live, { template: 'python', memoryMiB: 512, k: 2, credential: GATEWAY_CREDENTIAL, timeoutMs: 3000 });
      expect(p.broker.id).toBe('b1');
    }
    const h = await Hutch.connect(g1.url, { token: TENANTS.alice });
    const e = await failure(h.request('create', { template: 'no-such-template' }));
    expect(e.code).toBe('unavailable');
    expect(e.context?.['template']).toBe('no-such-template');
    // Telemetry of all sessions: every broker's subscription, relayed; cancelling ends them all.
    const events: TelemetryEvent[] = [];
    const r = await h.telemetry({ intervalMs: 100, count: 2, onSample: (ev) => events.push(ev) });
    expect(r.samples).toBe(6);
    expect(events).toHaveLength(6);
    const seen = new Set(events.flatMap((ev) => ev.sessions.map((x) => x.session)));
    for (const id of placed.keys()) expect(seen.has(id)).toBe(true);
    const ac = new AbortController();
    let got = 0;
    const sub = h.telemetry({ intervalMs: 100, signal: ac.signal, onSample: () => ++got === 3 && ac.abort() });
    expect((await sub).cancelled).toBe(true);
    // sessions is asked of every broker: the list through a gateway holds every placed session.
    const listed = new Set((await h.sessions()).map((x) => x.session));
    for (const id of placed.keys()) expect(listed.has(id)).toBe(true);
    h.close();
  }, 60_000);

  it('the E2B SDK works through the gateways: a sandbox made via one is used and killed via the other', async () => {
    const opts = (g: GatewayProc, apiKey: string) => ({ apiKey, apiUrl: `${g.url.replace(/^ws/, 'http')}/e2b/api`, sandboxUrl: `${g.url.replace(/^ws/, 'http')}/e2b/envd` });
    const sbx = await E2bSandbox.create({ ...opts(g1, TENANTS.alice), envs: { WHO: 'e2b-via-gateway' } });
    const owner = await brokerOf(sbx.sandboxId);
    const chunks: string[] = [];
    const r = await sbx.commands.run('printf %s "$WHO"; echo; echo two', { onStdout: (d) => void chunks.push(d) });
    expect(r.stdout).toBe('e2b-via-gateway\ntwo\n');
    expect(chunks.join('')).toBe(r.stdout);
    await sbx.files.write('/work/e2b.txt', 'written through g1\n');
    expect(existsSync(join(work, `data-${owner}`, 'sessions', sbx.sandboxId, 'workspace', 'e2b.txt'))).toBe(true);
    // The other gateway: connect by id, read, list, kill.
    const again = await E2bSandbox.connect(sbx.sandboxId, opts(g2, TENANTS.alice));
    expect(await again.files.read('/work/e2b.txt')).toBe('written through g1\n');
    expect((await again.commands.run('cat e2b.txt')).stdout).toBe('written through g1\n');
    const listed = await E2bSandbox.list(opts(g2, TENANTS.alice)).nextItems();
    expect(listed.map((x) => x.sandboxId)).toContain(sbx.sandboxId);
    // Another principal's key: the sandbox does not exist for it.
    await expect(E2bSandbox.getInfo(sbx.sandboxId, opts(g2, TENANTS.bob))).rejects.toThrow();
    await expect(E2bSandbox.connect(sbx.sandboxId, opts(g1, TENANTS.bob))).rejects.toThrow();
    await again.kill();
    expect(await cluster.catalog.command('EXISTS', sessionKey(sbx.sandboxId))).toBe(0);
  }, 60_000);

  it('a gateway stopped with SIGTERM lets its call in flight finish, and says it is not ready meanwhile', async () => {
    const g3 = await cluster.startGateway();
    const h = await Hutch.connect(g3.url, { token: TENANTS.alice });
    const sb = await h.attach([...placed.keys()][0] as string);
    let started!: () => void;
    const isStarted = new Promise<void>((r) => (started = r));
    const inflight = sb.run('echo start; sleep 1; echo done', { onStdout: (c) => c.includes('start') && started() });
    await isStarted;
    g3.p.kill('SIGTERM');
    await until('the gateway to report draining', async () => (await fetch(`${g3.url.replace(/^ws/, 'http')}/readyz`).then((r) => r.status, () => 0)) === 503);
    // Not ready, still alive: a liveness probe must not restart it while it drains.
    expect((await fetch(`${g3.url.replace(/^ws/, 'http')}/healthz`)).status).toBe(200);
    const r = await inflight;
    expect(r.stdout).toBe('start\ndone\n');
    expect(await g3.exited).toBe(0);
    h.close();
  }, 60_000);

  it('the catalog loses its data: routed calls go on, and the brokers put their sessions back', async () => {
    const h = await Hutch.connect(g1.url, { token: TENANTS.alice });
    const ids = [...placed.keys()];
    for (const id of ids) await (await h.attach(id)).files.read('who.txt'); // g1 has seen every placement
    cluster.redis.kill('SIGKILL');
    await cluster.redis.exited;
    // Redis gone: placements seen before still route, to brokers still checking ownership.
    for (const id of ids.slice(0, 5)) expect((await (await h.attach(id)).files.read('who.txt')).content).toMatch(/session \d+/);
    expect((await failure(h.create())).code).toBe('unavailable');
    // An empty Redis: each broker finds its record gone at its next renewal and republishes its sessions.
    await cluster.restartRedis();
    await until('every placement to be back in the catalog', async () => {
      for (const [id, broker] of placed) {
        const v = await cluster.catalog.command('GET', sessionKey(id));
        if (typeof v !== 'string' || (JSON.parse(v) as { broker: string; principal: string }).broker !== broker) return false;
      }
      return true;
    }, 60_000); // b3 renews its 60 s lease every 20 s
    expect(JSON.parse(String(await cluster.catalog.command('GET', sessionKey(ids[0] as string))))).toEqual({ broker: placed.get(ids[0] as string), principal: 'alice' });
    const fresh = await Hutch.connect(g2.url, { token: TENANTS.bob });
    expect((await failure(fresh.attach(ids[0] as string))).code).toBe('not_found');
    fresh.close();
    expect(placed.get((await h.create()).id) ?? 'new').toBe('new');
    h.close();
  }, 120_000);

  it('a gateway SIGKILLed mid-run loses no session: the client reconnects to the other one', async () => {
    const h = await Hutch.connect(g1.url, { token: TENANTS.alice });
    const ids = [...placed.keys()].slice(0, 10);
    const sbs = await Promise.all(ids.map((id) => h.attach(id)));
    let stop = false;
    const loops = sbs.map(async (sb) => {
      let n = 0;
      while (!stop) {
        await sb.files.write('counter.txt', `${++n}\n`);
        await sb.files.read('counter.txt');
      }
    });
    await new Promise((r) => setTimeout(r, 300));
    g1.kill('SIGKILL');
    const settled = await Promise.allSettled(loops);
    stop = true;
    // The killed gateway's calls fail as a closed connection, nothing worse.
    for (const s of settled) expect(s.status === 'rejected' && (s.reason as HutchError).code).toBe('connection_closed');
    const again = await Hutch.connect(g2.url, { token: TENANTS.alice });
    for (const id of placed.keys()) {
      const r = await (await again.attach(id)).files.read('who.txt');
      expect(r.content).toMatch(/session \d+/);
    }
    again.close();
  }, 120_000);

  it('a broker SIGKILLed: its sessions answer unavailable naming it; new sessions land elsewhere once its lease expired', async () => {
    b2.kill('SIGKILL');
    await b2.exited;
    const h = await Hutch.connect(g2.url, { token: TENANTS.alice });
    const onB2 = [...placed].filter(([, b]) => b === 'b2').map(([s]) => s);
    const others = [...placed].filter(([, b]) => b !== 'b2').map(([s]) => s);
    for (const sid of onB2) {
      const e = await failure(h.request('call', { session: sid, tool: 'read', args: { filePath: 'who.txt' } }));
      expect(e.code).toBe('unavailable');
      expect(e.context?.['broker']).toBe('b2');
      expect(e.message).toContain('b2');
    }
    for (const sid of others.slice(0, 5)) expect((await (await h.attach(sid)).files.read('who.txt')).content).toContain('session');
    // The list through a gateway says which broker could not answer, and lists the rest.
    const list = (await h.request('sessions', {})) as { sessions: Array<{ session: string }>; unavailable?: string[] };
    expect(list.unavailable).toEqual(['b2']);
    expect(list.sessions.map((x) => x.session)).toEqual(expect.arrayContaining(others));
    await until('the lease of b2 to expire', async () => (await cluster.catalog.command('EXISTS', 'hutch:broker:b2')) === 0);
    for (let i = 0; i < 8; i++) {
      const sb = await h.create();
      expect(await brokerOf(sb.id)).not.toBe('b2');
      await sb.close();
      expect(await cluster.catalog.command('EXISTS', sessionKey(sb.id))).toBe(0);
    }
    h.close();
  }, 120_000);

  it('a drained broker finishes its call in flight, deregisters, refuses new work, and has its sessions back when it restarts', async () => {
    const onB3 = [...placed].filter(([, b]) => b === 'b3').map(([s]) => s);
    expect(onB3.length).toBeGreaterThan(0);
    const sid = onB3[0] as string;
    const h = await Hutch.connect(g2.url, { token: TENANTS.alice });
    const sb = await h.attach(sid);
    let started!: () => void;
    const isStarted = new Promise<void>((r) => (started = r));
    const inflight = sb.run('echo start; sleep 2; echo done', { onStdout: (c) => c.includes('start') && started() });
    await isStarted;
    // SIGTERM to the broker process only, as Kubernetes sends it to the container's PID 1.
    b3.p.kill('SIGTERM');
    const r = await inflight;
    expect(r.exitCode).toBe(0);
    expect(r.stdout).toBe('start\ndone\n');
    expect(await b3.exited).toBe(0);
    // Its lease was 60 s: the record is gone because it deregistered, not because it expired.
    expect(await cluster.catalog.command('EXISTS', 'hutch:broker:b3')).toBe(0);
    const e = await failure(h.request('call', { session: sid, tool: 'read', args: { filePath: 'who.txt' } }));
    expect(e.code).toBe('unavailable');
    expect(e.context?.['broker']).toBe('b3');
    for (let i = 0; i < 4; i++) expect(await brokerOf((await h.create()).id)).toBe('b1');
    // Back on the same node (same id, same data dir): its sessions answer again, workspaces intact.
    b3 = await cluster.startBroker('b3', { dataDir: b3.dataDir });
    for (const id of onB3) expect((await (await h.attach(id)).files.read('marker.txt')).content).toContain(`written via g1 for ${id}`);
    expect(readFileSync(join(b3.dataDir, 'sessions', sid, 'workspace', 'who.txt'), 'utf8')).toMatch(/^session \d+/);
    h.close();
  }, 120_000);
});

describe.skipIf(skip !== undefined)('a drained qemu broker behind a gateway', { tags: ['vm'] }, () => {
  const vmWork = mkdtempSync(join(tmpdir(), 'hutch-gateway-vm-'));
  let c: Cluster;
  afterAll(async () => {
    await c?.stopAll();
    rmSync(vmWork, { recursive: true, force: true });
  }, 120_000);

  it('releases its VM into its snapshot slot: after a restart the session resumes from it', async () => {
    c = await startCluster(vmWork);
    // Never released while idle: the drain is the only release this VM sees.
    const vmArgs = { backend: 'qemu' as const, args: ['--idle-ms', '0'], leaseMs: 60_000 };
    let broker = await c.startBroker('vm1', vmArgs);
    const gw = await c.startGateway();
    const h = await Hutch.connect(gw.url, { token: TENANTS.alice });
    const sb = await h.create({ workspace: { files: { 'a.txt': 'in the workspace\n' } } });
    // A change outside /work and /tmp: the release policy keeps such a guest in a snapshot slot (a clean one is just stopped).
    const first = await sb.run('echo kept-in-the-slot > ~/marker; cat a.txt', { route: 'vm' });
    expect(first.stdout).toBe('in the workspace\n');
    expect(first.route).toBe('vm');
    broker.p.kill('SIGTERM');
    expect(await broker.exited).toBe(0);
    expect(await c.catalog.command('EXISTS', 'hutch:broker:vm1')).toBe(0);
    broker = await c.startBroker('vm1', { ...vmArgs, dataDir: broker.dataDir });
    // The home directory is guest state, not workspace: only a restore from the session's own slot has the marker.
    const again = await (await h.attach(sb.id)).run('cat ~/marker; cat a.txt', { route: 'vm' });
    expect(again.woke).toBe(true);
    expect(again.stdout).toBe('kept-in-the-slot\nin the workspace\n');
    h.close();
  }, 1_200_000);
});
