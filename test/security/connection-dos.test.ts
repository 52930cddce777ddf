import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { connect, type Socket } from 'node:net';
import WebSocket from 'ws';
import { pack } from 'msgpackr';
import { DEFAULT_WS_LIMITS } from '../../host-broker/src/api/ws-server.ts';
import { Hutch } from '../../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/**
 * Issue 12 item 7: 21,000 half-open unauthenticated sockets used up the broker's file
 * descriptors (a legitimate client got `socket hang up`, /healthz hung), and ten parallel
 * 250 MB frames took the broker to ~3.8 GB while another tenant's read waited.
 * Loopback only; every socket here is closed by the test or by the broker.
 */
const HALF_OPEN = 3000;

describe('connection-level limits', () => {
  let b: TestBroker;
  const sockets: Socket[] = [];
  beforeAll(async () => {
    b = await startBroker({ limits: { handshakeTimeoutMs: 2000, maxUnauthenticated: 100, maxConnectionsPerPrincipal: 4 } });
  });
  afterAll(async () => {
    for (const s of sockets) s.destroy();
    await b?.stop();
  });

  it('has a frame limit of at most 64 MiB by default', () => {
    expect(DEFAULT_WS_LIMITS.maxPayloadBytes).toBeLessThanOrEqual(64 * 1024 * 1024);
    expect(DEFAULT_WS_LIMITS.handshakeTimeoutMs).toBeGreaterThan(0);
  });

  it('thousands of half-open sockets do not lock out a client or /healthz, and the broker drops them', async () => {
    const port = Number(new URL(b.url).port);
    let closedByBroker = 0;
    await Promise.all(
      Array.from({ length: HALF_OPEN }, () =>
        new Promise<void>((resolve) => {
          const s = connect({ port, host: '127.0.0.1' });
          sockets.push(s);
          s.on('close', () => closedByBroker++);
          s.on('error', () => undefined);
          // Half an HTTP request, then silence.
          s.once('connect', () => {
            s.write('GET / HTTP/1.1\r\nHost: x\r\n');
            resolve();
          });
          s.once('error', () => resolve());
        }),
      ),
    );
    // The broker holds at most its cap of unauthenticated sockets, dropping the oldest.
    await until(() => closedByBroker >= HALF_OPEN - 100);
    expect(b.broker['server']?.unauthenticated).toBeLessThanOrEqual(100);
    const health = await fetch(`${b.url.replace('ws:', 'http:')}/healthz`);
    expect(health.status).toBe(200);
    const h = await b.connect();
    const sb = await h.create({ workspace: { files: { 'a.txt': 'still here\n' } } });
    expect((await sb.files.read('a.txt')).content).toBe('00001| still here');
    await sb.close();
    h.close();
    // The rest go at the handshake timeout, none left open.
    await until(() => closedByBroker === HALF_OPEN);
  });

  it('caps connections per principal', async () => {
    const held: Hutch[] = [];
    try {
      for (let i = 0; i < 4; i++) held.push(await b.connect());
      const fifth = new WebSocket(b.url, { headers: { authorization: `Bearer ${b.token}` } });
      const status = await new Promise<number>((r) => fifth.once('unexpected-response', (_q, res) => r(res.statusCode ?? 0)));
      expect(status).toBe(429);
    } finally {
      for (const h of held) h.close();
    }
    const server = b.broker['server'] as { connections: number };
    await until(() => server.connections === 0);
  });

  it('stops reading a connection with too many unfinished requests, without stalling another', async () => {
    const limit = DEFAULT_WS_LIMITS.maxInflightPerConnection;
    const h = await b.connect();
    const sb = await h.create({ workspace: { files: { 'x.txt': 'x\n' } } });
    const slow = await h.create();
    const hog = new WebSocket(b.url, { headers: { authorization: `Bearer ${b.token}` } });
    hog.on('error', () => undefined);
    await new Promise((r) => hog.once('open', r));
    // Ten times the limit of calls that wait (a session runs its calls in order), each frame
    // padded so that a socket read carries about one of them.
    const pad = 'p'.repeat(64 * 1024);
    for (let id = 1; id <= limit * 10; id++) {
      hog.send(pack({ t: 'req', id, op: 'call', p: { session: slow.id, tool: 'bash', args: { command: 'sleep 60', description: pad } } }));
    }
    // Another tenant's calls are answered meanwhile; by the second one the broker has
    // handled everything it had read from the hog.
    expect((await sb.files.read('x.txt')).content).toBe('00001| x');
    expect((await sb.files.read('x.txt')).content).toBe('00001| x');
    const server = b.broker['server'] as { inflight: number };
    // Let the broker take in all it will: its count stops moving.
    for (let last = -1, still = 0; still < 10; ) {
      await new Promise((r) => setTimeout(r, 50));
      still = server.inflight === last ? still + 1 : 0;
      last = server.inflight;
    }
    // What the broker took in is bounded by the limit (plus frames already read when it paused);
    // the rest waits in the hog's own socket.
    expect(server.inflight).toBeLessThanOrEqual(limit + 16);
    expect(hog.bufferedAmount).toBeGreaterThan(0);
    hog.terminate();
    await sb.close();
    h.close();
  });
});

async function until(cond: () => boolean): Promise<void> {
  while (!cond()) await new Promise((r) => setTimeout(r, 50));
}
