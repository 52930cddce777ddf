/**
 * The E2B-compatible surface driven by the real `e2b` npm package (the SDK agent frameworks
 * use), against a real broker: apiUrl = /e2b/api, sandboxUrl = /e2b/envd, apiKey = a hutch
 * token. unsafe-local backend for speed.
 */
import { randomBytes } from 'node:crypto';
import { Sandbox, CommandExitError } from 'e2b';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startBroker, type TestBroker } from './helpers/broker.ts';

let b: TestBroker;
let base: string;
const otherKey = `e2b_${randomBytes(20).toString('hex')}`;

function opts(apiKey: string): { apiKey: string; apiUrl: string; sandboxUrl: string } {
  return { apiKey, apiUrl: `${base}/e2b/api`, sandboxUrl: `${base}/e2b/envd` };
}

beforeAll(async () => {
  b = await startBroker({ backend: 'unsafe-local', tokens: { other: otherKey } });
  base = b.url.replace(/^ws:/, 'http:');
});
afterAll(async () => {
  await b?.stop();
});

describe('the e2b SDK against hutch', () => {
  it('creates a sandbox, runs commands with streamed output, works with files, lists and kills', async () => {
    const sbx = await Sandbox.create({ ...opts(b.token), metadata: { purpose: 'test' }, envs: { GREETING: 'hi-from-envvars' } });
    expect(sbx.sandboxId).toMatch(/^s-/);

    const chunks: string[] = [];
    const r = await sbx.commands.run('echo one; echo two; echo oops >&2', { onStdout: (d) => void chunks.push(d) });
    expect(r.exitCode).toBe(0);
    expect(r.stdout).toBe('one\ntwo\n');
    expect(r.stderr).toBe('oops\n');
    expect(chunks.join('')).toBe('one\ntwo\n');

    // Sandbox envVars reach commands; a failing command is the SDK's CommandExitError.
    expect((await sbx.commands.run('printf %s "$GREETING"')).stdout).toBe('hi-from-envvars');
    const failed = await sbx.commands.run('exit 3').catch((e: unknown) => e);
    expect(failed).toBeInstanceOf(CommandExitError);
    expect((failed as CommandExitError).exitCode).toBe(3);

    await sbx.files.write('/work/notes/a.txt', 'hello e2b\n');
    expect(await sbx.files.read('/work/notes/a.txt')).toBe('hello e2b\n');
    expect((await sbx.commands.run('cat notes/a.txt')).stdout).toBe('hello e2b\n');
    expect(await sbx.files.exists('/work/notes/a.txt')).toBe(true);
    expect(await sbx.files.exists('/work/notes/missing.txt')).toBe(false);
    expect(await sbx.files.makeDir('/work/sub/deeper')).toBe(true);
    expect(await sbx.files.makeDir('/work/sub/deeper')).toBe(false);
    const listed = await sbx.files.list('/work');
    expect(listed.map((e) => `${e.name}:${e.type}`).sort()).toEqual(['notes:dir', 'sub:dir']);
    const notes = await sbx.files.list('/work/notes');
    expect(notes[0]).toMatchObject({ name: 'a.txt', type: 'file', path: '/work/notes/a.txt', size: 10 });
    // Bytes survive the round trip (octet-stream upload, raw download).
    const bin = new Uint8Array([0, 1, 2, 255, 254, 10]);
    await sbx.files.write('/work/bin.dat', bin.buffer, { useOctetStream: true });
    expect(new Uint8Array(await sbx.files.read('/work/bin.dat', { format: 'bytes' }))).toEqual(bin);
    await sbx.files.remove('/work/notes');
    expect(await sbx.files.exists('/work/notes/a.txt')).toBe(false);
    // Confinement is the workspace's: a path outside it is refused, not served.
    await expect(sbx.files.read('/etc/passwd')).rejects.toThrow(/outside/);

    const running = await Sandbox.list(opts(b.token)).nextItems();
    expect(running.find((s) => s.sandboxId === sbx.sandboxId)).toMatchObject({ metadata: { purpose: 'test' }, state: 'running' });
    expect(await sbx.isRunning()).toBe(true);

    await sbx.kill();
    expect(await sbx.isRunning()).toBe(false);
    expect((await Sandbox.list(opts(b.token)).nextItems()).some((s) => s.sandboxId === sbx.sandboxId)).toBe(false);
  });

  it('kills a background command by its pid (SendSignal) and lists it while it runs', async () => {
    const sbx = await Sandbox.create(opts(b.token));
    const h = await sbx.commands.run('echo started; sleep 60', { background: true });
    const procs = await sbx.commands.list();
    expect(procs.map((p) => p.pid)).toContain(h.pid);
    expect(await sbx.commands.kill(h.pid)).toBe(true);
    const end = await h.wait().catch((e: unknown) => e);
    expect(end).toBeInstanceOf(CommandExitError);
    expect(h.stdout).toBe('started\n');
    await sbx.kill();
  });

  it('pages Sandbox.list with x-next-token', async () => {
    const made = [await Sandbox.create(opts(b.token)), await Sandbox.create(opts(b.token)), await Sandbox.create(opts(b.token))];
    const pager = Sandbox.list({ ...opts(b.token), limit: 2 });
    const first = await pager.nextItems();
    expect(first).toHaveLength(2);
    expect(pager.hasNext).toBe(true);
    const second = await pager.nextItems();
    expect(pager.hasNext).toBe(false);
    expect([...first, ...second].map((s) => s.sandboxId).sort()).toEqual(made.map((s) => s.sandboxId).sort());
    for (const s of made) await s.kill();
  });
});

describe('E2B surface: keys and principals', () => {
  it('a wrong API key gets 401', async () => {
    const err = await Sandbox.create(opts(`e2b_${'0'.repeat(40)}`)).catch((e: unknown) => e);
    expect(String(err)).toMatch(/401|unauthorized/i);
    const res = await fetch(`${base}/e2b/api/v2/sandboxes`, { headers: { 'X-API-KEY': 'not-a-token-at-all-xx' } });
    expect(res.status).toBe(401);
  });

  it("another principal's sandbox is not found, over the API and over envd", async () => {
    const mine = await Sandbox.create(opts(b.token));
    // The other principal: GET/DELETE answer E2B's not-found body, and its list does not show it.
    for (const method of ['GET', 'DELETE']) {
      const res = await fetch(`${base}/e2b/api/sandboxes/${mine.sandboxId}`, { method, headers: { 'X-API-KEY': otherKey } });
      expect(res.status).toBe(404);
      expect(await res.json()).toMatchObject({ code: 404 });
    }
    expect(await Sandbox.kill(mine.sandboxId, opts(otherKey))).toBe(false);
    expect((await Sandbox.list(opts(otherKey)).nextItems()).map((s) => s.sandboxId)).not.toContain(mine.sandboxId);
    // envd without the sandbox's access token: refused, nothing runs.
    const res = await fetch(`${base}/e2b/envd/process.Process/Start`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', 'E2b-Sandbox-Id': mine.sandboxId, 'X-Access-Token': otherKey },
      body: JSON.stringify({ process: { cmd: '/bin/bash', args: ['-l', '-c', 'touch pwned'] } }),
    });
    expect(res.status).toBe(502);
    expect(await mine.files.exists('/work/pwned')).toBe(false);
    // Still there for its owner.
    expect((await mine.commands.run('echo ok')).stdout).toBe('ok\n');
    await mine.kill();
  });
});
