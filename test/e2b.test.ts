/**
 * The E2B-compatible surface driven by the real `e2b` npm package (the SDK agent frameworks
 * use), against a real broker: apiUrl = /e2b/api, sandboxUrl = /e2b/envd, apiKey = a hutch
 * token. unsafe-local backend for speed, except the last test (qemu). Keys, principals and
 * confinement: test/security/e2b.test.ts.
 */
import { randomBytes } from 'node:crypto';
import { Sandbox, CommandExitError, type CommandHandle } from 'e2b';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startBroker, type TestBroker } from './helpers/broker.ts';

let b: TestBroker;
let base: string;

function opts(apiKey: string): { apiKey: string; apiUrl: string; sandboxUrl: string } {
  return { apiKey, apiUrl: `${base}/e2b/api`, sandboxUrl: `${base}/e2b/envd` };
}

/** A background command, once it has printed something (so it is surely running). */
async function startedInBackground(sbx: Sandbox, cmd: string): Promise<CommandHandle> {
  let started!: () => void;
  const sawOutput = new Promise<void>((r) => (started = r));
  const h = await sbx.commands.run(cmd, { background: true, onStdout: () => started() });
  await sawOutput;
  return h;
}

beforeAll(async () => {
  b = await startBroker({ backend: 'unsafe-local' });
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
    expect(await sbx.files.getInfo('/work/bin.dat')).toMatchObject({ name: 'bin.dat', type: 'file', size: 6 });
    expect(await sbx.files.rename('/work/bin.dat', '/work/sub/moved.dat')).toMatchObject({ path: '/work/sub/moved.dat' });
    expect(await sbx.files.exists('/work/bin.dat')).toBe(false);
    // cwd inside the workspace and per-command envs (beside the sandbox's).
    const here = await sbx.commands.run('printf "%s %s " "$X" "$GREETING"; ls', { cwd: '/work/sub', envs: { X: 'per-command' } });
    expect(here.stdout).toBe('per-command hi-from-envvars deeper\nmoved.dat\n');
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
    const h = await startedInBackground(sbx, 'echo started; sleep 60');
    const procs = await sbx.commands.list();
    expect(procs.map((p) => p.pid)).toContain(h.pid);
    expect(await sbx.commands.kill(h.pid)).toBe(true);
    const end = await h.wait().catch((e: unknown) => e);
    expect(end).toBeInstanceOf(CommandExitError);
    expect(h.stdout).toBe('started\n');
    await sbx.kill();
  });

  it('a background command outlives its disconnected stream; commands.connect gets its later output and end', async () => {
    const sbx = await Sandbox.create(opts(b.token));
    // Waits for a file the test writes (unsafe-local: the command sees the host workspace).
    const h = await startedInBackground(sbx, 'echo first; while [ ! -f go ]; do sleep 0.05; done; echo second');
    await h.disconnect();
    expect((await sbx.commands.list()).map((p) => p.pid)).toContain(h.pid);
    const seen: string[] = [];
    const again = await sbx.commands.connect(h.pid, { onStdout: (d) => void seen.push(d) });
    await sbx.files.write('/work/go', '');
    const r = await again.wait();
    expect(r.exitCode).toBe(0);
    expect(seen.join('')).toBe('second\n');
    await expect(sbx.commands.connect(999_999)).rejects.toThrow(/not.?found|999999/i);
    await sbx.kill();
  });

  it("watchDir streams the directory events; the polling watcher (the Python SDK's) returns them on request", async () => {
    const sbx = await Sandbox.create(opts(b.token));
    await sbx.files.makeDir('/work/w');
    const seen: Array<{ name: string; type: string }> = [];
    const h = await sbx.files.watchDir('/work/w', (e) => void seen.push({ name: e.name, type: e.type }));
    await sbx.files.write('/work/w/new.txt', 'x');
    await sbx.commands.run('rm w/new.txt');
    while (!seen.some((e) => e.type === 'remove')) await new Promise((r) => setTimeout(r, 50));
    expect(seen.filter((e) => e.type !== 'write')).toEqual([
      { name: 'new.txt', type: 'create' },
      { name: 'new.txt', type: 'remove' },
    ]);
    await h.stop();
    await sbx.kill();

    // The polling watcher over the wire, as the Python SDK calls it.
    const made = (await (await fetch(`${base}/e2b/api/v2/sandboxes`, { method: 'POST', headers: { 'X-API-KEY': b.token, 'content-type': 'application/json' }, body: '{}' })).json()) as { sandboxID: string; envdAccessToken: string };
    const rpc = async (method: string, body: unknown): Promise<Record<string, unknown>> => {
      const res = await fetch(`${base}/e2b/envd/filesystem.Filesystem/${method}`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', 'E2b-Sandbox-Id': made.sandboxID, 'X-Access-Token': made.envdAccessToken },
        body: JSON.stringify(body),
      });
      expect(res.status).toBe(200);
      return (await res.json()) as Record<string, unknown>;
    };
    const { watcherId } = await rpc('CreateWatcher', { path: '/work', recursive: true });
    await rpc('MakeDir', { path: '/work/d' });
    let events: unknown[] = [];
    while (events.length === 0) {
      await new Promise((r) => setTimeout(r, 50));
      events = (await rpc('GetWatcherEvents', { watcherId })).events as unknown[];
    }
    expect(events).toEqual([{ name: 'd', type: 'EVENT_TYPE_CREATE' }]);
    await rpc('RemoveWatcher', { watcherId });
    await fetch(`${base}/e2b/api/sandboxes/${made.sandboxID}`, { method: 'DELETE', headers: { 'X-API-KEY': b.token } });
  });

  it('a recursive watch costs at most 5,000 directories (host-wide inotify watches): a bigger tree is refused, and a watch whose tree grows past it ends with that error', async () => {
    const sbx = await Sandbox.create(opts(b.token));
    await sbx.commands.run('python3 -c "import os\nfor i in range(5100): os.makedirs(f\'big/d{i}\')"');
    await expect(sbx.files.watchDir('/work/big', () => undefined, { recursive: true })).rejects.toThrow(/more than 5000 directories/);
    // Not recursive: one directory, whatever lies below it.
    const flat = await sbx.files.watchDir('/work/big', () => undefined);
    await flat.stop();
    // Nor a tree deeper than 64 levels (chokidar's work per event grows with the depth).
    await sbx.files.makeDir('/work/deep');
    await sbx.commands.run('cd /work/deep && python3 -c "import os\nfor i in range(70): os.mkdir(\'a\'); os.chdir(\'a\')"');
    await expect(sbx.files.watchDir('/work/deep', () => undefined, { recursive: true })).rejects.toThrow(/more than 64 levels deep/);
    await sbx.files.makeDir('/work/small/a');
    let ended: Error | undefined;
    let exited = false;
    // The watch takes in each new directory as it comes (5,100 of them): on a loaded 2-core
    // machine that took more than the SDK's default 60 s stream timeout, so it gets longer.
    const h = await sbx.files.watchDir('/work/small', () => undefined, { recursive: true, timeoutMs: 400_000, onExit: (err) => void ((ended = err), (exited = true)) });
    await sbx.commands.run('python3 -c "import os\nfor i in range(5100): os.makedirs(f\'small/a/d{i}\')"');
    const deadline = Date.now() + 300_000;
    while (!exited && Date.now() < deadline) await new Promise((r) => setTimeout(r, 100));
    expect(exited).toBe(true);
    expect(ended?.message).toMatch(/more than 5000 directories/);
    await h.stop();

    // The polling watcher (the Python SDK's): its next GetWatcherEvents says why it ended.
    const envd = (method: string, body: unknown) =>
      fetch(`${base}/e2b/envd/filesystem.Filesystem/${method}`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', 'E2b-Sandbox-Id': sbx.sandboxId, 'X-Access-Token': (sbx as unknown as { envdAccessToken: string }).envdAccessToken },
        body: JSON.stringify(body),
      });
    await sbx.files.makeDir('/work/polled/a');
    const created = await envd('CreateWatcher', { path: '/work/polled', recursive: true });
    expect(created.status).toBe(200);
    const { watcherId } = (await created.json()) as { watcherId: string };
    await sbx.commands.run('python3 -c "import os\nfor i in range(5100): os.makedirs(f\'polled/a/d{i}\')"');
    let last: Response | undefined;
    for (const end = Date.now() + 300_000; Date.now() < end; await new Promise((r) => setTimeout(r, 200))) {
      last = await envd('GetWatcherEvents', { watcherId });
      if (last.status !== 200) break;
    }
    expect(last?.status).toBe(429);
    expect(((await last?.json()) as { message: string }).message).toMatch(/more than 5000 directories/);
    await sbx.kill();
  }, 900_000);

  it("templateID: E2B's `base` (and hutch's `default`) is the default image; another name is a hutch template or a clear error, never the default image in its place", async () => {
    const create = (body: unknown) => fetch(`${base}/e2b/api/v2/sandboxes`, { method: 'POST', headers: { 'X-API-KEY': b.token, 'content-type': 'application/json' }, body: JSON.stringify(body) });
    for (const templateID of ['base', 'default']) {
      const res = await create({ templateID });
      expect(res.status).toBe(201);
      const made = (await res.json()) as { sandboxID: string; templateID: string };
      expect(made.templateID).toBe(templateID);
      await fetch(`${base}/e2b/api/sandboxes/${made.sandboxID}`, { method: 'DELETE', headers: { 'X-API-KEY': b.token } });
    }
    // unsafe-local has no templates: a named one is refused, saying what it does serve.
    const named = await create({ templateID: 'my-python-env' });
    expect(named.status).toBe(400);
    expect(await named.text()).toMatch(/my-python-env.*no templates.*only 'base'/);
    // A name that cannot be a template at all (a path) is a bad request too.
    const bad = await create({ templateID: '../../etc' });
    expect(bad.status).toBe(400);
    expect((await (await fetch(`${base}/e2b/api/v2/sandboxes`, { headers: { 'X-API-KEY': b.token } })).json()) as unknown[]).toEqual([]);
  });

  it('stdin: SendInput and CloseStdin reach a background command started with stdin', async () => {
    const sbx = await Sandbox.create(opts(b.token));
    const h = await sbx.commands.run('tr a-z A-Z', { background: true, stdin: true });
    await sbx.commands.sendStdin(h.pid, 'hello ');
    await sbx.commands.sendStdin(h.pid, 'stdin\n');
    await sbx.commands.closeStdin(h.pid);
    expect((await h.wait()).stdout).toBe('HELLO STDIN\n');
    // Without stdin: true there is no stdin to send to.
    const no = await startedInBackground(sbx, 'echo up; sleep 60');
    await expect(sbx.commands.sendStdin(no.pid, 'x')).rejects.toThrow(/without stdin/);
    await no.kill();
    await sbx.kill();
  });

  it('pause releases the sandbox, getInfo says paused, connect resumes it with its files', async () => {
    const sbx = await Sandbox.create(opts(b.token));
    await sbx.files.write('/work/kept.txt', 'kept\n');
    expect(await sbx.pause()).toBe(true);
    expect(await Sandbox.pause(sbx.sandboxId, opts(b.token))).toBe(false); // already paused: 409
    expect((await Sandbox.getInfo(sbx.sandboxId, opts(b.token))).state).toBe('paused');
    const again = await Sandbox.connect(sbx.sandboxId, opts(b.token));
    expect((await Sandbox.getInfo(sbx.sandboxId, opts(b.token))).state).toBe('running');
    expect((await again.commands.run('cat kept.txt')).stdout).toBe('kept\n');
    // Used while paused (no connect): resumed, like E2B's autoResume.
    await again.pause();
    expect(await again.files.read('/work/kept.txt')).toBe('kept\n');
    expect((await Sandbox.getInfo(sbx.sandboxId, opts(b.token))).state).toBe('running');
    await again.setTimeout(600_000);
    expect((await Sandbox.getInfo(sbx.sandboxId, opts(b.token))).endAt.getTime()).toBeGreaterThan(Date.now() + 500_000);
    await again.kill();
  });

  it('a sandbox whose timeout passes is killed', async () => {
    const sbx = await Sandbox.create(opts(b.token));
    await sbx.setTimeout(1000);
    while (await sbx.isRunning()) await new Promise((r) => setTimeout(r, 200));
    expect(() => b.broker.sessions.get(sbx.sandboxId)).toThrow(/no session/);
  });

  it('pages Sandbox.list with x-next-token', async () => {
    // A batch of its own (metadata filter), so sandboxes of other tests do not count.
    const metadata = { batch: randomBytes(6).toString('hex') };
    const made = [];
    for (let i = 0; i < 3; i++) made.push(await Sandbox.create({ ...opts(b.token), metadata }));
    const pager = Sandbox.list({ ...opts(b.token), limit: 2, query: { metadata } });
    const first = await pager.nextItems();
    expect(first).toHaveLength(2);
    expect(pager.hasNext).toBe(true);
    const second = await pager.nextItems();
    expect(pager.hasNext).toBe(false);
    expect([...first, ...second].map((s) => s.sandboxId).sort()).toEqual(made.map((s) => s.sandboxId).sort());
    for (const s of made) await s.kill();
  });
});

