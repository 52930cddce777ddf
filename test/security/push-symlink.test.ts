import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { mkdtempSync, rmSync, writeFileSync, mkdirSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { Hutch } from '../../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/**
 * A push takes the paths the host workspace's watcher marked. When a pull replaces a
 * directory with a symlink, the watcher marks the files that were in it. The push then
 * stat-ed and read those paths by their whole host path, which follows a symlink in any
 * component but the last. So the broker (root) read the file behind the link, outside the
 * workspace, and sent it into the guest. A guest whose own `x` was a real directory again
 * by then (a background job) wrote it there for the tenant to read.
 */
describe('a push never follows a symlink the guest put in the workspace', () => {
  let b: TestBroker;
  let hutch: Hutch;
  let outside: string;
  beforeAll(async () => {
    outside = mkdtempSync(join(tmpdir(), 'hutch-outside-'));
    mkdirSync(join(outside, 'x'));
    writeFileSync(join(outside, 'x', 'secret.txt'), 'HOST SECRET\n');
    b = await startBroker({ backend: 'qemu', idleMs: 600_000 });
    hutch = await b.connect();
  }, 300_000);
  afterAll(async () => {
    await b?.stop();
    rmSync(outside, { recursive: true, force: true });
  });

  it('the host file behind the link never reaches the guest', async () => {
    const sb = await hutch.create({ workspace: { files: { 'a.txt': 'A\n' } } });
    const target = join(outside, 'x');
    // 1. A real directory with the file the watcher will name later.
    expect((await sb.run('mkdir x && echo decoy > x/secret.txt', { route: 'vm' })).exitCode).toBe(0);
    // 2. The directory becomes a link to the host directory (pulled to the host: the
    //    watcher sees x/secret.txt go), and a job makes it a real directory again in the
    //    guest only, before the next call's push.
    const swap = await sb.run(`rm -rf x && ln -s ${target} x && setsid sh -c 'sleep 4; rm x; mkdir x' >/dev/null 2>&1 < /dev/null &`, { route: 'vm' });
    expect(swap.exitCode).toBe(0);
    await new Promise((r) => setTimeout(r, 7000));
    // 3. The next call's push carries the marked paths; the command reads what it wrote.
    const r = await sb.run('cat x/secret.txt 2>&1; ls -la x', { route: 'vm' });
    expect(r.stdout).not.toContain('HOST SECRET');
    // And nothing of the tenant's reached the host directory.
    const after = await sb.run('echo mine > x/mine.txt', { route: 'vm' });
    expect(after.exitCode).toBe(0);
    expect(() => rmSync(join(target, 'mine.txt'))).toThrow();
    await sb.close();
  }, 300_000);
});
