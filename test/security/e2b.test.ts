/**
 * The E2B surface (/e2b/api, /e2b/envd) is reachable by anyone who can reach the broker's
 * port: it must hold the WebSocket API's line. A wrong API key is refused (401) before any
 * work; a principal cannot see, kill or list another principal's sandbox (E2B's not-found
 * body, as if missing); envd without the sandbox's own access token runs nothing; file
 * paths stay inside the workspace.
 */
import { randomBytes } from 'node:crypto';
import { execFileSync } from 'node:child_process';
import { statSync, truncateSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { Sandbox } from 'e2b';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

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

describe('E2B surface: keys, principals, access tokens, paths', () => {
  it('a wrong or missing API key gets 401 and creates nothing', async () => {
    const err = await Sandbox.create(opts(`e2b_${'0'.repeat(40)}`)).catch((e: unknown) => e);
    expect(String(err)).toMatch(/401|unauthorized/i);
    for (const headers of [{ 'X-API-KEY': 'not-a-token-at-all-xx' }, {} as Record<string, string>, { authorization: `Bearer ${b.token}` }]) {
      const res = await fetch(`${base}/e2b/api/v2/sandboxes`, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body: '{}' });
      expect(res.status).toBe(401);
    }
    expect(b.broker.sessions.all()).toEqual([]);
  });

  it("another principal's sandbox is not found, over the API and over envd", async () => {
    const mine = await Sandbox.create(opts(b.token));
    // The other principal: GET/DELETE/pause/connect answer E2B's not-found body, and its list does not show it.
    for (const [method, suffix] of [['GET', ''], ['DELETE', ''], ['POST', '/pause'], ['POST', '/connect'], ['POST', '/timeout']] as const) {
      const res = await fetch(`${base}/e2b/api/sandboxes/${mine.sandboxId}${suffix}`, { method, headers: { 'X-API-KEY': otherKey, 'content-type': 'application/json' }, ...(method === 'POST' ? { body: '{}' } : {}) });
      expect(res.status).toBe(404);
      expect(await res.json()).toMatchObject({ code: 404 });
    }
    expect(await Sandbox.kill(mine.sandboxId, opts(otherKey))).toBe(false);
    expect((await Sandbox.list(opts(otherKey)).nextItems()).map((s) => s.sandboxId)).not.toContain(mine.sandboxId);
    // envd with the sandbox id but not its access token (the other principal's API key, or none): nothing runs.
    for (const token of [otherKey, b.token, undefined]) {
      const res = await fetch(`${base}/e2b/envd/process.Process/Start`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', 'E2b-Sandbox-Id': mine.sandboxId, ...(token ? { 'X-Access-Token': token } : {}) },
        body: JSON.stringify({ process: { cmd: '/bin/bash', args: ['-l', '-c', 'touch pwned'] } }),
      });
      expect(res.status).toBe(502);
    }
    expect(await mine.files.exists('/work/pwned')).toBe(false);
    // Still there for its owner.
    expect((await mine.commands.run('echo ok')).stdout).toBe('ok\n');
    await mine.kill();
  });

  it('file paths outside the workspace are refused over /files and the Filesystem service (watches too)', async () => {
    const sbx = await Sandbox.create(opts(b.token));
    await expect(sbx.files.read('/etc/passwd')).rejects.toThrow(/outside/);
    await expect(sbx.files.read('/work/../../../../etc/passwd')).rejects.toThrow(/outside|above/);
    await expect(sbx.files.write('/tmp/escape.txt', 'x')).rejects.toThrow(/outside/);
    await expect(sbx.files.list('/')).rejects.toThrow(/outside/);
    await expect(sbx.files.makeDir('/work/../escape')).rejects.toThrow(/outside|above/);
    await expect(sbx.files.watchDir('/etc', () => undefined)).rejects.toThrow(/outside/);
    await sbx.kill();
  });
});

/**
 * What an E2B client moves through /files is not held whole by the broker: downloads stream
 * from the file (they read it into memory: ten concurrent downloads of a 1.9 GB file would
 * have held 19 GB, and a file above 2 GiB could not be read at all), and upload
 * bodies, which multipart makes the broker hold, take room in a bounded budget first (thirty
 * concurrent 60 MB uploads took the broker to 2.9 GB).
 */
describe('E2B /files holds a bounded amount in the broker', () => {
  it('a 3 GiB file downloads in full through a stream', async () => {
    const sbx = await Sandbox.create(opts(b.token));
    const ws = join(b.dataDir, 'sessions', sbx.sandboxId, 'workspace');
    writeFileSync(join(ws, 'big.img'), 'head');
    truncateSync(join(ws, 'big.img'), 3 * 1024 ** 3); // sparse: the quota counts its blocks
    const token = (sbx as unknown as { envdAccessToken: string }).envdAccessToken;
    const res = await fetch(`${base}/e2b/envd/files?path=${encodeURIComponent('/work/big.img')}`, { headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'X-Access-Token': token } });
    expect(res.status).toBe(200);
    expect(res.headers.get('content-length')).toBe(String(3 * 1024 ** 3));
    let n = 0;
    let first = '';
    for await (const c of res.body as unknown as AsyncIterable<Uint8Array>) {
      if (n === 0) first = Buffer.from(c.subarray(0, 4)).toString();
      n += c.length;
    }
    expect([n, first]).toEqual([3 * 1024 ** 3, 'head']);
    // A FIFO is refused, not read (and nothing blocks).
    execFileSync('mkfifo', [join(ws, 'pipe')]);
    const fifo = await fetch(`${base}/e2b/envd/files?path=/work/pipe`, { headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'X-Access-Token': token } });
    expect(fifo.status).toBe(400);
    await sbx.kill();
  }, 180_000);

  it('concurrent large uploads of one principal hold at most its share of the body budget, and all land', async () => {
    const sbx = await Sandbox.create(opts(b.token));
    const token = (sbx as unknown as { envdAccessToken: string }).envdAccessToken;
    const size = 60 * 1024 * 1024;
    const body = Buffer.alloc(size, 7);
    let peak = 0;
    const sample = setInterval(() => (peak = Math.max(peak, b.broker['e2b'].bodies.inUse)), 2);
    const codes = await Promise.all(
      Array.from({ length: 5 }, (_, i) =>
        fetch(`${base}/e2b/envd/files?path=/work/up${i}.bin`, { method: 'POST', headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'X-Access-Token': token, 'content-type': 'application/octet-stream' }, body }).then((r) => r.status),
      ),
    );
    clearInterval(sample);
    expect(codes).toEqual([200, 200, 200, 200, 200]);
    expect(peak).toBeGreaterThan(0);
    expect(peak).toBeLessThanOrEqual(b.broker['e2b'].bodies.perKeyBytes);
    expect(b.broker['e2b'].bodies.inUse).toBe(0);
    const ws = join(b.dataDir, 'sessions', sbx.sandboxId, 'workspace');
    for (let i = 0; i < 5; i++) expect(statSync(join(ws, `up${i}.bin`)).size).toBe(size);
    await sbx.kill();
  }, 180_000);
});

