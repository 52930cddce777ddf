/**
 * /mcp as a browser page could reach it: by DNS rebinding (a page on evil.example re-points
 * its name at the broker, then calls it with `Origin: https://evil.example` and
 * `Host: evil.example`), and with a token copied from a URL (`/mcp?token=...`, which proxies
 * and shells log). The MCP transport specification says servers must refuse an Origin they
 * do not allow (403); hutch allows none unless listed, checks Host against its own names,
 * and takes a token from the Authorization header only. On the broker and on the gateway.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { request } from 'node:http';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startBroker, type TestBroker } from '../helpers/broker.ts';
import { clusterSkipReason, startCluster, TENANTS, type Cluster } from '../helpers/cluster.ts';

const INIT = { jsonrpc: '2.0', id: 1, method: 'initialize', params: { protocolVersion: '2025-06-18', capabilities: {}, clientInfo: { name: 'probe', version: '1' } } };
const MCP_HEADERS = { 'content-type': 'application/json', accept: 'application/json, text/event-stream' };
const ALLOWED_ORIGIN = 'https://app.example.com';
const EXTRA_HOST = 'hutch.internal';

/** One request with the headers given as they are (fetch would not let a test set Host). */
function send(url: string, o: { method?: string; headers?: Record<string, string>; body?: string }): Promise<{ status: number; session: string | undefined; body: string }> {
  return new Promise((resolve, reject) => {
    const req = request(url, { method: o.method ?? 'POST', headers: { ...MCP_HEADERS, ...o.headers }, agent: false }, (res) => {
      let body = '';
      res.setEncoding('utf8');
      res.on('data', (d: string) => (body += d.slice(0, 4096)));
      res.on('end', () => resolve({ status: res.statusCode ?? 0, session: res.headers['mcp-session-id'] as string | undefined, body }));
    });
    req.on('error', reject);
    req.end(o.body);
  });
}

const initialize = (url: string, headers: Record<string, string>) => send(url, { headers, body: JSON.stringify(INIT) });

/** The checks both servers must pass, given where /mcp is and a valid token. */
function rebindingChecks(where: () => { endpoint: string; port: number; token: string }): void {
  it('a token in the query string is not a credential: 401, and nothing is opened', async () => {
    const { endpoint, token } = where();
    const r = await initialize(`${endpoint}?token=${token}`, {});
    expect(r.status).toBe(401);
    expect(r.session).toBeUndefined();
    // Nor anywhere else over plain HTTP (the gateway serves /metrics with a query at all: 404).
    const metrics = await send(`${endpoint.replace(/\/mcp$/, '/metrics')}?token=${token}`, { method: 'GET' });
    expect([401, 404]).toContain(metrics.status);
  });

  it('a foreign Origin is refused with 403 before anything runs, valid token or not', async () => {
    const { endpoint, token } = where();
    for (const origin of ['https://evil.example', 'null', 'http://127.0.0.1', `${ALLOWED_ORIGIN}.evil.example`]) {
      const r = await initialize(endpoint, { authorization: `Bearer ${token}`, origin });
      expect(r.status, origin).toBe(403);
      expect(r.session, origin).toBeUndefined();
      expect(r.body, origin).toMatch(/permission_denied: Origin/);
    }
    expect((await initialize(endpoint, { origin: 'https://evil.example' })).status).toBe(403);
    // The listed origin, and no Origin at all (an MCP client that is not a browser), are served.
    expect((await initialize(endpoint, { authorization: `Bearer ${token}`, origin: ALLOWED_ORIGIN })).status).toBe(200);
    expect((await initialize(endpoint, { authorization: `Bearer ${token}` })).status).toBe(200);
  });

  it("a Host that is none of the server's names is refused with 403 (a rebound name)", async () => {
    const { endpoint, token, port } = where();
    const auth = { authorization: `Bearer ${token}` };
    for (const host of ['evil.example', `evil.example:${port}`, `localhost.evil.example:${port}`, `127.0.0.1.nip.io:${port}`]) {
      const r = await initialize(endpoint, { ...auth, host });
      expect(r.status, host).toBe(403);
      expect(r.session, host).toBeUndefined();
    }
    for (const host of [`localhost:${port}`, `127.0.0.1:${port}`, `LOCALHOST:${port}`, EXTRA_HOST, `${EXTRA_HOST}:443`]) {
      expect((await initialize(endpoint, { ...auth, host })).status, host).toBe(200);
    }
  });

  it('an open MCP session is refused as well once a request comes from a foreign page, and goes on for its client', async () => {
    const { endpoint, token } = where();
    const client = new Client({ name: 'probe', version: '1' });
    const transport = new StreamableHTTPClientTransport(new URL(endpoint), { requestInit: { headers: { authorization: `Bearer ${token}` } } });
    await client.connect(transport);
    try {
      const list = JSON.stringify({ jsonrpc: '2.0', id: 2, method: 'tools/list' });
      const headers = { authorization: `Bearer ${token}`, 'mcp-session-id': transport.sessionId as string, 'mcp-protocol-version': '2025-06-18' };
      expect((await send(endpoint, { headers: { ...headers, origin: 'https://evil.example' }, body: list })).status).toBe(403);
      expect((await send(endpoint, { headers: { ...headers, host: 'evil.example' }, body: list })).status).toBe(403);
      expect((await send(endpoint, { method: 'DELETE', headers: { ...headers, origin: 'https://evil.example' } })).status).toBe(403);
      expect((await client.listTools()).tools.length).toBeGreaterThan(0);
    } finally {
      await client.close();
    }
  });
}

