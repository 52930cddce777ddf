/**
 * /mcp on the broker is reachable by anyone who can reach the broker's port: it must hold
 * the WebSocket API's line. No token or a wrong one is refused (401) before any MCP work;
 * a principal reaches neither another principal's sandboxes (not_found, as if missing) nor
 * its MCP session (404); an oversized body is refused (413), announced ones without being
 * read, unannounced (chunked) ones as soon as the read passes the limit.
 */
import { request } from 'node:http';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import type { CallToolResult } from '@modelcontextprotocol/sdk/types.js';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { DEFAULT_MCP_HTTP_LIMITS } from '../../host-broker/src/mcp/http.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

const BOB = 'bob-token-0123456789abcdef';
const INIT = { jsonrpc: '2.0', id: 1, method: 'initialize', params: { protocolVersion: '2025-06-18', capabilities: {}, clientInfo: { name: 'probe', version: '1' } } };
const MCP_HEADERS = { 'content-type': 'application/json', accept: 'application/json, text/event-stream' };

let b: TestBroker;
let endpoint: string;
beforeAll(async () => {
  b = await startBroker({ backend: 'unsafe-local', tokens: { bob: BOB } });
  endpoint = `http://127.0.0.1:${b.broker.port}/mcp`;
});
afterAll(async () => {
  await b?.stop();
});

async function mcpClient(token: string): Promise<{ client: Client; transport: StreamableHTTPClientTransport }> {
  const client = new Client({ name: 'probe', version: '1' });
  const transport = new StreamableHTTPClientTransport(new URL(endpoint), { requestInit: { headers: { authorization: `Bearer ${token}` } } });
  await client.connect(transport);
  return { client, transport };
}

async function tool(client: Client, name: string, args: Record<string, unknown>): Promise<CallToolResult> {
  return (await client.callTool({ name, arguments: args })) as CallToolResult;
}

describe('/mcp authentication', () => {
  it.each([
    ['no token', {}],
    ['a wrong token', { authorization: 'Bearer wrong-token-0123456789abcdef' }],
    ['a non-Bearer scheme', { authorization: `Basic ${Buffer.from(`x:${BOB}`).toString('base64')}` }],
  ])('%s: 401 for initialize, and for GET and DELETE', async (_what, auth: Record<string, string>) => {
    const post = await fetch(endpoint, { method: 'POST', headers: { ...MCP_HEADERS, ...auth }, body: JSON.stringify(INIT) });
    expect(post.status).toBe(401);
    expect(post.headers.get('www-authenticate')).toBe('Bearer');
    expect(post.headers.get('mcp-session-id')).toBeNull();
    for (const method of ['GET', 'DELETE']) expect((await fetch(endpoint, { method, headers: { ...MCP_HEADERS, ...auth } })).status).toBe(401);
  });

  it('the SDK client without a token cannot connect', async () => {
    const client = new Client({ name: 'probe', version: '1' });
    await expect(client.connect(new StreamableHTTPClientTransport(new URL(endpoint)))).rejects.toThrow(/401|nauthorized/);
  });

  it('a valid session id with a wrong token is still 401 (the id is not a credential)', async () => {
    const { client, transport } = await mcpClient(b.token);
    try {
      const r = await fetch(endpoint, { method: 'POST', headers: { ...MCP_HEADERS, 'mcp-session-id': transport.sessionId as string }, body: JSON.stringify({ jsonrpc: '2.0', id: 2, method: 'tools/list' }) });
      expect(r.status).toBe(401);
    } finally {
      await client.close();
    }
  });
});

