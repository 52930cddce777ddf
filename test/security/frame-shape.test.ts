/**
 * One request decoded on the broker's loop used to cost whatever its structure cost: a
 * 64 MiB WebSocket frame of nested `[[[...]]]` held the loop for 17 s in JSON.parse, one
 * of 64 million empty msgpack maps for 11 s and gigabytes of heap, and an E2B or MCP body
 * the same in proportion. Now every surface checks a body's shape before decoding it
 * (guest-agent/src/protocol/value-shape.ts) and answers with a typed error, and the
 * connection goes on serving.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { unpack } from 'msgpackr';
import WebSocket from 'ws';
import { DEFAULT_SHAPE_LIMITS } from '../../guest-agent/src/protocol/value-shape.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

const deep = (levels: number) => '['.repeat(levels) + ']'.repeat(levels);
/** msgpack: an array32 of `n` copies of one byte-sized value (0x80: an empty map). */
function msgpackArray(n: number, item: number): Buffer {
  const b = Buffer.alloc(5 + n, item);
  b[0] = 0xdd;
  b.writeUInt32BE(n, 1);
  return b;
}

let b: TestBroker;
let base: string;
beforeAll(async () => {
  b = await startBroker({ backend: 'unsafe-local' });
  base = b.url.replace(/^ws:/, 'http:');
});
afterAll(async () => b?.stop());

describe('the shape of a request is checked before it is decoded', () => {
  it('WebSocket frames: too deep or too many values is a typed error, and the connection goes on', async () => {
    const raw = new WebSocket(b.url, { headers: { authorization: `Bearer ${b.token}` }, maxPayload: 64 * 1024 * 1024 });
    const msgs: Array<Record<string, unknown>> = [];
    raw.on('message', (d, isBinary) => msgs.push(isBinary ? unpack(d as Buffer) : JSON.parse(String(d))));
    await new Promise((r) => raw.once('open', r));
    raw.send(`{"t":"req","id":1,"op":"sessions","p":${deep(4_000_000)}}`);
    raw.send(msgpackArray(8_000_000, 0x80), { binary: true });
    raw.send(`{"t":"req","id":2,"op":"sessions","p":{"x":[${'0,'.repeat(DEFAULT_SHAPE_LIMITS.maxValues)}0]}}`);
    raw.send(JSON.stringify({ t: 'req', id: 3, op: 'sessions', p: {} }));
    for (let i = 0; i < 200 && !msgs.some((m) => m['id'] === 3); i++) await new Promise((r) => setTimeout(r, 50));
    const answers = msgs.filter((m) => m['t'] === 'res').map((m) => {
      const e = m['e'] as { code?: string; message?: string } | undefined;
      return `${String(m['id'])}:${e?.code ?? 'ok'}:${e?.message ?? ''}`;
    });
    expect(answers).toEqual([
      expect.stringMatching(/^-1:bad_request:the message nests deeper than 64 levels/),
      expect.stringMatching(/^-1:too_large:the message has more than 200000 values/),
      expect.stringMatching(/^-1:too_large:the message has more than 200000 values/),
      '3:ok:',
    ]);
    raw.close();
  });

  it('E2B bodies: the REST API and the envd Connect API answer 400 without parsing the structure', async () => {
    const api = await fetch(`${base}/e2b/api/v2/sandboxes`, { method: 'POST', headers: { 'X-API-KEY': b.token, 'content-type': 'application/json' }, body: `{"templateID":${deep(400_000)}}` });
    expect(api.status).toBe(400);
    expect(await api.text()).toMatch(/nests deeper than 64/);
    const made = (await (await fetch(`${base}/e2b/api/v2/sandboxes`, { method: 'POST', headers: { 'X-API-KEY': b.token, 'content-type': 'application/json' }, body: '{}' })).json()) as { sandboxID: string; envdAccessToken: string };
    const envd = await fetch(`${base}/e2b/envd/filesystem.Filesystem/ListDir`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', 'E2b-Sandbox-Id': made.sandboxID, 'X-Access-Token': made.envdAccessToken },
      body: `{"path":"/work","x":${deep(400_000)}}`,
    });
    expect(envd.status).toBe(400);
    expect(await envd.text()).toMatch(/nests deeper than 64/);
    await fetch(`${base}/e2b/api/sandboxes/${made.sandboxID}`, { method: 'DELETE', headers: { 'X-API-KEY': b.token } });
  });

  it('MCP bodies: 400 before the transport parses them; a normal initialize still works', async () => {
    const headers = { 'content-type': 'application/json', accept: 'application/json, text/event-stream', authorization: `Bearer ${b.token}` };
    const bad = await fetch(`${base}/mcp`, { method: 'POST', headers, body: `{"jsonrpc":"2.0","id":1,"method":"initialize","params":${deep(2_000_000)}}` });
    expect(bad.status).toBe(400);
    expect(await bad.text()).toMatch(/nests deeper than 64/);
    expect(bad.headers.get('mcp-session-id')).toBeNull();
    const init = { jsonrpc: '2.0', id: 1, method: 'initialize', params: { protocolVersion: '2025-06-18', capabilities: {}, clientInfo: { name: 'probe', version: '1' } } };
    const ok = await fetch(`${base}/mcp`, { method: 'POST', headers, body: JSON.stringify(init) });
    expect(ok.status).toBe(200);
    const sid = ok.headers.get('mcp-session-id');
    expect(sid).toBeTruthy();
    await ok.text();
    await fetch(`${base}/mcp`, { method: 'DELETE', headers: { ...headers, 'mcp-session-id': sid as string } });
  });
});
