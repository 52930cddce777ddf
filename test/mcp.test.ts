/**
 * hutch as an MCP server, driven by the MCP SDK's own Client: `hutch mcp` over stdio (its
 * own broker, and a given one by --url/--token) and /mcp on the broker over Streamable
 * HTTP. The brokers use the unsafe-local backend for speed, except the last test, which
 * runs `hutch mcp` on its embedded defaults (qemu) and one command in a real VM.
 */
import { resolve } from 'node:path';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import type { CallToolResult } from '@modelcontextprotocol/sdk/types.js';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startBroker, type TestBroker } from './helpers/broker.ts';

const repo = resolve(import.meta.dirname, '..');
const TOOLS = ['close_sandbox', 'create_sandbox', 'edit_file', 'glob', 'grep', 'list', 'list_sandboxes', 'read_file', 'run_command', 'write_file'];

/** `hutch mcp` as an agent starts it: a child process speaking MCP on its stdin/stdout. */
function stdioClient(args: string[], env: Record<string, string> = {}): { client: Client; transport: StdioClientTransport; stderr: () => string } {
  const base = Object.fromEntries(Object.entries(process.env).filter((e): e is [string, string] => e[1] !== undefined && !e[0].startsWith('HUTCH_URL') && !e[0].startsWith('HUTCH_TOKEN')));
  const transport = new StdioClientTransport({
    command: process.execPath,
    args: ['--import', 'tsx', 'host-broker/src/cli.ts', 'mcp', ...args],
    cwd: repo,
    env: { ...base, ...env },
    stderr: 'pipe',
  });
  let err = '';
  transport.stderr?.on('data', (d: Buffer) => (err += d.toString()));
  return { client: new Client({ name: 'hutch-mcp-test', version: '1' }), transport, stderr: () => err };
}

/** The broker the --url stdio tests and the HTTP tests reach (unsafe-local: fast). */
let b: TestBroker;
beforeAll(async () => {
  b = await startBroker({ backend: 'unsafe-local' });
});
afterAll(async () => {
  await b?.stop();
});

type Structured = Record<string, unknown>;

/** Calls a tool that must succeed; returns its structured result and text. */
async function call(client: Client, name: string, args: Record<string, unknown>): Promise<{ s: Structured; text: string }> {
  const r = (await client.callTool({ name, arguments: args })) as CallToolResult;
  const text = r.content.map((c) => (c.type === 'text' ? c.text : '')).join('');
  if (r.isError) throw new Error(`${name} failed: ${text}`);
  return { s: r.structuredContent as Structured, text };
}

/** Calls a tool that must fail; returns the typed hutch error code it carries. */
async function callError(client: Client, name: string, args: Record<string, unknown>): Promise<{ code: string; text: string }> {
  const r = (await client.callTool({ name, arguments: args })) as CallToolResult;
  expect(r.isError).toBe(true);
  const text = r.content.map((c) => (c.type === 'text' ? c.text : '')).join('');
  return { code: (r.structuredContent as { error: { code: string } }).error.code, text };
}