describe('/mcp principals', () => {
  it("another principal's sandbox is not_found for every tool, and stays untouched", async () => {
    const alice = await mcpClient(b.token);
    const bob = await mcpClient(BOB);
    try {
      const made = await tool(alice.client, 'create_sandbox', { files: { 'secret.txt': 'alice only\n' } });
      const id = (made.structuredContent as { sandbox_id: string }).sandbox_id;
      const attempts: Array<[string, Record<string, unknown>]> = [
        ['run_command', { sandbox_id: id, command: 'cat secret.txt' }],
        ['read_file', { sandbox_id: id, path: 'secret.txt' }],
        ['write_file', { sandbox_id: id, path: 'secret.txt', content: 'bob was here' }],
        ['edit_file', { sandbox_id: id, path: 'secret.txt', old_string: 'alice', new_string: 'bob' }],
        ['glob', { sandbox_id: id, pattern: '*' }],
        ['grep', { sandbox_id: id, pattern: 'alice' }],
        ['list', { sandbox_id: id }],
        ['close_sandbox', { sandbox_id: id }],
      ];
      for (const [name, args] of attempts) {
        const r = await tool(bob.client, name, args);
        expect(r.isError, name).toBe(true);
        expect((r.structuredContent as { error: { code: string } }).error.code, name).toBe('not_found');
        expect(JSON.stringify(r.content), name).not.toContain('alice only');
      }
      const bobs = await tool(bob.client, 'list_sandboxes', {});
      expect((bobs.structuredContent as { sandboxes: unknown[] }).sandboxes).toEqual([]);
      const still = await tool(alice.client, 'read_file', { sandbox_id: id, path: 'secret.txt' });
      expect((still.structuredContent as { content: string }).content).toContain('alice only');
      await tool(alice.client, 'close_sandbox', { sandbox_id: id });
    } finally {
      await alice.client.close();
      await bob.client.close();
    }
  });

  it("another principal's MCP session id answers 404, like a missing one", async () => {
    const alice = await mcpClient(b.token);
    try {
      const sid = alice.transport.sessionId as string;
      const asBob = await fetch(endpoint, { method: 'POST', headers: { ...MCP_HEADERS, authorization: `Bearer ${BOB}`, 'mcp-session-id': sid }, body: JSON.stringify({ jsonrpc: '2.0', id: 2, method: 'tools/list' }) });
      expect(asBob.status).toBe(404);
      const missing = await fetch(endpoint, { method: 'POST', headers: { ...MCP_HEADERS, authorization: `Bearer ${BOB}`, 'mcp-session-id': 'no-such-session' }, body: JSON.stringify({ jsonrpc: '2.0', id: 2, method: 'tools/list' }) });
      expect(missing.status).toBe(404);
      expect(await asBob.text()).toBe(await missing.text());
      // Bob's DELETE does not end Alice's session either.
      expect((await fetch(endpoint, { method: 'DELETE', headers: { ...MCP_HEADERS, authorization: `Bearer ${BOB}`, 'mcp-session-id': sid } })).status).toBe(404);
      expect((await alice.client.listTools()).tools.length).toBeGreaterThan(0);
    } finally {
      await alice.client.close();
    }
  });
});

describe('/mcp body size', () => {
  const over = DEFAULT_MCP_HTTP_LIMITS.maxBodyBytes + 1024;

  it('a body announced above the limit is refused with 413', async () => {
    const body = JSON.stringify({ ...INIT, pad: 'x'.repeat(over) });
    const r = await fetch(endpoint, { method: 'POST', headers: { ...MCP_HEADERS, authorization: `Bearer ${b.token}` }, body });
    expect(r.status).toBe(413);
    expect(r.headers.get('mcp-session-id')).toBeNull();
  });

  it('a chunked body (no length) is cut off at the limit with 413, in an open session too', async () => {
    const { client, transport } = await mcpClient(b.token);
    try {
      for (const session of [undefined, transport.sessionId as string]) {
        const status = await new Promise<number>((resolve, reject) => {
          // A fresh connection each time: the server may close one whose body it did not read to the end.
          const req = request(endpoint, { agent: false, method: 'POST', headers: { ...MCP_HEADERS, authorization: `Bearer ${b.token}`, ...(session ? { 'mcp-session-id': session } : {}) } }, (res) => {
            res.resume();
            resolve(res.statusCode ?? 0);
          });
          // The server may answer and close before the whole body is sent.
          req.on('error', (err) => (req.writableEnded ? undefined : reject(err)));
          req.write(`{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"write_file","arguments":{"sandbox_id":"x","path":"p","content":"`);
          const chunk = 'y'.repeat(256 * 1024);
          let sent = 0;
          const pump = (): void => {
            while (sent < over) {
              sent += chunk.length;
              if (!req.write(chunk)) {
                req.once('drain', pump);
                return;
              }
            }
            req.end('"}}}');
          };
          pump();
        });
        expect(status, session ? 'in a session' : 'initialize').toBe(413);
      }
      // The session survives a refused request.
      expect((await client.listTools()).tools.length).toBeGreaterThan(0);
    } finally {
      await client.close();
    }
  });
});
