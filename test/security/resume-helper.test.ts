import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { Hutch } from '../../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/**
 * The resident hutch-resume (guest-agent/src/resume.ts) runs as root in every VM, waiting
 * for the next wake's entropy and clock. A tenant command shares the VM with it: it must not
 * be able to stop it, feed it a clock or entropy of its own, nor read what the broker sends.
 */
describe('the resident resume helper against a tenant in the same VM', { tags: ['vm'] }, () => {
  let b: TestBroker;
  let hutch: Hutch;
  beforeAll(async () => {
    b = await startBroker({ backend: 'qemu' });
    hutch = await b.connect();
  }, 1_800_000);
  afterAll(async () => b?.stop());

  it('a tenant cannot kill, stop, write to or read from it, and its /work resize keeps nosuid and nodev', async () => {
    const sb = await hutch.create({ workspace: { files: { 'a.txt': 'x\n' } } });
    const script = [
      "pid=$(ps -eo pid,args | awk '/[h]utch-resume --serve/ {print $1}')",
      'echo "pid=$pid"',
      'kill -9 "$pid" 2>/dev/null && echo killed=yes || echo killed=no',
      'kill -STOP "$pid" 2>/dev/null && echo stopped=yes || echo stopped=no',
      '(echo "1 0 00 0 0" > /proc/$pid/fd/0) 2>/dev/null && echo wrote=yes || echo wrote=no',
      '(head -c 1 /proc/$pid/fd/1 >/dev/null) 2>/dev/null && echo read=yes || echo read=no',
      'ps -eo pid,args | grep -c "[h]utch-resume --serve"',
      'grep " /work " /proc/mounts',
    ].join('\n');
    const r = await sb.run(script, { route: 'vm' });
    expect(r.stdout).toMatch(/^pid=\d+$/m);
    expect(r.stdout).toContain('killed=no');
    expect(r.stdout).toContain('stopped=no');
    expect(r.stdout).toContain('wrote=no');
    expect(r.stdout).toContain('read=no');
    expect(r.stdout).toMatch(/^1$/m); // still there
    const work = r.stdout.split('\n').find((l) => l.includes(' /work ')) ?? '';
    expect(work).toMatch(/nosuid/);
    expect(work).toMatch(/nodev/);
    await sb.close();
  }, 900_000);
});