/** The walk every transport gets: list tools, create, run, write, read, edit, glob, grep, list, close. */
async function walk(client: Client): Promise<void> {
  const tools = await client.listTools();
  expect(tools.tools.map((t) => t.name).sort()).toEqual(TOOLS);
  const run = tools.tools.find((t) => t.name === 'run_command');
  expect(run?.inputSchema.required).toEqual(expect.arrayContaining(['sandbox_id', 'command']));

  const created = await call(client, 'create_sandbox', { files: { 'a.txt': 'alpha\n', 'src/m.py': 'print("hi")\n' } });
  const id = created.s['sandbox_id'] as string;
  expect(id).toMatch(/^[a-z0-9-]+$/);
  expect(created.s['template']).toBe('default');

  // A read-only command: the router sends it to the fast path and says why.
  const cat = await call(client, 'run_command', { sandbox_id: id, command: 'cat a.txt' });
  expect(cat.s).toMatchObject({ exitCode: 0, stdout: 'alpha\n', route: 'fastpath' });
  expect(String(cat.s['reason']).length).toBeGreaterThan(0);
  expect(cat.text).toContain('[exit 0]');
  expect(cat.text).toContain('ran fastpath:');

  // A program the fast path does not run goes to the sandbox's VM route, with the reason;
  // its exit code, stderr and the file it wrote come back.
  const w = await call(client, 'run_command', { sandbox_id: id, command: "sh -c 'echo made > b.txt; echo oops >&2; exit 3'" });
  expect(w.s).toMatchObject({ exitCode: 3, stderr: 'oops\n', route: 'vm' });
  expect(w.s['reason']).toContain('`sh`');

  const wrote = await call(client, 'write_file', { sandbox_id: id, path: 'notes/n.md', content: 'one\ntwo\n' });
  expect(wrote.s).toMatchObject({ bytes: 8, created: true, route: 'inprocess' });
  const read = await call(client, 'read_file', { sandbox_id: id, path: 'notes/n.md' });
  expect(read.s['content']).toContain('one');
  expect(read.s['content']).toContain('two');
  expect(read.s['route']).toBe('inprocess');
  const b = await call(client, 'read_file', { sandbox_id: id, path: 'b.txt' });
  expect(b.s['content']).toContain('made');

  const edited = await call(client, 'edit_file', { sandbox_id: id, path: 'notes/n.md', old_string: 'two', new_string: 'deux' });
  expect(edited.s['replacements']).toBe(1);
  const shown = await call(client, 'run_command', { sandbox_id: id, command: 'cat notes/n.md' });
  expect(shown.s['stdout']).toBe('one\ndeux\n');

  expect((await call(client, 'glob', { sandbox_id: id, pattern: '**/*.py' })).s['files']).toEqual(['src/m.py']);
  const grep = await call(client, 'grep', { sandbox_id: id, pattern: 'deu+x' });
  expect(grep.s['matches']).toEqual([expect.objectContaining({ path: 'notes/n.md', line: 2 })]);
  const listed = (await call(client, 'list', { sandbox_id: id })).s['entries'] as Array<{ path: string }>;
  expect(listed.map((e) => e.path)).toEqual(expect.arrayContaining(['a.txt', 'b.txt', 'src/m.py', 'notes/n.md']));

  // Typed errors arrive as MCP tool errors carrying hutch's code.
  expect((await callError(client, 'edit_file', { sandbox_id: id, path: 'a.txt', old_string: 'zzz', new_string: 'y' })).code).toBe('no_match');
  expect((await callError(client, 'read_file', { sandbox_id: id, path: '../../etc/passwd' })).code).toBe('outside_workspace');
  expect((await callError(client, 'create_sandbox', { template: 'no-such-template' })).code).toBe('not_found');

  expect((await call(client, 'list_sandboxes', {})).s['sandboxes']).toEqual(expect.arrayContaining([expect.objectContaining({ sandbox_id: id })]));
  expect((await call(client, 'close_sandbox', { sandbox_id: id })).s).toMatchObject({ sandbox_id: id, kept: false });
  expect((await callError(client, 'run_command', { sandbox_id: id, command: 'true' })).code).toBe('not_found');
}

describe('hutch mcp over stdio', () => {
  it('with no --url runs its own broker and serves the tools', async () => {
    const { client, transport, stderr } = stdioClient(['--backend', 'unsafe-local', '--i-know-unsafe-local']);
    try {
      await client.connect(transport);
      await walk(client);
    } catch (err) {
      throw new Error(`${(err as Error).message}\nhutch mcp stderr:\n${stderr().slice(-3000)}`, { cause: err });
    } finally {
      await client.close();
    }
  });

  describe('with --url/--token (or HUTCH_URL/HUTCH_TOKEN)', () => {
    it('reaches that broker as the token’s principal', async () => {
      // A sandbox made through the WebSocket SDK is visible to the MCP server with the same token.
      const h = await b.connect();
      const sb = await h.create({ workspace: { files: { 'shared.txt': 'from the sdk\n' } } });
      const { client, transport } = stdioClient(['--url', b.url, '--token', b.token]);
      try {
        await client.connect(transport);
        const r = await call(client, 'read_file', { sandbox_id: sb.id, path: 'shared.txt' });
        expect(r.s['content']).toContain('from the sdk');
        await walk(client);
      } finally {
        await client.close();
        await sb.close();
      }
    });

    it('takes HUTCH_URL and HUTCH_TOKEN from the environment', async () => {
      const { client, transport } = stdioClient([], { HUTCH_URL: b.url, HUTCH_TOKEN: b.token });
      try {
        await client.connect(transport);
        const c = await call(client, 'create_sandbox', {});
        const r = await call(client, 'run_command', { sandbox_id: c.s['sandbox_id'], command: 'echo $((6 * 7))' });
        expect(r.s).toMatchObject({ stdout: '42\n', exitCode: 0 });
        await call(client, 'close_sandbox', { sandbox_id: c.s['sandbox_id'] });
      } finally {
        await client.close();
      }
    });

    it('a wrong token fails at start with hutch’s code on stderr, not on the first tool call', async () => {
      const { client, transport, stderr } = stdioClient(['--url', b.url, '--token', 'not-the-token-0123456789']);
      await expect(client.connect(transport)).rejects.toThrow();
      await client.close().catch(() => undefined);
      expect(stderr()).toContain('hutch: unauthorized:');
    });
  });
});

