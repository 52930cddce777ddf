import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { WebSocket } from 'ws';
import { HutchError } from '../guest-agent/src/protocol/errors.ts';
import type { Hutch } from '../host-broker/src/sdk/index.ts';
import { qemuPids } from '../host-broker/src/vm/qemu-driver.ts';
import { startBroker, type TestBroker } from './helpers/broker.ts';

/**
 * Issue "never lose a call", end to end with real microVMs: every call gets an answer or a
 * typed error, across releases and wakes, a frozen guest, and the odd signal.
 */
describe('never lose a call (real VMs)', { tags: ['vm'] }, () => {
  let b: TestBroker;
  let hutch: Hutch;
  beforeAll(async () => {
    // A frozen guest is given up on after 10 s of silence (the TCG default is 80 s).
    process.env['HUTCH_GUEST_DEAD_AFTER_MS'] = '10000';
    b = await startBroker({ backend: 'qemu', idleMs: 600_000 });
    hutch = await b.connect();
  }, 1_800_000);
  afterAll(async () => {
    delete process.env['HUTCH_GUEST_DEAD_AFTER_MS'];
    await b?.stop();
    expect(qemuPids(b.dataDir)).toEqual([]);
  });

  const live = async (id: string) => (await hutch.sessions()).find((x) => x.session === id)?.live ?? false;
  async function released(id: string): Promise<void> {
    for (let i = 0; i < 600 && (await live(id)); i++) await new Promise((r) => setTimeout(r, 200));
    expect(await live(id)).toBe(false);
  }

  it('release and wake eight times in a row (kill and snapshot slots in turn): every call answered, nothing lost', async () => {
    const sb = await hutch.create({ workspace: { files: { 'log.txt': '' } } });
    for (let i = 0; i < 8; i++) {
      // Odd rounds change HOME too, so the release snapshots into a slot instead of killing.
      const extra = i % 2 === 1 ? ` && git config --global user.name round${i}` : '';
      const r = await sb.run(`echo ${i} >> log.txt && wc -l < log.txt${extra}`, { route: 'vm' });
      expect(r.exitCode).toBe(0);
      expect(r.stdout.trim()).toBe(String(i + 1));
      if (i > 0) expect(r.woke).toBe(true);
      await sb.hint('idle');
      await released(sb.id);
    }
    const who = await sb.run('git config --global user.name', { route: 'vm' });
    expect(who.stdout.trim()).toBe('round7');
    expect(readFileSync(join(b.dataDir, 'sessions', sb.id, 'workspace', 'log.txt'), 'utf8')).toBe('0\n1\n2\n3\n4\n5\n6\n7\n');
    await sb.close();
  }, 1_200_000);

  it("the guest's clock equals the host's after a restore", async () => {
    const sb = await hutch.create({ workspace: { files: { 'x': '' } } });
    const before = Date.now();
    const r = await sb.run('date +%s%3N', { route: 'vm' });
    const after = Date.now();
    expect(r.woke).toBe(true);
    const guest = Number(r.stdout.trim());
    // The guest read its clock between our two readings (give or take the clock set's slack).
    expect(guest).toBeGreaterThan(before - 2000);
    expect(guest).toBeLessThan(after + 2000);
    await sb.close();
  }, 600_000);

  it('a frozen VM (SIGSTOP) fails the call with guest_unresponsive, is torn down, and the next call works on the intact workspace', async () => {
    const sb = await hutch.create({ workspace: { files: { 'keep.txt': 'precious\n' } } });
    expect((await sb.run('echo a > a.txt', { route: 'vm' })).exitCode).toBe(0);
    const call = sb.run('sleep 120', { route: 'vm' });
    await new Promise((r) => setTimeout(r, 1500));
    const pids = qemuPids(join(b.dataDir, 'vms', sb.id));
    expect(pids.length).toBe(1);
    process.kill(pids[0] as number, 'SIGSTOP');
    const err = await call.then(
      () => undefined,
      (e: unknown) => e as HutchError,
    );
    expect(err).toBeInstanceOf(HutchError);
    expect(err?.code).toBe('guest_unresponsive');
    // Torn down: the stopped QEMU is gone (killed, not left frozen).
    for (let i = 0; i < 50 && qemuPids(join(b.dataDir, 'vms', sb.id)).includes(pids[0] as number); i++) await new Promise((r) => setTimeout(r, 200));
    expect(qemuPids(join(b.dataDir, 'vms', sb.id))).not.toContain(pids[0]);
    const next = await sb.run('cat keep.txt a.txt', { route: 'vm' });
    expect(next.woke).toBe(true);
    expect(next.stdout).toBe('precious\na\n');
    await sb.close();
  }, 600_000);

  it('releasing a frozen VM finishes (it is killed instead of snapshotted) and the next call wakes a fresh one', async () => {
    const sb = await hutch.create({ workspace: { files: { 'keep.txt': 'kept\n' } } });
    expect((await sb.run('git config --global user.name frozen && echo ok', { route: 'vm' })).stdout).toBe('ok\n');
    const [pid] = qemuPids(join(b.dataDir, 'vms', sb.id));
    process.kill(pid as number, 'SIGSTOP');
    await sb.hint('idle'); // dirty: the release would snapshot; the guest cannot answer
    await released(sb.id);
    expect(qemuPids(join(b.dataDir, 'vms', sb.id))).not.toContain(pid);
    const next = await sb.run('cat keep.txt', { route: 'vm' });
    expect(next.woke).toBe(true);
    expect(next.stdout).toBe('kept\n');
    await sb.close();
  }, 600_000);

  it('close() finishes while a call is stuck in a frozen VM: the call fails typed, the VM is gone', async () => {
    const sb = await hutch.create({ workspace: { files: { 'x': '' } } });
    const call = sb.run('sleep 300', { route: 'vm' }).then(
      () => 'resolved',
      (e: unknown) => (e instanceof HutchError ? e.code : 'untyped'),
    );
    await new Promise((r) => setTimeout(r, 1500));
    const [pid] = qemuPids(join(b.dataDir, 'vms', sb.id));
    expect(pid).toBeDefined();
    process.kill(pid as number, 'SIGSTOP');
    await sb.close(); // bounded: the grace, then the VM is stopped under the call
    // Frozen in the wake (cancelled with it) or in the command (cancelled, or the stopped VM fails it).
    expect(['cancelled', 'guest_crashed', 'guest_unresponsive']).toContain(await call);
    expect(qemuPids(join(b.dataDir, 'vms', sb.id))).toEqual([]);
  }, 300_000);

  it('close() while the VM is still waking (frozen before its agent said hello): the call is cancelled, not left to a handshake timeout', async () => {
    const sb = await hutch.create({ workspace: { files: { 'x': '' } } });
    const call = sb.run('true', { route: 'vm' }).then(
      () => 'resolved',
      (e: unknown) => (e instanceof HutchError ? `${e.code}: ${e.message}` : 'untyped'),
    );
    // Freeze QEMU the moment it exists: its guest can never finish the wake.
    let pid: number | undefined;
    for (let i = 0; i < 1500 && pid === undefined; i++) {
      pid = qemuPids(join(b.dataDir, 'vms', sb.id))[0];
      if (pid === undefined) await new Promise((r) => setTimeout(r, 20));
    }
    expect(pid).toBeDefined();
    process.kill(pid as number, 'SIGSTOP');
    await sb.close();
    // Before: the wake waited out the agent handshake (60 s) and the call failed with `timeout`.
    expect(await call).toMatch(/^cancelled: .*closed while its VM was waking/);
    expect(qemuPids(join(b.dataDir, 'vms', sb.id))).toEqual([]);
  }, 300_000);

  it('signal sends the signal asked: a trap sees SIGINT and the command finishes its own way', async () => {
    const sb = await hutch.create({ workspace: { files: { 'x': '' } } });
    const ac = new AbortController();
    const command = "trap 'echo got INT; exit 3' INT; echo ready; sleep 60 & wait";
    const r = await sb.run(command, { route: 'vm', onStdout: (s) => void (s.includes('ready') && setTimeout(() => ac.abort('SIGINT'), 300)), signal: ac.signal });
    expect(r.stdout).toContain('got INT');
    expect(r.exitCode).toBe(3);
    await sb.close();
  }, 600_000);

  it('metrics count the route a failed call took', async () => {
    const sb = await hutch.create({ workspace: { files: { 'x': '' } } });
    // The call's VM dies under it: it fails, and it failed on the VM route.
    await sb.run('true', { route: 'vm' });
    const call = sb.run('sleep 60', { route: 'vm' });
    await new Promise((r) => setTimeout(r, 1000));
    for (const pid of qemuPids(join(b.dataDir, 'vms', sb.id))) process.kill(pid, 'SIGKILL');
    await expect(call).rejects.toMatchObject({ code: 'guest_crashed' });
    const url = b.url.replace('ws:', 'http:') + '/metrics';
    const metrics = await (await fetch(url, { headers: { authorization: `Bearer ${b.token}` } })).text();
    expect(metrics).toMatch(/hutch_calls_total\{tool="bash",route="vm",outcome="error"\} [1-9]/);
    expect(metrics).not.toMatch(/hutch_calls_total\{tool="bash",route="inprocess"/);
    await sb.close();
  }, 600_000);

  it('JSON output frames never split a character across chunks', async () => {
    const sb = await hutch.create({ workspace: { files: { 'x': '' } } });
    const ws = new WebSocket(b.url, { headers: { authorization: `Bearer ${b.token}` } });
    const frames: Array<Record<string, unknown>> = [];
    await new Promise((r) => ws.once('open', r));
    ws.on('message', (d) => frames.push(JSON.parse(String(d)) as Record<string, unknown>));
    // 200,000 two-byte characters: chunk boundaries land inside characters many times.
    const command = "head -c 200000 /dev/zero | tr '\\0' 'x' | sed 's/x/é/g'";
    ws.send(JSON.stringify({ t: 'req', id: 1, op: 'call', p: { session: sb.id, tool: 'bash', args: { command, route: 'fastpath' }, stream: true } }));
    for (let i = 0; i < 600 && !frames.some((f) => f['t'] === 'res' && f['id'] === 1); i++) await new Promise((r) => setTimeout(r, 100));
    ws.close();
    const res = frames.find((f) => f['t'] === 'res' && f['id'] === 1) as { r?: { route: string } } | undefined;
    expect(res?.r).toBeDefined();
    const text = frames.filter((f) => f['t'] === 'out' && f['fd'] === 1).map((f) => f['d'] as string).join('');
    expect(text.length).toBe(200_000);
    expect(text).toBe('é'.repeat(200_000));
    await sb.close();
  }, 600_000);
});
