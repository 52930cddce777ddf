/**
 * deploy/systemd/hutch.service: systemd reads it without a complaint (`systemd-analyze
 * verify`, offline: unknown keys, bad values and missing executables are reported), it
 * runs only commands and options the CLI has, and its hardening is the set that fits a root
 * daemon running QEMU, bubblewrap and cgroups: on where it costs nothing, off where it
 * would break them. (No systemd runs as PID 1 here, so the unit is not started.)
 */
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';

const repo = resolve(import.meta.dirname, '..');
const unit = readFileSync(join(repo, 'deploy/systemd/hutch.service'), 'utf8');
const work = mkdtempSync(join(tmpdir(), 'hutch-systemd-'));
afterAll(() => rmSync(work, { recursive: true, force: true }));

const analyze = spawnSync('systemd-analyze', ['--version'], { encoding: 'utf8' });
const noAnalyze = analyze.error || analyze.status !== 0 ? 'systemd-analyze is not installed' : undefined;

/** `systemd-analyze verify` of a unit's text (the clone at /opt/hutch replaced by this one). */
function verify(name: string, text: string): { status: number | null; stderr: string } {
  const file = join(work, name);
  writeFileSync(file, text.replaceAll('/opt/hutch/hutch', join(repo, 'hutch')));
  const r = spawnSync('systemd-analyze', ['verify', '--man=no', file], { encoding: 'utf8' });
  return { status: r.status, stderr: r.stderr.trim() };
}

const setting = (key: string) => [...unit.matchAll(new RegExp(`^${key}=(.*)$`, 'gm'))].map((m) => m[1]);

describe('the systemd unit', () => {
  it.skipIf(noAnalyze)('systemd-analyze verify reads it without a complaint, and does complain about a bad one', () => {
    expect(verify('hutch.service', unit)).toEqual({ status: 0, stderr: '' });
    expect(verify('typo.service', unit.replace('ProtectHome=yes', 'ProtectHomes=yes')).stderr).toMatch(/Unknown key 'ProtectHomes'/);
  });

  it('hardens what a root daemon running QEMU, bubblewrap and cgroups can do without', () => {
    for (const [key, value] of [
      ['NoNewPrivileges', 'yes'],
      ['ProtectSystem', 'strict'],
      ['ProtectHome', 'yes'],
      ['PrivateTmp', 'yes'],
      ['DevicePolicy', 'closed'],
      ['DeviceAllow', '/dev/kvm rw'],
      ['ProtectKernelModules', 'yes'],
      ['ProtectKernelLogs', 'yes'],
      ['ProtectClock', 'yes'],
      ['LockPersonality', 'yes'],
      ['RestrictRealtime', 'yes'],
      ['SystemCallArchitectures', 'native'],
      ['Delegate', 'yes'],
      ['KillMode', 'mixed'],
    ]) {
      expect(setting(key as string), key).toEqual([value]);
    }
    expect(setting('RestrictAddressFamilies')[0]?.split(' ').sort()).toEqual(['AF_INET', 'AF_INET6', 'AF_NETLINK', 'AF_UNIX']);
    // What would break it: namespaces (bubblewrap, QEMU's jail), cgroups, other users' /proc
    // (each QEMU's own uid), W^X memory (V8, TCG), setuid files (debootstrap), /dev/kvm.
    for (const key of ['PrivateUsers', 'PrivateNetwork', 'RestrictNamespaces', 'ProtectControlGroups', 'ProtectKernelTunables', 'ProtectProc', 'MemoryDenyWriteExecute', 'RestrictSUIDSGID', 'PrivateDevices', 'User', 'DynamicUser']) {
      expect(setting(key), key).toEqual([]);
    }
    // The token comes as a credential, never on the command line.
    expect(setting('LoadCredential')).toEqual(['token:/etc/hutch/token']);
    expect(setting('ExecStart')[0]).toContain('--token-file ${CREDENTIALS_DIRECTORY}/token');
    expect(setting('ExecStart')[0]).not.toMatch(/--token /);
    // The stop timeout outlasts the drain (serve's default --drain-ms, 60 s).
    expect(Number(setting('TimeoutStopSec')[0])).toBeGreaterThan(60);
  });

  it('runs only commands and options the hutch CLI has', () => {
    for (const line of [...setting('ExecStartPre'), ...setting('ExecStart')]) {
      const [bin, sub, ...args] = (line as string).split(/\s+/);
      expect(bin).toBe('/opt/hutch/hutch');
      const help = spawnSync(process.execPath, ['--import', 'tsx', 'host-broker/src/cli.ts', sub as string, '--help'], { cwd: repo, encoding: 'utf8' }).stdout;
      expect(help, line).toMatch(new RegExp(`^usage: hutch ${sub} `));
      for (const a of args) if (a.startsWith('--')) expect(help, `${line}: ${a}`).toContain(`${a.split('=')[0]} `);
    }
  });
});
