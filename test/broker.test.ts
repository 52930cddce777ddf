import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import WebSocket from 'ws';
import { unpack } from 'msgpackr';
import { Hutch } from '../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from './helpers/broker.ts';

describe('broker over a real WebSocket', () => {
  let b: TestBroker;
  let hutch: Hutch;
  beforeAll(async () => {
    b = await startBroker({ maxFileBytes: 1024 * 1024, workspaceRoots: [tmpdir()] });
    hutch = await b.connect();
  });
  afterAll(async () => b.stop());

  it('a fast-path command the router proved read-only leaves nothing for the next VM call to scan; one that writes marks the tree', async () => {
    const sb = await hutch.create({ workspace: { files: { 'a.txt': 'A\n' } } });
    const changes = b.broker.sessions.get(sb.id).vm.hostChanges;
    changes.take();
    const read = await sb.run('cat a.txt; ls; grep -c A a.txt');
    expect([read.route, read.stdout]).toEqual(['fastpath', 'A\na.txt\n1\n']);
    expect(changes.pending).toBe(false);
    const edit = await sb.run("sed -i 's/A/B/' a.txt");
    expect(edit.route).toBe('fastpath');
    expect(changes.take()).toEqual({ kind: 'all' });
    await sb.close();
  });

  it('refuses a wrong or missing token', async () => {
    await expect(Hutch.connect(b.url, { token: 'wrong' })).rejects.toMatchObject({ code: 'unauthorized' });
    const raw = new WebSocket(b.url);
    const status = await new Promise<number>((r) => raw.once('unexpected-response', (_q, res) => r(res.statusCode ?? 0)));
    expect(status).toBe(401);
  });

  it('creates a session from files, runs file tools in process, and reports route and added latency', async () => {
    const sb = await hutch.create({ workspace: { files: { 'src/app.py': 'print("hi")\n', 'README.md': '# demo\n' } } });
    const read = await sb.call('read', { filePath: 'src/app.py' });
    expect(read.route).toBe('inprocess');
    expect(read.timing.addedMs).toBeGreaterThanOrEqual(0);
    expect((read.result as { content: string }).content).toBe('00001| print("hi")');
    await sb.files.edit('src/app.py', '"hi"', '"hello"');
    expect((await sb.files.grep('hello')).matches).toEqual([{ path: 'src/app.py', line: 1, text: 'print("hello")' }]);
    expect((await sb.files.glob('**/*.py')).files).toEqual(['src/app.py']);
    expect((await sb.files.list()).entries.map((e) => e.path).sort()).toEqual(['README.md', 'src', 'src/app.py']);
    await sb.close();
  });

  it('creates sessions from a directory and from a tar; close keeps or deletes the workspace', async () => {
    const src = mkdtempSync(join(tmpdir(), 'hutch-src-'));
    mkdirSync(join(src, 'pkg'));
    writeFileSync(join(src, 'pkg', 'mod.py'), 'X = 1\n');
    symlinkSync('pkg/mod.py', join(src, 'link'));
    const fromDir = await hutch.create({ workspace: { dir: src } });
    expect((await fromDir.files.read('link')).content).toBe('00001| X = 1');
    const kept = await fromDir.close({ keepWorkspace: true });
    // Kept under the data dir by session id; the answer names no host path.
    expect(kept).toEqual({ session: fromDir.id, kept: true });
    expect(existsSync(join(b.dataDir, 'sessions', fromDir.id, 'workspace', 'pkg', 'mod.py'))).toBe(true);

    const tar = execFileSync('tar', ['-c', '-C', src, '.']);
    const fromTar = await hutch.create({ workspace: { tar } });
    expect((await fromTar.run('cat pkg/mod.py')).stdout).toBe('X = 1\n');
    const wsDir = join(b.dataDir, 'sessions', fromTar.id);
    await fromTar.close();
    expect(existsSync(wsDir)).toBe(false);
  });

  it('runs calls of a session in order and sessions concurrently', async () => {
    const [s1, s2] = await Promise.all([hutch.create(), hutch.create()]);
    const order: string[] = [];
    const t0 = Date.now();
    await Promise.all([
      s1!.run('sleep 0.5; echo a >> log', { route: 'vm' }).then(() => order.push('s1-a')),
      s1!.run('echo b >> log; cat log', { route: 'vm' }).then((r) => order.push(`s1-b:${r.stdout.replace(/\n/g, '')}`)),
      s2!.run('sleep 0.5; echo c', { route: 'vm' }).then(() => order.push('s2-c')),
    ]);
    expect(order.indexOf('s1-a')).toBeLessThan(order.indexOf('s1-b:ab'));
    expect(order).toContain('s1-b:ab');
    // s2's sleep overlapped s1's: both sessions took ~0.5 s, not 1 s end to end (plus agent starts).
    expect(Date.now() - t0).toBeGreaterThan(500);
    await Promise.all([s1!.close(), s2!.close()]);
  });

  it('streams bash output while the command runs and routes by the command', async () => {
    const sb = await hutch.create();
    const chunks: Array<{ at: number; text: string }> = [];
    const t0 = Date.now();
    const r = await sb.run('echo first; sleep 0.5; echo second; python3 -c "import sys; sys.exit(3)"', { onStdout: (t) => chunks.push({ at: Date.now() - t0, text: t }) });
    expect(r.route).toBe('vm');
    expect(r.reason).toMatch(/not a read\/edit command/);
    expect(r.exitCode).toBe(3);
    expect(r.stdout).toBe('first\nsecond\n');
    expect(chunks.length).toBeGreaterThanOrEqual(2);
    expect(chunks[0]!.text).toBe('first\n');
    const ls = await sb.run('ls -la');
    expect(ls.route).toBe('fastpath');
    await sb.close();
  });

  it('gives clear errors: unknown session, bad args, oversized file, malformed frames', async () => {
    await expect(hutch.attach('no-such-session')).rejects.toMatchObject({ code: 'not_found' });
    const sb = await hutch.create();
    await expect(sb.call('read', { filePath: 42 })).rejects.toMatchObject({ code: 'bad_request' });
    await expect(sb.files.write('big.bin', new Uint8Array(2 * 1024 * 1024))).rejects.toMatchObject({ code: 'too_large' });
    await expect(sb.files.read('../../etc/passwd')).rejects.toMatchObject({ code: 'outside_workspace' });

    const raw = new WebSocket(b.url, { headers: { authorization: `Bearer ${b.token}` } });
    const msgs: Array<Record<string, unknown>> = [];
    raw.on('message', (d, isBinary) => msgs.push(isBinary ? unpack(d as Buffer) : JSON.parse(String(d))));
    await new Promise((r) => raw.once('open', r));
    raw.send('{ not json');
    raw.send(JSON.stringify({ t: 'req', id: 5, op: 'explode', p: {} }));
    raw.send(JSON.stringify({ t: 'req', id: 6, op: 'call', p: { session: sb.id } }));
    raw.send(Buffer.from([0xc1, 0xc1]), { binary: true });
    raw.send(JSON.stringify({ t: 'req', id: 7, op: 'sessions', p: {} }));
    await new Promise((r) => setTimeout(r, 300));
    const codes = msgs.filter((m) => m['t'] === 'res').map((m) => [m['id'], (m['e'] as { code?: string } | undefined)?.code ?? 'ok']);
    // Both undecodable frames (text and binary) get an answer without a request id.
    expect(codes.map((c) => c.join(':')).sort()).toEqual(['-1:bad_request', '-1:bad_request', '5:not_found', '6:bad_request', '7:ok']);
    raw.close();
    await sb.close();
  });

  it('never follows a workspace symlink out through the in-process tools', async () => {
    const sb = await hutch.create();
    const ws = join(b.dataDir, 'sessions', sb.id, 'workspace');
    symlinkSync('/etc/shadow', join(ws, 'shadow'));
    symlinkSync('/etc', join(ws, 'etc'));
    await expect(sb.files.read('shadow')).rejects.toMatchObject({ code: 'outside_workspace' });
    await expect(sb.files.read('etc/passwd')).rejects.toMatchObject({ code: 'outside_workspace' });
    await expect(sb.files.write('etc/evil', 'x')).rejects.toMatchObject({ code: 'outside_workspace' });
    await expect(sb.files.grep('root', { path: 'etc' })).rejects.toMatchObject({ code: 'outside_workspace' });
    expect(existsSync('/etc/evil')).toBe(false);
    await sb.close();
  });

  it('speaks JSON text frames as well as msgpack, and attaches a session from a second connection', async () => {
    const j = await b.connect({ encoding: 'json' });
    const sb = await j.create({ workspace: { files: { 'a.txt': 'json!' } } });
    expect((await sb.run('cat a.txt')).stdout).toBe('json!');
    const other = await b.connect();
    const again = await other.attach(sb.id);
    expect((await again.files.read('a.txt')).content).toBe('00001| json!');
    await again.close();
  });
});

describe('broker restart', () => {
  it('keeps sessions and their workspaces across a restart', async () => {
    const first = await startBroker();
    const h = await first.connect();
    const sb = await h.create({ workspace: { files: { 'state.txt': 'before restart\n' } } });
    await sb.run('echo more >> state.txt', { route: 'vm' });
    await first.stop({ keepData: true });
    const second = await startBroker({ dataDir: first.dataDir });
    const h2 = await second.connect();
    const again = await h2.attach(sb.id);
    expect((await again.run('cat state.txt', { route: 'vm' })).stdout).toBe('before restart\nmore\n');
    expect(readFileSync(join(first.dataDir, 'sessions', sb.id, 'workspace', 'state.txt'), 'utf8')).toContain('more');
    await second.stop();
  });
});
