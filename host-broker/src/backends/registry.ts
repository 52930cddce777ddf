import { execFileSync } from 'node:child_process';
import { cacheRoot } from '../../../build/cache.ts';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import type { VmBackend } from './backend.ts';
import { LocalBackend } from './local-backend.ts';
import { QemuBackend } from './qemu-backend.ts';
import type { KernelChoice } from '../vm/guest-image.ts';

export const BACKEND_NAMES = ['qemu', 'local'] as const;

export interface BackendDeps {
  log: Logger;
  dataDir: string;
  /** ~/.cache/hutch: kernel, rootfs, snapshots (env HUTCH_CACHE). */
  cacheDir?: string;
  kernel?: KernelChoice;
  /** Use the cached guest image only: a missing one is an `unavailable` error, not a build. */
  noBuild?: boolean;
}

/** ~/.cache/hutch (or $HUTCH_CACHE): kernel, rootfs, snapshots. */
export function cacheDir(): string {
  return cacheRoot();
}

/** True when QEMU is installed; the guest image is built on first use. */
export function qemuAvailable(): boolean {
  try {
    execFileSync('qemu-system-x86_64', ['--version'], { stdio: 'ignore' });
    return true;
  } catch {
    return false;
  }
}

/** Picks the VM backend by name; without a name, qemu where QEMU is installed, else local (loudly). */
export async function createBackend(name: string | undefined, deps: BackendDeps): Promise<VmBackend> {
  const n = name ?? (qemuAvailable() ? 'qemu' : 'local');
  switch (n) {
    case 'qemu':
      if (!qemuAvailable()) throw new HutchError('unavailable', 'the qemu backend needs qemu-system-x86_64 (./hutch setup installs it)');
      return QemuBackend.create({ dataDir: deps.dataDir, cacheDir: deps.cacheDir ?? cacheDir(), log: deps.log, ...(deps.kernel ? { kernel: deps.kernel } : {}), ...(deps.noBuild ? { noBuild: true } : {}) });
    case 'local':
      deps.log.warn('backend.local', { note: 'the local backend is not isolation-equivalent to a microVM', chosen: name ? 'by request' : 'QEMU is not installed' });
      return new LocalBackend(deps.log);
    default:
      throw new HutchError('bad_request', `unknown backend ${n}; choose one of ${BACKEND_NAMES.join(', ')}`);
  }
}
