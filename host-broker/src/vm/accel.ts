import { existsSync, mkdirSync, readFileSync, writeFileSync, accessSync, constants } from 'node:fs';
import { release } from 'node:os';
import { join } from 'node:path';
import { spawn } from 'node:child_process';
import type { Logger } from '../../../guest-agent/src/log.ts';
import type { Accel } from './vmm.ts';

export interface AccelChoice {
  accel: Accel;
  /** Why: which probe decided. */
  reason: string;
}

/**
 * Finds out whether KVM really runs our guest, by booting it: some hosts have a /dev/kvm
 * that stock guests hang on (a PVM hypervisor), so the device existing proves nothing.
 * The probe boots the kernel with no root and waits for its "unable to mount root"
 * panic; reaching it means the kernel ran through start-up under KVM. The answer is
 * cached per host kernel.
 */
export async function chooseAccel(kernel: string, opts: { cacheDir: string; log: Logger; timeoutMs?: number; force?: Accel }): Promise<AccelChoice> {
  if (opts.force) return { accel: opts.force, reason: `forced by configuration` };
  if (!existsSync('/dev/kvm')) return { accel: 'tcg', reason: 'no /dev/kvm on this host' };
  try {
    accessSync('/dev/kvm', constants.R_OK | constants.W_OK);
  } catch {
    return { accel: 'tcg', reason: '/dev/kvm is not accessible' };
  }
  const cacheFile = join(opts.cacheDir, `accel-${release()}.json`);
  if (existsSync(cacheFile)) {
    try {
      const c = JSON.parse(readFileSync(cacheFile, 'utf8')) as AccelChoice & { kernel: string };
      if (c.kernel === kernel) return { accel: c.accel, reason: `${c.reason} (cached)` };
    } catch {
      // re-probe
    }
  }
  const timeoutMs = opts.timeoutMs ?? 20_000;
  const ok = await probeBoot(kernel, timeoutMs);
  const choice: AccelChoice = ok.booted
    ? { accel: 'kvm', reason: `a KVM probe boot reached the kernel's root-mount stage in ${ok.ms} ms` }
    : { accel: 'tcg', reason: `a KVM probe boot did not reach the root-mount stage within ${timeoutMs} ms (${ok.detail})` };
  opts.log.info('accel.probe', { ...choice });
  mkdirSync(opts.cacheDir, { recursive: true });
  writeFileSync(cacheFile, JSON.stringify({ ...choice, kernel }));
  return choice;
}

async function probeBoot(kernel: string, timeoutMs: number): Promise<{ booted: boolean; ms: number; detail: string }> {
  const t0 = Date.now();
  const q = spawn('qemu-system-x86_64', [
    '-M', 'microvm', '-accel', 'kvm', '-cpu', 'host', '-m', '128', '-nodefaults', '-no-user-config', '-nographic', '-no-reboot',
    '-serial', 'stdio', '-kernel', kernel, '-append', 'console=ttyS0 panic=-1 root=/dev/nonexistent',
  ], { stdio: ['ignore', 'pipe', 'pipe'] });
  let out = '';
  return new Promise((resolve) => {
    const done = (booted: boolean, detail: string) => {
      clearTimeout(timer);
      q.kill('SIGKILL');
      resolve({ booted, ms: Date.now() - t0, detail });
    };
    const timer = setTimeout(() => done(false, 'timed out'), timeoutMs);
    const onData = (d: Buffer) => {
      out += d.toString();
      if (/VFS: Unable to mount root|Kernel panic|No working init/.test(out)) done(true, 'reached root mount');
      else {
        // The error line itself: QEMU prints a register dump after it, which says nothing to an operator.
        const kvmError = out.split('\n').find((l) => /KVM internal error|failed to initialize kvm|Could not access KVM/i.test(l));
        if (kvmError) done(false, kvmError.trim().slice(0, 200));
      }
    };
    q.stdout.on('data', onData);
    q.stderr.on('data', onData);
    q.once('exit', () => done(/VFS: Unable to mount root|Kernel panic/.test(out), 'qemu exited'));
  });
}
