import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { spawn, execFileSync } from 'node:child_process';
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { randomBytes } from 'node:crypto';
import { Hutch } from '../host-broker/src/sdk/index.ts';
import { qemuPids } from '../host-broker/src/vm/qemu-driver.ts';
import { loadSessions, prepareWorkspace, replayBare, replayCall, treeDigest } from '../bench/lib/sessions.ts';
import { startBroker, type TestBroker } from './helpers/broker.ts';
import { waitFor } from './helpers/wait-for.ts';

/** End to end through the SDK and WebSocket with real VMs (qemu backend, TCG here). */
describe('sandbox lifecycle with real VMs', { tags: ['vm'] }, () => {
  let b: TestBroker;
  let hutch: Hutch;
  beforeAll(async () => {
    b = await startBroker({ backend: 'qemu', idleMs: 3000, workspaceRoots: [tmpdir()] });
    hutch = await b.connect();
  }, 1_800_000);
  afterAll(async () => {
    await b?.stop();
    expect(qemuPids(b.dataDir)).toEqual([]);
  });

  // The repo's own recorded sessions (examples/sessions): a Python fix, a Node fix, and a
  // commit after `git config --global` (state outside the workspace).
  for (const id of ['inv-fix-split', 'slug-fix-dashes', 'inv-add-cli-flag-commit']) {
    it(`replays ${id} like a bare host run: same exit codes, same final tree`, async () => {
      const s = loadSessions().find((x) => x.id === id);
      if (!s) throw new Error(`session ${id} missing from examples/sessions`);
      const base = mkdtempSync(join(tmpdir(), 'hutch-replay-'));
      prepareWorkspace(s.project, join(base, 'bare'));
      prepareWorkspace(s.project, join(base, 'src'));
      const bare = await replayBare(s, join(base, 'bare'), join(base, 'home'));
      const sb = await hutch.create({ workspace: { dir: join(base, 'src') } });
      const ours = [];
      for (const c of s.calls) ours.push(await replayCall(sb, c));
      expect(ours.map((o) => o.error ?? null).filter(Boolean)).toEqual([]);
      expect(ours.map((o) => o.exitCode ?? null)).toEqual(bare.map((o) => o.exitCode ?? null));
      expect(ours.some((o) => o.route === 'vm')).toBe(true);
      const theirs = await treeDigest(join(base, 'bare'));
      const mine = await treeDigest(join(b.dataDir, 'sessions', sb.id, 'workspace'));
      expect(Object.fromEntries(mine)).toEqual(Object.fromEntries(theirs));
      await sb.close();
      rmSync(base, { recursive: true, force: true });
    }, 900_000);
  }

  it('state outside the workspace (~/.gitconfig) survives release: snapshot slot, restore from it', async () => {
    const sb = await hutch.create({ workspace: { files: { 'a.txt': 'x\n' } } });
    const set = await sb.run('git config --global user.email dev@example.com && git config --global user.email');
    expect(set.route).toBe('vm');
    expect(set.stdout).toBe('dev@example.com\n');
    await sb.hint('idle'); // release now rather than after the idle window
    await waitFor(async () => !(await hutch.sessions()).find((x) => x.session === sb.id)?.live);
    const metrics = await (await fetch(`${b.url.replace('ws:', 'http:')}/metrics`, { headers: { authorization: `Bearer ${b.token}` } })).text();
    expect(metrics).toMatch(/hutch_releases_total\{decision="snapshot"\} [1-9]/);
    const again = await sb.run('git config --global user.email');
    expect(again.woke).toBe(true);
    expect(again.stdout).toBe('dev@example.com\n');
    await sb.close();
  }, 600_000);

  it('a clean VM is killed at release and the next call restores from the pristine snapshot with the workspace pushed', async () => {
    const sb = await hutch.create({ workspace: { files: { 'n.txt': '1\n' } } });
    expect((await sb.run('python3 -c "print(open(\'n.txt\').read().strip())"')).stdout).toBe('1\n');
    await sb.hint('idle');
    await waitFor(async () => !(await hutch.sessions()).find((x) => x.session === sb.id)?.live);
    await sb.files.write('n.txt', '2\n'); // host-side change while no VM runs
    const r = await sb.run('python3 -c "print(open(\'n.txt\').read().strip())"');
    expect(r.woke).toBe(true);
    expect(r.stdout).toBe('2\n');
    await sb.close();
  }, 600_000);

  it('tool_call_pending starts the wake before the call: the call finds the VM live, the workspace pushed, a later host edit too', async () => {
    const sb = await hutch.create({ workspace: { files: { 'p.txt': 'before\n' } } });
    expect((await hutch.sessions()).find((x) => x.session === sb.id)?.live).toBe(false);
    await sb.hint('tool_call_pending');
    await waitFor(async () => (await hutch.sessions()).find((x) => x.session === sb.id)?.live === true);
    await sb.files.write('p.txt', 'after the wake\n');
    const r = await sb.run('cat p.txt', { route: 'vm' });
    expect(r.woke).toBe(false);
    expect(r.stdout).toBe('after the wake\n');
    await sb.close();
  }, 600_000);

  it('SIGKILL of QEMU during a call: that call fails clearly, the workspace is intact, the next call works', async () => {
    const sb = await hutch.create({ workspace: { files: { 'keep.txt': 'precious\n' } } });
    await sb.run('echo warm > warm.txt', { route: 'vm' });
    const call = sb.run('sleep 30; echo late > late.txt', { route: 'vm' });
    await new Promise((r) => setTimeout(r, 1500));
    const pids = qemuPids(join(b.dataDir, 'vms', sb.id));
    expect(pids.length).toBe(1);
    process.kill(pids[0] as number, 'SIGKILL');
    await expect(call).rejects.toMatchObject({ code: 'guest_crashed' });
    const ws = join(b.dataDir, 'sessions', sb.id, 'workspace');
    expect(readFileSync(join(ws, 'keep.txt'), 'utf8')).toBe('precious\n');
    expect(readFileSync(join(ws, 'warm.txt'), 'utf8')).toBe('warm\n');
    expect(existsSync(join(ws, 'late.txt'))).toBe(false);
    const next = await sb.run('cat keep.txt warm.txt', { route: 'vm' });
    expect(next.stdout).toBe('precious\nwarm\n');
    await sb.close();
  }, 600_000);

  it('exports per-call records on /metrics', async () => {
    const text = await (await fetch(`${b.url.replace('ws:', 'http:')}/metrics`, { headers: { authorization: `Bearer ${b.token}` } })).text();
    expect(text).toMatch(/hutch_calls_total\{tool="bash",route="vm",outcome="ok"\} \d+/);
    expect(text).toMatch(/hutch_wakes_total\{how="pristine-restore"\} \d+/);
    expect(text).toMatch(/hutch_sync_bytes_total\{direction="push"\} \d+/);
    expect(text).toMatch(/hutch_call_added_seconds_bucket/);
  });
});