describe('/mcp on a broker: Origin, Host and where the token comes from', () => {
  let b: TestBroker;
  beforeAll(async () => {
    b = await startBroker({ backend: 'unsafe-local', mcpHttp: { allowedOrigins: [ALLOWED_ORIGIN], allowedHosts: [EXTRA_HOST] } });
  });
  afterAll(async () => {
    await b?.stop();
  });
  rebindingChecks(() => ({ endpoint: `http://127.0.0.1:${b.broker.port}/mcp`, port: b.broker.port, token: b.token }));
});

const skip = clusterSkipReason();
if (skip) console.log(`SKIPPING the gateway part of test/security/mcp-http-origin.test.ts: ${skip}`);

describe.skipIf(skip !== undefined)('/mcp on a gateway: the same checks', () => {
  const work = mkdtempSync(join(tmpdir(), 'hutch-mcp-origin-'));
  let cluster: Cluster;
  let gateway = { endpoint: '', port: 0, token: TENANTS.alice as string };
  beforeAll(async () => {
    cluster = await startCluster(work);
    await cluster.startBroker('b1');
    const g = await cluster.startGateway({ args: ['--allowed-origin', ALLOWED_ORIGIN, '--allowed-host', EXTRA_HOST] });
    const port = Number(new URL(g.url).port);
    gateway = { endpoint: `http://127.0.0.1:${port}/mcp`, port, token: TENANTS.alice };
  }, 120_000);
  afterAll(async () => {
    await cluster?.stopAll();
    rmSync(work, { recursive: true, force: true });
  }, 60_000);
  rebindingChecks(() => gateway);
});

describe('the allow lists given on the command line are checked', () => {
  it('--allowed-origin takes an origin only; --allowed-host a name or address without a port', async () => {
    const { MCP_HTTP_OPTIONS, mcpHttpFrom } = await import('../../host-broker/src/mcp/http-origin.ts');
    const origin = (t: string) => MCP_HTTP_OPTIONS['allowed-origin'].parse(t);
    const host = (t: string) => MCP_HTTP_OPTIONS['allowed-host'].parse(t);
    expect(mcpHttpFrom({})).toEqual({});
    expect(mcpHttpFrom({ 'allowed-origin': ['https://App.Example.com/', 'http://localhost:5173'].map(origin), 'allowed-host': ['Hutch.Internal', '10.0.0.5', '::1', '[fd00::1]'].map(host) })).toEqual({
      mcpHttp: { allowedOrigins: ['https://app.example.com', 'http://localhost:5173'], allowedHosts: ['hutch.internal', '10.0.0.5', '[::1]', '[fd00::1]'] },
    });
    for (const o of ['*', 'app.example.com', 'https://app.example.com/path', 'https://u:p@app.example.com', 'ftp://app.example.com', 'https://app.example.com?x=1']) {
      expect(() => origin(o), o).toThrow(/--allowed-origin/);
    }
    for (const h of ['*', 'http://hutch.internal', 'hutch.internal:7070', 'hutch internal', 'a/b', '', '-bad.example']) {
      expect(() => host(h), h).toThrow(/--allowed-host/);
    }
  });
});
