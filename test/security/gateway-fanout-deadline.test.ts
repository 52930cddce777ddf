/**
 * A gateway asks every live broker for `sessions`, `telemetry` without a session and E2B's
 * sandbox list, and passes a `signal` on to each broker a call went to. One broker frozen
 * (SIGSTOP: its lease still current, its sockets open, nothing answered) held every such
 * answer forever, on a connection that already reached it and on a new one. Each broker now
 * gets a deadline; the answer holds what the others gave and names the one it lacks.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import WebSocket from 'ws';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Hutch } from '../../host-broker/src/sdk/index.ts';
import { clusterSkipReason, startCluster, TENANTS, type Broker, type Cluster, type GatewayProc } from '../helpers/cluster.ts';

const skip = clusterSkipReason();
if (skip) console.log(`SKIPPING test/security/gateway-fanout-deadline.test.ts: ${skip}`);

const work = mkdtempSync(join(tmpdir(), 'hutch-fanout-'));
let cluster: Cluster;
let b1: Broker, b2: Broker;
let gw: GatewayProc;
/** Connections that reached both brokers before b2 froze. */
let alice: Hutch;
let raw: Awaited<ReturnType<typeof rawClient>>;
let onB1: string, onB2: string;

/** The promise's value, or a failure naming what hung (a bound on a hang, not a timing assertion). */
async function within<T>(ms: number, what: string, p: Promise<T>): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const hung = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`${what}: no answer within ${ms} ms with broker b2 frozen`)), ms)));
  try {
    return await Promise.race([p, hung]);
  } finally {
    clearTimeout(timer);
  }
}

/** A raw client, to send a `signal` for a call and read both answers. */
function rawClient(url: string): Promise<{ send(id: number, op: string, p: unknown): void; answer(id: number): Promise<{ r?: unknown; e?: { code: string } }>; firstEvent(id: number): Promise<unknown>; close(): void }> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(url, { headers: { authorization: `Bearer ${TENANTS.alice}` } });
    const answers = new Map<number, (m: { r?: unknown; e?: { code: string } }) => void>();
    const events = new Map<number, (d: unknown) => void>();
    ws.on('message', (d) => {
      const m = JSON.parse(String(d)) as { t: string; id?: number; call?: number; r?: unknown; e?: { code: string }; d?: unknown };
      if (m.t === 'hello') {
        resolve({
          send: (id, op, p) => ws.send(JSON.stringify({ t: 'req', id, op, p })),
          answer: (id) => new Promise((r) => answers.set(id, r)),
          firstEvent: (id) => new Promise((r) => events.set(id, r)),
          close: () => ws.close(),
        });
      } else if (m.t === 'res' && m.id !== undefined) answers.get(m.id)?.(m);
      else if (m.t === 'evt' && m.call !== undefined) {
        events.get(m.call)?.(m.d);
        events.delete(m.call);
      }
    });
    ws.once('error', reject);
  });
}

describe.skipIf(skip !== undefined)('gateway fan-out with one broker frozen', () => {
  beforeAll(async () => {
    cluster = await startCluster(work);
    b1 = await cluster.startBroker('b1');
    // A long lease: frozen, b2 stays in the catalog's live list, so the gateway keeps asking it.
    b2 = await cluster.startBroker('b2', { leaseMs: 300_000 });
    gw = await cluster.startGateway();
    for (const [b, set] of [
      [b1, (id: string) => (onB1 = id)],
      [b2, (id: string) => (onB2 = id)],
    ] as const) {
      const direct = await Hutch.connect(b.url, { token: TENANTS.alice });
      set((await direct.create({})).id);
      direct.close();
    }
    alice = await Hutch.connect(gw.url, { token: TENANTS.alice });
    const both = (await alice.request('sessions', {})) as { sessions: Array<{ session: string }>; unavailable?: string[] };
    expect(both.sessions.map((s) => s.session).sort()).toEqual([onB1, onB2].sort());
    expect(both.unavailable).toBeUndefined();
    raw = await rawClient(gw.url);
    const listed = raw.answer(100);
    raw.send(100, 'sessions', {});
    expect(((await listed).r as { sessions: unknown[] }).sessions).toHaveLength(2);
    b2.kill('SIGSTOP');
  }, 120_000);

  afterAll(async () => {
    b2?.kill('SIGCONT');
    alice?.close();
    raw?.close();
    await cluster?.stopAll();
    rmSync(work, { recursive: true, force: true });
  }, 60_000);

  it('sessions answers with the live broker\'s sessions and names the frozen one, on an existing connection and on a new one', async () => {
    const r = (await within(30_000, 'sessions', alice.request('sessions', {}))) as { sessions: Array<{ session: string }>; unavailable?: string[] };
    expect(r.sessions.map((s) => s.session)).toEqual([onB1]);
    expect(r.unavailable).toEqual(['b2']);
    const fresh = await Hutch.connect(gw.url, { token: TENANTS.alice });
    try {
      const again = (await within(30_000, 'sessions on a new connection', fresh.request('sessions', {}))) as { sessions: Array<{ session: string }>; unavailable?: string[] };
      expect(again.sessions.map((s) => s.session)).toEqual([onB1]);
      expect(again.unavailable).toEqual(['b2']);
    } finally {
      fresh.close();
    }
  }, 90_000);

  it('telemetry of all sessions ends with the live broker\'s samples and names the frozen one', async () => {
    const seen: string[][] = [];
    const r = await within(60_000, 'telemetry', alice.telemetry({ intervalMs: 200, count: 2, onSample: (e) => seen.push(e.sessions.map((s) => s.session)) }));
    expect(r).toEqual({ samples: 2, cancelled: false, unavailable: ['b2'] });
    expect(seen).toEqual([[onB1], [onB1]]);
  }, 90_000);

  it('a signal passed on to a frozen broker answers, naming it, and the call it stopped ends', async () => {
    const c = raw;
    {
      const subscription = c.answer(1);
      const first = c.firstEvent(1);
      c.send(1, 'telemetry', { intervalMs: 200 });
      await within(30_000, 'the first telemetry event', first);
      const signalled = c.answer(2);
      c.send(2, 'signal', { call: 1, signal: 'SIGTERM' });
      expect((await within(30_000, 'signal', signalled)).r).toEqual({ delivered: true, unavailable: ['b2'] });
      const ended = await within(60_000, 'the signalled telemetry call', subscription);
      expect(ended.r).toMatchObject({ cancelled: true, unavailable: ['b2'] });
    }
  }, 150_000);

  it("E2B's sandbox list answers without the frozen broker and names it", async () => {
    const http = gw.url.replace(/^ws/, 'http');
    const r = await within(30_000, 'the E2B list', fetch(`${http}/e2b/api/v2/sandboxes`, { headers: { 'x-api-key': TENANTS.alice } }));
    expect(r.status).toBe(200);
    expect(r.headers.get('x-hutch-unavailable')).toBe('b2');
    expect(await r.json()).toEqual([]);
  }, 60_000);
});