describe('broker restart', { tags: ['vm'] }, () => {
  it('a broker killed with live VMs leaves no VM or snapshot file behind once restarted', async () => {
    const dataDir = mkdtempSync(join(tmpdir(), 'hutch-restart-'));
    const token = randomBytes(8).toString('hex');
    const cli = resolve('host-broker/src/cli.ts');
    const start = () => {
      const p = spawn(process.execPath, ['--import', 'tsx', cli, 'serve', '--port', '0', '--token', token, '--data-dir', dataDir, '--log-level', 'warn'], { stdio: ['ignore', 'pipe', 'inherit'] });
      const url = new Promise<string>((res, rej) => {
        let out = '';
        p.stdout.on('data', (d: Buffer) => {
          out += d.toString();
          const m = /ws:\/\/[\d.]+:(\d+)/.exec(out);
          if (m) res(m[0]);
        });
        p.once('exit', (c) => rej(new Error(`broker exited ${c}: ${out}`)));
      });
      return { p, url };
    };
    const first = start();
    const h1 = await Hutch.connect(await first.url, { token });
    const sb = await h1.create({ workspace: { files: { 'f.txt': 'kept\n' } } });
    await sb.run('git config --global user.name x', { route: 'vm' });
    expect(qemuPids(join(dataDir, 'vms', sb.id)).length).toBe(1);
    // hutch serve keeps a standby VM (--standby 1): after the wake it restores one.
    await waitFor(async () => qemuPids(dataDir).length === 2, 60_000);
    first.p.kill('SIGKILL');
    await new Promise((r) => first.p.once('exit', r));
    // The VMs die with their broker (parent-death signal), the standby too, not later.
    await waitFor(async () => qemuPids(dataDir).length === 0, 10_000);
    const second = start();
    const h2 = await Hutch.connect(await second.url, { token });
    const again = await h2.attach(sb.id);
    expect((await again.run('cat f.txt', { route: 'vm' })).stdout).toBe('kept\n');
    // The killed broker's VM directories are gone; what is there now is this broker's.
    expect(readdirSync(join(dataDir, 'vms')).filter((d) => !d.startsWith('standby-'))).toEqual([sb.id]);
    h2.close();
    second.p.kill('SIGTERM');
    await new Promise((r) => second.p.once('exit', r));
    expect(qemuPids(dataDir)).toEqual([]);
    expect(existsSync(join(dataDir, 'vms')) ? readdirSync(join(dataDir, 'vms')) : []).toEqual([]);
    rmSync(dataDir, { recursive: true, force: true });
  }, 900_000);

  it('a broker shut down with reclaimed VMs snapshots them: their processes and home outlive the restart', async () => {
    // Under the reclaim policy every idle VM stays alive, reclaimed; a shutdown used to stop
    // them with everything outside /work (a reclaimed VM was not released again, a live one
    // was reclaimed and then stopped).
    const policy = { idlePolicy: 'reclaim' as const };
    const first = await startBroker({ backend: 'qemu', policy });
    const h1 = await first.connect();
    const idle = await h1.create({ workspace: { files: { 'a.txt': 'a\n' } } });
    const live = await h1.create({ workspace: { files: { 'b.txt': 'b\n' } } });
    const bg = 'setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo started';
    expect((await idle.run(`echo from-the-reclaimed-vm > ~/marker; ${bg}`, { route: 'vm' })).stdout).toBe('started\n');
    expect((await live.run(`echo from-the-live-vm > ~/marker; ${bg}`, { route: 'vm' })).stdout).toBe('started\n');
    await idle.hint('idle');
    const releases = async (decision: string) => {
      const text = await (await fetch(`${first.url.replace('ws:', 'http:')}/metrics`, { headers: { authorization: `Bearer ${first.token}` } })).text();
      return Number(new RegExp(`hutch_releases_total\\{decision="${decision}"\\} (\\d+)`).exec(text)?.[1] ?? 0);
    };
    await waitFor(async () => (await releases('reclaim')) === 1, 120_000);
    await first.stop({ keepData: true });
    for (const id of [idle.id, live.id]) expect(existsSync(join(first.dataDir, 'sessions', id, 'state', 'slots', 'current'))).toBe(true);
    const second = await startBroker({ backend: 'qemu', policy, dataDir: first.dataDir });
    const h2 = await second.connect();
    for (const [id, marker] of [[idle.id, 'from-the-reclaimed-vm'], [live.id, 'from-the-live-vm']] as const) {
      const r = await (await h2.attach(id)).run('cat ~/marker; pgrep -c -x sleep', { route: 'vm' });
      expect(r.woke).toBe(true);
      expect(r.stdout).toBe(`${marker}\n1\n`);
    }
    await second.stop();
  }, 900_000);

  it('examples/hundred.ts 20 --vm prints 20 matching lines', () => {
    const out = execFileSync(process.execPath, ['--import', 'tsx', 'examples/hundred.ts', '20', '--vm'], { encoding: 'utf8', timeout: 600_000, stdio: ['ignore', 'pipe', 'pipe'] });
    const lines = out.split('\n').filter((l) => /^Sandbox \d+: [0-9a-f]{16}$/.test(l));
    expect(lines.length).toBe(20);
  }, 700_000);
});
