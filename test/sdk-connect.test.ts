/**
 * The SDK's first minutes: every way Hutch.connect can fail says what to check (the URL,
 * the token, the versions) with a typed code, against real sockets: a port nobody listens
 * on, a plain HTTP server, a WebSocket server greeting with another protocol version, and
 * a real broker given the wrong token.
 */
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { WebSocketServer } from 'ws';
import { Hutch } from '../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from './helpers/broker.ts';

let b: TestBroker;
const servers: Array<{ close(cb?: () => void): unknown }> = [];

beforeAll(async () => {
  b = await startBroker();
});
afterAll(async () => {
  for (const s of servers) await new Promise((r) => s.close(() => r(undefined)));
  await b?.stop();
});

async function listening(s: Server): Promise<number> {
  servers.push(s);
  await new Promise<void>((r) => s.listen(0, '127.0.0.1', () => r()));
  return (s.address() as AddressInfo).port;
}

const fails = (url: string, token: string | undefined) =>
  Hutch.connect(url, { token: token as string, timeoutMs: 5000 }).then(
    (h) => {
      h.close();
      throw new Error('connected');
    },
    (e: unknown) => e as Error & { code: string },
  );

describe('Hutch.connect says what to check', () => {
  it('an address that is not ws:// (an http:// one is named with its ws:// form)', async () => {
    const e = await fails('http://127.0.0.1:7070', 'x'.repeat(20));
    expect(e.code).toBe('bad_request');
    expect(e.message).toMatch(/ws:\/\/HOST:PORT.*did you mean ws:\/\/127\.0\.0\.1:7070\?/);
  });

  it('no token', async () => {
    const e = await fails(b.url, undefined);
    expect(e.code).toBe('unauthorized');
    expect(e.message).toMatch(/needs \{ token \}/);
  });

  it('nothing listening at the URL', async () => {
    const s = createServer();
    const port = await listening(s);
    await new Promise((r) => s.close(r));
    servers.pop();
    const e = await fails(`ws://127.0.0.1:${port}`, 'x'.repeat(20));
    expect(e.code).toBe('unavailable');
    expect(e.message).toMatch(/nothing listens at .*hutch serve is running/);
  });

  it('a server that is not a hutch broker', async () => {
    const port = await listening(createServer((_req, res) => res.writeHead(404).end('no')));
    const e = await fails(`ws://127.0.0.1:${port}`, 'x'.repeat(20));
    expect(e.code).toBe('unavailable');
    expect(e.message).toMatch(/answered HTTP 404 .*hutch broker's or gateway's address/);
  });

  it('a broker of another protocol version', async () => {
    const http = createServer();
    const wss = new WebSocketServer({ server: http });
    wss.on('connection', (ws) => ws.send(JSON.stringify({ t: 'hello', v: 99, broker: 'hutch', backend: 'qemu', versions: { api: 99, broker: '9.0.0', node: '20' } })));
    const port = await listening(http);
    servers.push(wss);
    const e = await fails(`ws://127.0.0.1:${port}`, 'x'.repeat(20));
    expect(e.code).toBe('unsupported_version');
    expect(e.message).toMatch(/speaks harness API v99 \(hutch 9\.0\.0\), this SDK v1/);
  });

  it('a real broker and the wrong token', async () => {
    const e = await fails(b.url, 'not-the-token-0123456789');
    expect(e.code).toBe('unauthorized');
    expect(e.message).toMatch(/refused the token: check it is the one hutch serve was given/);
    // The right one connects.
    const h = await Hutch.connect(b.url, { token: b.token });
    expect(h.hello.principal).toBe('default');
    h.close();
  });
});
