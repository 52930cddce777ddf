import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { execFileSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { createLogger } from '../../guest-agent/src/log.ts';
import { createBackend } from '../../host-broker/src/backends/registry.ts';
import type { Hutch, Sandbox } from '../../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/**
 * Issue 12 item 1: the local backend was host root. A VM-routed call ran as real root with
 * no user namespace and no seccomp: it wrote a host sysctl, read the broker's token from
 * /proc/1/environ, and a `setsid` child outlived the call; and the broker chose that
 * backend by itself when QEMU was missing.
 */
describe('unsafe-local backend', () => {
  let b: TestBroker;
  let hutch: Hutch;
  let sb: Sandbox;
  const secret = `hutch-secret-${process.pid}-${Date.now()}`;
  beforeAll(async () => {
    // The broker's own environment holds a secret, as HUTCH_TOKEN would.
    process.env['HUTCH_TEST_SECRET'] = secret;
    b = await startBroker({ backend: 'unsafe-local' });
    hutch = await b.connect();
    sb = await hutch.create();
  });
  afterAll(async () => {
    delete process.env['HUTCH_TEST_SECRET'];
    await b?.stop();
  });

  it('is never chosen without its name and the acknowledgement', async () => {
    const log = createLogger({ name: 't', level: 'error' });
    await expect(createBackend('unsafe-local', { log, dataDir: b.dataDir })).rejects.toMatchObject({ code: 'bad_request', message: expect.stringMatching(/--i-know-unsafe-local/) });
    await expect(createBackend('local', { log, dataDir: b.dataDir })).rejects.toMatchObject({ code: 'bad_request' });
    // Without a name the broker asks for qemu; on a host without QEMU (none on this PATH)
    // that is an error naming the fix, never a fallback to a weaker backend.
    const path = process.env['PATH'];
    process.env['PATH'] = '/nonexistent';
    try {
      await expect(createBackend(undefined, { log, dataDir: b.dataDir })).rejects.toMatchObject({
        code: 'unavailable',
        message: expect.stringMatching(/qemu-system-x86_64.*--backend unsafe-local --i-know-unsafe-local/s),
      });
    } finally {
      process.env['PATH'] = path;
    }
  });

  it('cannot write a host sysctl', async () => {
    const path = '/proc/sys/kernel/core_uses_pid';
    const before = readFileSync(path, 'utf8');
    // Writes the current value back: harmless if it got through, and the exit code tells.
    const r = await sb.run(`cat ${path} > /tmp/v && cat /tmp/v > ${path} && echo WROTE`, { route: 'vm' });
    expect(r.route).toBe('vm');
    expect(r.stdout).not.toContain('WROTE');
    expect(r.exitCode).not.toBe(0);
    expect(readFileSync(path, 'utf8')).toBe(before);
  });

  it('runs as an unprivileged uid under seccomp, and sees none of the broker environment', async () => {
    const r = await sb.run('id -u; grep -E "^(Seccomp|CapEff):" /proc/self/status; cat /proc/[0-9]*/environ 2>/dev/null | tr "\\0" "\\n"; ls /proc | grep -c "^[0-9]"', { route: 'vm' });
    expect(r.stdout.split('\n')[0]).toBe('1000');
    expect(r.stdout).toMatch(/^Seccomp:\s+2$/m); // filter mode
    expect(r.stdout).toMatch(/^CapEff:\s+0+$/m);
    expect(r.stdout).not.toContain(secret);
    expect(r.stdout).not.toContain(b.token);
  });

  it('kills every process of a call when it ends, setsid children included', async () => {
    const marker = 40000 + (process.pid % 20000);
    const r = await sb.run(`setsid sleep ${marker} < /dev/null > /dev/null 2>&1 & echo started`, { route: 'vm' });
    expect(r.stdout).toBe('started\n');
    const left = execFileSync('ps', ['-eo', 'args'], { encoding: 'utf8' }).split('\n').filter((l) => l.trim() === `sleep ${marker}`);
    expect(left).toEqual([]);
  });

  it('keeps HOME between calls, as a VM would while it lives', async () => {
    await sb.run('echo remembered > ~/note', { route: 'vm' });
    expect((await sb.run('cat ~/note', { route: 'vm' })).stdout).toBe('remembered\n');
  });
});