/** The pause/connect proof with a real VM: state outside the workspace survives. */
describe('pause and connect with a real VM', { tags: ['vm'] }, () => {
  let q: TestBroker;
  let qbase: string;
  beforeAll(async () => {
    // No idle release of its own: the release this test sees is the pause's.
    q = await startBroker({ backend: 'qemu', idleMs: 3_600_000 });
    qbase = q.url.replace(/^ws:/, 'http:');
  }, 1_800_000);
  afterAll(async () => {
    await q?.stop();
  });

  it('a file and a ~/.gitconfig change survive pause then Sandbox.connect', async () => {
    // A template this broker does not have is named in a 404 (no VM is started for it).
    const missing = await fetch(`${qbase}/e2b/api/v2/sandboxes`, { method: 'POST', headers: { 'X-API-KEY': q.token, 'content-type': 'application/json' }, body: JSON.stringify({ templateID: 'no-such-template' }) });
    expect(missing.status).toBe(404);
    expect(await missing.text()).toContain('no-such-template');
    const o = { apiKey: q.token, apiUrl: `${qbase}/e2b/api`, sandboxUrl: `${qbase}/e2b/envd`, timeoutMs: 1_800_000 };
    const sbx = await Sandbox.create(o);
    await sbx.files.write('/work/kept.txt', 'kept\n');
    const set = await sbx.commands.run('git config --global user.email dev@example.com && git config --global user.email', { timeoutMs: 600_000 });
    expect(set.stdout).toBe('dev@example.com\n');
    // A background command fed by SendInput while it runs (streamed into the VM), then killed.
    const seen: string[] = [];
    let echoed!: () => void;
    const gotLine = new Promise<void>((r) => (echoed = r));
    const h = await sbx.commands.run('cat', { background: true, stdin: true, timeoutMs: 600_000, onStdout: (d) => (seen.push(d), echoed()) });
    await sbx.commands.sendStdin(h.pid, 'line one\n');
    await gotLine;
    expect(seen.join('')).toBe('line one\n');
    expect(await h.kill()).toBe(true);
    await expect(h.wait()).rejects.toBeInstanceOf(CommandExitError);
    expect(await sbx.pause()).toBe(true);
    const metrics = await (await fetch(`${qbase}/metrics`, { headers: { authorization: `Bearer ${q.token}` } })).text();
    expect(metrics).toMatch(/hutch_releases_total\{decision="snapshot"\} [1-9]/);
    expect(q.broker.sessions.get(sbx.sandboxId).vm.live).toBe(false);
    const again = await Sandbox.connect(sbx.sandboxId, o);
    const r = await again.commands.run('git config --global user.email; cat kept.txt', { timeoutMs: 600_000 });
    expect(r.stdout).toBe('dev@example.com\nkept\n');
    await again.kill();
  }, 900_000);
});
