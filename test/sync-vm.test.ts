import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { execFileSync } from 'node:child_process';
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import type { Hutch } from '../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from './helpers/broker.ts';
import { countEntries } from './helpers/tree-digest.ts';
import { waitFor } from './helpers/wait-for.ts';


/** Issue 11 item 3 through the whole stack: a real broker, real VMs, the guest's files pulled back. */
describe('workspace sync with real VMs', { tags: ['vm'] }, () => {
  let b: TestBroker;
  let hutch: Hutch;
  beforeAll(async () => {
    b = await startBroker({ backend: 'qemu', idleMs: 600_000 });
    hutch = await b.connect();
  }, 1_800_000);
  afterAll(async () => {
    await b?.stop();
  });

  it('a file named b"bad\\xfe" made in the VM reaches the host with that name, survives release and the next wake', async () => {
    const sb = await hutch.create({ workspace: { files: { 'a.txt': 'x\n' } } });
    const made = await sb.run("printf 'odd\\n' > $'/work/bad\\xfe' && mkdir $'/work/d\\xff' && printf 'in\\n' > $'/work/d\\xff/f\\xfe'", { route: 'vm' });
    expect(made.exitCode).toBe(0);
    const ws = join(b.dataDir, 'sessions', sb.id, 'workspace');
    const bad = Buffer.from([0x62, 0x61, 0x64, 0xfe]);
    const names = (readdirSync(ws, { encoding: 'buffer' }) as Buffer[]).map((n) => n.toString('hex'));
    expect(names).toContain(bad.toString('hex'));
    expect(readFileSync(Buffer.concat([Buffer.from(`${ws}/`), bad]), 'utf8')).toBe('odd\n');
    // The API shows the name as its surrogateescape string (JSON carries it as "\udcfe";
    // msgpack strings cannot hold a lone surrogate, so this looks through a JSON client).
    const json = await b.connect({ encoding: 'json' });
    const listed = await (await json.attach(sb.id)).files.glob('bad*');
    expect(listed.files.map((f) => f.replace(/^.*\//, ''))).toContain('bad\udcfe');

    await sb.hint('idle'); // release now: a clean VM is killed, the next call restores and pushes
    await waitFor(async () => !(await hutch.sessions()).find((x) => x.session === sb.id)?.live);
    const again = await sb.run("cat $'/work/bad\\xfe' $'/work/d\\xff/f\\xfe'", { route: 'vm' });
    expect(again.woke).toBe(true);
    expect(again.exitCode).toBe(0);
    expect(again.stdout).toBe('odd\nin\n');
    await sb.close();
  }, 900_000);

  it('what a background process writes between two calls reaches the host, even when the next call pushes a host edit first', async () => {
    const sb = await hutch.create({ workspace: { files: { 'a.txt': 'x\n' } } });
    const started = await sb.run('(sleep 1; echo late > /work/bg.log) > /dev/null 2>&1 &', { route: 'vm' });
    expect(started.exitCode).toBe(0);
    const ws = join(b.dataDir, 'sessions', sb.id, 'workspace');
    // Long enough for the job to finish even in an emulated guest; no call runs meanwhile.
    await new Promise((r) => setTimeout(r, 10_000));
    expect(existsSync(join(ws, 'bg.log'))).toBe(false); // nothing pulls between calls
    await sb.files.write('a.txt', 'edited on the host\n'); // a host change: the next VM call pushes it
    const next = await sb.run('cat /work/a.txt', { route: 'vm' });
    expect(next.stdout).toBe('edited on the host\n');
    // The push took a new sync marker before the call; it must not have swallowed bg.log.
    expect(readFileSync(join(ws, 'bg.log'), 'utf8')).toBe('late\n');
    expect(readFileSync(join(ws, 'a.txt'), 'utf8')).toBe('edited on the host\n');
    await sb.close();
  }, 900_000);

  it('what a background job writes after the last call reaches the host before its idle VM is released (and killed)', async () => {
    const sb = await hutch.create({ workspace: { files: { 'a.txt': 'x\n' } } });
    expect((await sb.run('(sleep 1; echo done > /work/job.out) > /dev/null 2>&1 &', { route: 'vm' })).exitCode).toBe(0);
    const ws = join(b.dataDir, 'sessions', sb.id, 'workspace');
    await new Promise((r) => setTimeout(r, 10_000));
    expect(existsSync(join(ws, 'job.out'))).toBe(false);
    await sb.hint('idle'); // the job is over and nothing outside /work changed: the VM is killed
    await waitFor(async () => !(await hutch.sessions()).find((x) => x.session === sb.id)?.live);
    expect(readFileSync(join(ws, 'job.out'), 'utf8')).toBe('done\n');
    const again = await sb.run('cat /work/job.out', { route: 'vm' });
    expect({ woke: again.woke, stdout: again.stdout }).toEqual({ woke: true, stdout: 'done\n' });
    await sb.close();
  }, 900_000);

  it('2,000 FIFOs made in the VM: the call lists 100 sync errors and counts the rest, and the idle VM keeps them (it is not killed)', async () => {
    // A tenant can make as many entries the host cannot take as the entry quota allows, with
    // 4 KiB names: listing them all made a call result of up to a gigabyte.
    const sb = await hutch.create({ workspace: { files: { 'a.txt': 'x\n' } } });
    const r = await sb.run(`python3 -c "import os; [os.mkfifo('fifo%d-' % i + 'n' * 100) for i in range(2000)]"`, { route: 'vm' });
    expect(r.exitCode).toBe(0);
    expect(r.syncErrors?.length).toBe(100);
    expect(r.syncErrors?.every((e) => e.code === 'unsupported_file_type' && e.path.startsWith('fifo'))).toBe(true);
    expect(r.syncErrorsOmitted).toBe(1900);
    const ws = join(b.dataDir, 'sessions', sb.id, 'workspace');
    expect(readdirSync(ws)).toEqual(['a.txt']);
    await sb.hint('idle'); // entries only the guest holds: the release keeps the VM's state
    await waitFor(async () => !(await hutch.sessions()).find((x) => x.session === sb.id)?.live);
    const again = await sb.run('ls /work | grep -c ^fifo', { route: 'vm' });
    expect({ woke: again.woke, stdout: again.stdout }).toEqual({ woke: true, stdout: '2000\n' });
    expect(again.syncErrors).toBeUndefined(); // reported once, by the call that made them
    await sb.close();
  }, 900_000);

  it('a tree deeper than any sync path, made in the VM or on the host, is reported once and never fails the session\'s calls', async () => {
    const sb = await hutch.create({ workspace: { files: { 'a.txt': 'x\n' } } });
    const lifecycle = b.broker.sessions.get(sb.id).vm;
    // Watched only while a VM lives.
    expect(lifecycle.hostChanges.watching).toBe(false);
    const level = (i: number, c: string) => `d${String(i).padStart(2, '0')}${c.repeat(196)}`;
    const deep = (top: string, n: number, c: string) =>
      `python3 -c "import os\nos.chdir('/work'); os.mkdir('${top}'); os.chdir('${top}')\nfor i in range(${n}):\n    n = 'd%02d' % i + '${c}' * 196\n    os.mkdir(n); os.chdir(n)\nopen('f.txt', 'w').write('deep')"`;
    const made = await sb.run(deep('B', 25, 'x'), { route: 'vm' });
    expect(made.exitCode).toBe(0);
    expect(lifecycle.hostChanges.watching).toBe(true);
    // Reported once, as the directory holding what cannot be carried; the rest is on the host.
    expect(made.syncErrors?.map((e) => e.code)).toEqual(['invalid_name']);
    const under = made.syncErrors?.[0]?.path as string;
    expect(Buffer.byteLength(under)).toBeLessThanOrEqual(4096);
    expect(under).toBe(['B', ...Array.from({ length: 20 }, (_, i) => level(i, 'x'))].join('/'));
    const ws = join(b.dataDir, 'sessions', sb.id, 'workspace');
    expect(existsSync(join(ws, under))).toBe(true);
    const next = await sb.run('ls B | wc -l', { route: 'vm' });
    expect([next.exitCode, next.stdout, next.syncErrors]).toEqual([0, '1\n', undefined]);
    // The same depth made on the host side (a fast-path tenant): the next VM call works and
    // sees what a path can name. (What the watcher noted of the pull's own writes is nothing to push.)
    lifecycle.hostChanges.take();
    execFileSync('python3', ['-c', `import os\nos.chdir(${JSON.stringify(ws)}); os.mkdir('C'); os.chdir('C')\nfor i in range(25):\n    n = 'd%02d' % i + 'y' * 196\n    os.mkdir(n); os.chdir(n)`]);
    // Someone else's edit of the host workspace reaches the next call once the watcher saw it.
    await waitFor(async () => lifecycle.hostChanges.pending, 30_000, 'the watcher seeing C');
    const seen = await sb.run('find C -type d | wc -l', { route: 'vm' });
    expect(seen.exitCode).toBe(0);
    const levels = Number(seen.stdout.trim());
    expect(levels).toBeGreaterThanOrEqual(19);
    expect(levels).toBeLessThanOrEqual(21);
    await sb.hint('idle');
    await waitFor(async () => !(await hutch.sessions()).find((x) => x.session === sb.id)?.live);
    expect(lifecycle.hostChanges.watching).toBe(false);
    await sb.close();
    expect(existsSync(join(b.dataDir, 'sessions', sb.id))).toBe(false);
  }, 900_000);

  it('a 100,000-file change set (an npm install) comes back whole, and the next call of the session works', async () => {
    // /work is a tmpfs in guest RAM with the kernel's default inode count (half the RAM's
    // pages): 100,000 files need a 1 GiB guest. Empty files: the names are what this is about.
    const sb = await hutch.create({ memoryMiB: 1024, workspace: { files: { 'package.json': '{}\n' } } });
    const inodes = await sb.run('df --output=itotal /work | tail -1', { route: 'vm' });
    expect(Number(inodes.stdout.trim())).toBeGreaterThan(101_000);
    const made = await sb.run('mkdir -p /work/node_modules && cd /work/node_modules && for d in $(seq 0 99); do mkdir p$d && (cd p$d && seq -f f%g.js 0 999 | xargs touch); done', { route: 'vm', timeoutMs: 1_200_000 });
    expect({ exit: made.exitCode, stderr: made.stderr.slice(0, 500) }).toEqual({ exit: 0, stderr: '' });
    const ws = join(b.dataDir, 'sessions', sb.id, 'workspace');
    expect(countEntries(join(ws, 'node_modules'))).toBe(100_100);
    const next = await sb.run('ls /work/node_modules | wc -l', { route: 'vm' });
    expect(next.stdout.trim()).toBe('100');
    await sb.close();
  }, 1_800_000);
});
