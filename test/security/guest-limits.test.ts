import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { Hutch, Sandbox } from '../../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/**
 * Issue 12 item 9: a fork bomb in a VM killed it (52 s, then guest_crashed): the workload
 * cgroup had pids.max=4096 and no memory limit in a 512 MiB VM. With limits derived from
 * the VM's size, the workload exhausts only its own cgroup: the call ends with an error
 * or an exit status, and the agent answers the next call of the session.
 */
describe('guest workload limits', { tags: ['vm'] }, () => {
  let b: TestBroker;
  let hutch: Hutch;
  let sb: Sandbox;
  beforeAll(async () => {
    b = await startBroker({ backend: 'qemu', policy: { idleMs: null } });
    hutch = await b.connect();
    sb = await hutch.create({ memoryMiB: 512 });
  }, 600_000);
  afterAll(async () => b?.stop());

  it('the workload cgroup is limited by the VM size', async () => {
    const r = await sb.run('cat /sys/fs/cgroup/workload/memory.max /sys/fs/cgroup/workload/pids.max; grep MemTotal /proc/meminfo', { route: 'vm' });
    const [mem, pids, total] = r.stdout.trim().split('\n');
    const totalBytes = Number(/(\d+)/.exec(total ?? '')?.[1]) * 1024;
    expect(mem).not.toBe('max');
    expect(Number(mem)).toBeLessThan(totalBytes);
    expect(Number(pids)).toBeLessThanOrEqual(totalBytes / (512 * 1024));
  }, 300_000);

  it('a fork bomb ends with the call, and the next call works', async () => {
    // Foreground (no `&`): the tree lives as long as the call; the call's timeout ends it.
    const r = await sb.run('bomb() { bomb | bomb; }; bomb', { route: 'vm', timeoutMs: 30_000 }).catch((e: { code: string }) => ({ error: e.code }));
    expect(r).not.toMatchObject({ error: 'guest_crashed' });
    if (!('error' in r)) expect(r.timedOut || r.exitCode !== 0).toBe(true);
    const next = await sb.run('echo alive', { route: 'vm' });
    expect(next.stdout).toBe('alive\n');
  }, 300_000);

  it('a memory hog is killed inside the workload, and the next call works', async () => {
    // 16 MiB at a time, each page written: no single allocation the kernel would refuse
    // up front, so only a memory limit stops it (the OOM killer, inside the workload).
    const hog = `python3 -c "
a = []
while True:
    a.append(b'x' * (16 << 20))
    print(len(a) * 16, flush=True)
"`;
    const r = await sb.run(hog, { route: 'vm', timeoutMs: 240_000, maxOutputBytes: 4096 }).catch((e: { code: string }) => ({ error: e.code }));
    expect(r).not.toMatchObject({ error: 'guest_crashed' });
    if (!('error' in r)) {
      expect(r.timedOut).toBe(false);
      expect(r.exitCode === 137 || r.signal === 'SIGKILL', JSON.stringify({ exit: r.exitCode, signal: r.signal, tail: r.stdout.slice(-40), err: r.stderr.slice(-200) })).toBe(true);
    }
    const next = await sb.run('echo alive', { route: 'vm' });
    expect(next.stdout).toBe('alive\n');
  }, 300_000);
});
