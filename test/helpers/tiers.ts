/**
 * Test tiers. Tests that boot QEMU microVMs carry the `vm` tag (`describe(name, { tags:
 * ['vm'] }, ...)`); everything else needs only this host (bubblewrap, real processes and
 * sockets). `npm run test:host` sets HUTCH_SKIP_GUEST=1 and skips the `vm` tier; a machine
 * that cannot run VMs skips it too, and the summary says how many tests and why.
 */
import { execFileSync } from 'node:child_process';

/** Why `vm`-tagged tests cannot run here, or undefined when they can. */
export function vmSkipReason(env: NodeJS.ProcessEnv = process.env): string | undefined {
  if (env['HUTCH_SKIP_GUEST'] === '1') return 'HUTCH_SKIP_GUEST=1 (host-only tier: microVM tests left out)';
  if (process.platform !== 'linux') return `microVMs need Linux (this is ${process.platform})`;
  if (process.getuid?.() !== 0) return 'building the guest image needs root (debootstrap, chroot)';
  try {
    execFileSync('qemu-system-x86_64', ['--version'], { stdio: 'ignore' });
  } catch {
    return 'qemu-system-x86_64 is not installed (./hutch setup installs it)';
  }
  return undefined;
}

/**
 * Why `scale`-tagged tests (a 100,000-file change set: minutes on two cores) are left out,
 * or undefined: `npm test` runs them, `npm run test:host` (HUTCH_SKIP_SCALE=1) does not.
 */
export function scaleSkipReason(env: NodeJS.ProcessEnv = process.env): string | undefined {
  return env['HUTCH_SKIP_SCALE'] === '1' ? 'HUTCH_SKIP_SCALE=1 (quick host tier: scale tests run in npm test)' : undefined;
}
