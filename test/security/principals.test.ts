import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, statSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Hutch } from '../../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/**
 * Issue 12 item 6: one token saw everything. Any connection could list and attach to every
 * session; `create({ workspace: { dir: '/etc' } })` returned /etc/shadow; device nodes in a
 * source dir were read; close({ keepWorkspace }) returned the host path; /metrics needed no
 * token and asked every live VM.
 */
const ALICE = 'alice-token-0123456789abcdef';
const BOB = 'bob-token-0123456789abcdef00';

describe('principals and what a session belongs to', () => {
  let b: TestBroker;
  let alice: Hutch;
  let bob: Hutch;
  const roots = mkdtempSync(join(tmpdir(), 'hutch-roots-'));
  const allowed = join(roots, 'allowed');
  beforeAll(async () => {
    mkdirSync(join(allowed, 'proj', 'src'), { recursive: true });
    writeFileSync(join(allowed, 'proj', 'src', 'main.py'), 'print(1)\n');
    symlinkSync('/etc/passwd', join(allowed, 'proj', 'passwd-link'));
    execFileSync('mkfifo', [join(allowed, 'proj', 'fifo')]);
    execFileSync('mknod', [join(allowed, 'proj', 'zero'), 'c', '1', '5']);
    writeFileSync(join(roots, 'outside.txt'), 'not for tenants\n');
    b = await startBroker({ tokens: { alice: ALICE, bob: BOB }, workspaceRoots: [allowed], metricsListen: { host: '127.0.0.1', port: 0 } });
    alice = await Hutch.connect(b.url, { token: ALICE });
    bob = await Hutch.connect(b.url, { token: BOB });
  });
  afterAll(async () => {
    alice?.close();
    bob?.close();
    await b?.stop();
  });

  it("keeps each principal's sessions invisible to the others", async () => {
    const sa = await alice.create({ workspace: { files: { 'secret.txt': 'alice only\n' } } });
    const missing = await bob.attach('no-such-session').catch((e: { code: string; message: string }) => e);
    const foreign = await bob.attach(sa.id).catch((e: { code: string; message: string }) => e);
    // Exactly the answer a missing session gets (with its own id).
    expect(foreign).toMatchObject({ code: 'not_found', message: `no session ${sa.id}` });
    expect(missing).toMatchObject({ code: 'not_found', message: 'no session no-such-session' });
    expect((await bob.sessions()).map((s) => s.session)).not.toContain(sa.id);
    expect((await alice.sessions()).map((s) => s.session)).toContain(sa.id);
    for (const [op, p] of [
      ['call', { session: sa.id, tool: 'read', args: { filePath: 'secret.txt' } }],
      ['close', { session: sa.id }],
      ['hint', { session: sa.id, hint: 'idle' }],
      ['telemetry', { session: sa.id, count: 1 }],
    ] as const) {
      await expect(bob.request(op, p)).rejects.toMatchObject({ code: 'not_found' });
    }
    // All sessions' telemetry for bob holds none of alice's.
    const seen: string[] = [];
    await bob.telemetry({ count: 1, onSample: (e) => seen.push(...e.sessions.map((s) => s.session)) });
    expect(seen).not.toContain(sa.id);
    expect((await sa.files.read('secret.txt')).content).toBe('00001| alice only');
  });

  it('keeps the owner across a broker restart', async () => {
    const sa = await alice.create();
    const meta = JSON.parse(readFileSync(join(b.dataDir, 'sessions', sa.id, 'session.json'), 'utf8')) as { owner: string };
    expect(meta.owner).toBe('alice');
    // A second broker on the same data dir adopts it for alice only.
    alice.close();
    bob.close();
    await b.stop({ keepData: true });
    b = await startBroker({ dataDir: b.dataDir, tokens: { alice: ALICE, bob: BOB }, workspaceRoots: [allowed], metricsListen: { host: '127.0.0.1', port: 0 } });
    alice = await Hutch.connect(b.url, { token: ALICE });
    bob = await Hutch.connect(b.url, { token: BOB });
    expect((await alice.attach(sa.id)).id).toBe(sa.id);
    await expect(bob.attach(sa.id)).rejects.toMatchObject({ code: 'not_found' });
  });

  it('copies directory sources only from under a workspace root: files, dirs and symlinks, never devices or FIFOs', async () => {
    await expect(alice.create({ workspace: { dir: '/etc' } })).rejects.toMatchObject({ code: 'permission_denied' });
    await expect(alice.create({ workspace: { dir: roots } })).rejects.toMatchObject({ code: 'permission_denied' });
    await expect(alice.create({ workspace: { dir: join(allowed, '..') } })).rejects.toMatchObject({ code: 'permission_denied' });
    // A symlink inside a root that leads out of it does not count as inside.
    symlinkSync('/etc', join(allowed, 'etc-link'));
    await expect(alice.create({ workspace: { dir: join(allowed, 'etc-link') } })).rejects.toMatchObject({ code: 'permission_denied' });
    const sb = await alice.create({ workspace: { dir: join(allowed, 'proj') } });
    const ws = join(b.dataDir, 'sessions', sb.id, 'workspace');
    expect(readFileSync(join(ws, 'src', 'main.py'), 'utf8')).toBe('print(1)\n');
    expect(existsSync(join(ws, 'fifo'))).toBe(false);
    expect(existsSync(join(ws, 'zero'))).toBe(false);
    // Kept as a link (and the file tools refuse to follow it out).
    await expect(sb.files.read('passwd-link')).rejects.toMatchObject({ code: 'outside_workspace' });
    // No host path in the answer to close.
    const closed = await sb.close({ keepWorkspace: true });
    expect(JSON.stringify(closed)).not.toContain(b.dataDir);
    expect(closed).toEqual({ session: sb.id, kept: true });
  });

  it('refuses directory sources when no root is configured', async () => {
    const other = await startBroker();
    try {
      const h = await other.connect();
      await expect(h.create({ workspace: { dir: tmpdir() } })).rejects.toMatchObject({ code: 'permission_denied', message: expect.stringMatching(/--workspace-root/) });
    } finally {
      await other.stop();
    }
  });

  it('creates the data dir and every session dir 0700', async () => {
    const sb = await alice.create();
    expect(statSync(b.dataDir).mode & 0o777).toBe(0o700);
    expect(statSync(join(b.dataDir, 'sessions')).mode & 0o777).toBe(0o700);
    expect(statSync(join(b.dataDir, 'sessions', sb.id)).mode & 0o777).toBe(0o700);
  });

  it('serves /metrics only with a token, from what the broker already knows', async () => {
    const anon = await fetch(`${b.url.replace('ws:', 'http:')}/metrics`);
    expect(anon.status).toBe(401);
    const sb = await alice.create();
    await sb.run('true', { route: 'vm' });
    // Any guest sampling during a scrape would go through Session.telemetry.
    let sampled = 0;
    for (const s of b.broker.sessions.all()) {
      const orig = s.telemetry.bind(s);
      s.telemetry = () => {
        sampled++;
        return orig();
      };
    }
    const ok = await fetch(`${b.url.replace('ws:', 'http:')}/metrics`, { headers: { authorization: `Bearer ${BOB}` } });
    expect(ok.status).toBe(200);
    expect(await ok.text()).toMatch(/^hutch_sessions \d+$/m);
    // The operator's separate scrape listener needs no token.
    const side = await fetch(`http://127.0.0.1:${b.broker.metricsPort}/metrics`);
    expect(side.status).toBe(200);
    expect(await side.text()).toMatch(/^hutch_sessions \d+$/m);
    expect(sampled).toBe(0);
  });
});