describe('/mcp over Streamable HTTP', () => {
  it('serves the tools to an MCP client holding a token', async () => {
    const client = new Client({ name: 'hutch-mcp-test', version: '1' });
    const transport = new StreamableHTTPClientTransport(new URL(`http://127.0.0.1:${b.broker.port}/mcp`), { requestInit: { headers: { authorization: `Bearer ${b.token}` } } });
    try {
      await client.connect(transport);
      expect(transport.sessionId).toBeTruthy();
      await walk(client);
      // A DELETE ends the MCP session: its id is then unknown.
      const sid = transport.sessionId as string;
      await transport.terminateSession();
      const after = await fetch(`http://127.0.0.1:${b.broker.port}/mcp`, {
        method: 'POST',
        headers: { authorization: `Bearer ${b.token}`, 'mcp-session-id': sid, 'content-type': 'application/json', accept: 'application/json, text/event-stream' },
        body: JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'tools/list' }),
      });
      expect(after.status).toBe(404);
    } finally {
      await client.close();
    }
  });

  it('cancelling a run_command request kills the command', async () => {
    const client = new Client({ name: 'hutch-mcp-test', version: '1' });
    const transport = new StreamableHTTPClientTransport(new URL(`http://127.0.0.1:${b.broker.port}/mcp`), { requestInit: { headers: { authorization: `Bearer ${b.token}` } } });
    try {
      await client.connect(transport);
      const id = (await call(client, 'create_sandbox', {})).s['sandbox_id'];
      const ac = new AbortController();
      const long = client.callTool({ name: 'run_command', arguments: { sandbox_id: id, command: 'sleep 600' } }, undefined, { signal: ac.signal, timeout: 900_000 });
      setTimeout(() => ac.abort('SIGKILL'), 1000);
      await expect(long).rejects.toThrow();
      // A session's calls run in order: had the sleep survived, this one would wait behind it
      // (and the test would time out) instead of answering.
      const next = await call(client, 'run_command', { sandbox_id: id, command: 'echo after' });
      expect(next.s).toMatchObject({ stdout: 'after\n', exitCode: 0 });
      await call(client, 'close_sandbox', { sandbox_id: id });
    } finally {
      await client.close();
    }
  });
});

describe('hutch mcp on the embedded defaults (qemu)', { tags: ['vm'] }, () => {
  it('runs a command in a real VM through its own broker', { timeout: 600_000 }, async () => {
    // No flags: the qemu backend, building the guest image if another change made it stale.
    const { client, transport, stderr } = stdioClient([]);
    try {
      await client.connect(transport);
      const c = await call(client, 'create_sandbox', { files: { 'in.txt': 'vm\n' } });
      const r = await call(client, 'run_command', { sandbox_id: c.s['sandbox_id'], command: 'tr a-z A-Z < in.txt > out.txt; cat out.txt; uname -r' });
      expect(r.s).toMatchObject({ exitCode: 0, route: 'vm' });
      expect(String(r.s['stdout'])).toMatch(/^VM\n/);
      // The change made in the VM reached the workspace the file tools see.
      expect((await call(client, 'read_file', { sandbox_id: c.s['sandbox_id'], path: 'out.txt' })).s['content']).toContain('VM');
      await call(client, 'close_sandbox', { sandbox_id: c.s['sandbox_id'] });
    } catch (err) {
      throw new Error(`${(err as Error).message}\nhutch mcp stderr:\n${stderr().slice(-3000)}`, { cause: err });
    } finally {
      await client.close();
    }
  });
});

describe('tool errors', () => {
  it('a command that ran before its call failed (its changes refused) still shows its output and exit code', async () => {
    const { toolError } = await import('../host-broker/src/mcp/server.ts');
    const { HutchError } = await import('../guest-agent/src/protocol/errors.ts');
    const e = new HutchError('quota_exceeded', 'workspace quota exceeded', { limit: 'bytes', result: { exitCode: 3, stdout: 'built\n', stderr: 'warning\n' } });
    const r = toolError(e);
    expect(r.isError).toBe(true);
    expect(r.content).toEqual([{ type: 'text', text: 'quota_exceeded: workspace quota exceeded\nbuilt\n\n[stderr]\nwarning\n\n[exit 3]' }]);
    expect(r.structuredContent).toEqual({ error: { code: 'quota_exceeded', message: 'workspace quota exceeded', result: { exitCode: 3, stdout: 'built\n', stderr: 'warning\n' } } });
    expect(toolError(new HutchError('busy', 'later')).content).toEqual([{ type: 'text', text: 'busy: later' }]);
  });
});
