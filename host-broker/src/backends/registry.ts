import { execFileSync } from 'node:child_process';
import { cacheRoot } from '../../../build/cache.ts';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import type { VmBackend } from './backend.ts';
import { UnsafeLocalBackend } from './local-backend.ts';
import type { FastPath } from '../fastpath/index.ts';
import { QemuBackend } from './qemu-backend.ts';
import type { KernelChoice } from '../vm/guest-image.ts';
import { BACKEND_NAMES, UNSAFE_LOCAL_ACK_FLAG } from './names.ts';

export { BACKEND_NAMES, UNSAFE_LOCAL_ACK_FLAG };

export interface BackendDeps {
  log: Logger;
  dataDir: string;
  /** ~/.cache/hutch: kernel, rootfs, snapshots (env HUTCH_CACHE). */
  cacheDir?: string;
  kernel?: KernelChoice;
  /** Use the cached guest image only: a missing one is an `unavailable` error, not a build. */
  noBuild?: boolean;
  /** qemu: standby VMs kept warm for the next wake (QemuBackendOptions.standby). */
  standby?: number;
  /**
   * The operator's explicit acknowledgement that `unsafe-local` shares the host kernel
   * (the CLI's --i-know-unsafe-local); without it that backend refuses to start.
   */
  acknowledgeUnsafeLocal?: boolean;
  /** unsafe-local runs tenant commands through the fast path's sandbox (required for it). */
  fastPath?: FastPath;
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

/**
 * Picks the VM backend by name; without a name, qemu. A weaker backend is never chosen
 * implicitly: a host without QEMU gets an error saying what to install or how to opt in.
 */
export async function createBackend(name: string | undefined, deps: BackendDeps): Promise<VmBackend> {
  const n = name ?? 'qemu';
  switch (n) {
    case 'qemu':
      if (!qemuAvailable()) {
        throw new HutchError(
          'unavailable',
          'the qemu backend needs qemu-system-x86_64, which is not installed: run ./hutch setup (or apt-get install qemu-system-x86). ' +
            `For development only, --backend unsafe-local ${UNSAFE_LOCAL_ACK_FLAG} runs tenant commands on the host kernel in a bubblewrap sandbox instead.`,
        );
      }
      return QemuBackend.create({ dataDir: deps.dataDir, cacheDir: deps.cacheDir ?? cacheDir(), log: deps.log, ...(deps.kernel ? { kernel: deps.kernel } : {}), ...(deps.noBuild ? { noBuild: true } : {}), ...(deps.standby !== undefined ? { standby: deps.standby } : {}) });
    case 'unsafe-local':
      if (!deps.acknowledgeUnsafeLocal) {
        throw new HutchError(
          'bad_request',
          `the unsafe-local backend runs tenants on the host kernel (no VM boundary); start it only with ${UNSAFE_LOCAL_ACK_FLAG} to acknowledge that`,
        );
      }
      if (!deps.fastPath) throw new HutchError('internal', 'unsafe-local needs the fast path (createBackend deps.fastPath)');
      deps.log.warn('backend.unsafe_local', { note: 'tenant commands share the host kernel: a kernel bug is a host compromise; use qemu for untrusted tenants' });
      return new UnsafeLocalBackend(deps.fastPath, deps.log);
    case 'local':
      throw new HutchError('bad_request', `the local backend is now called unsafe-local and needs ${UNSAFE_LOCAL_ACK_FLAG}`);
    default:
      throw new HutchError('bad_request', `unknown backend ${n}; choose one of ${BACKEND_NAMES.join(', ')}`);
  }
}
