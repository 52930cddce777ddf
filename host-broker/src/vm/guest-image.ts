import { createHash } from 'node:crypto';
import { readFileSync, statSync } from 'node:fs';
import { ensureKernel } from '../../../kernel-configs/build.ts';
import { ensureDebianKernel } from '../../../kernel-configs/debian-kernel.ts';
import { ensureRootfs } from '../../../rootfs/build.ts';
import type { GuestImage } from './vmm.ts';

export type KernelChoice = 'hutch' | 'debian';

export interface ResolvedGuestImage extends GuestImage {
  /** Identity of kernel + rootfs (+ agent, baked into the rootfs) for snapshot cache keys. */
  key: string;
  describe: string;
  /** Seconds spent building in this call (0 when taken from the cache). */
  built: { kernelSeconds: number; rootfsSeconds: number };
}

/**
 * The guest kernel and rootfs, built (or taken from ~/.cache/hutch) on demand. `hutch`
 * is our own kernel (drivers built in, idle page tracking, PVH entry); `debian` is the
 * packaged kernel with a generated initramfs, lacking idle page tracking.
 */
export async function ensureGuestImage(opts: { kernel?: KernelChoice; log?: (m: string) => void; noBuild?: boolean } = {}): Promise<ResolvedGuestImage> {
  const log = opts.log ?? ((m: string) => process.stderr.write(`[guest] ${m}\n`));
  // --no-build: each builder answers a cache miss with `unavailable` instead of building.
  const cachedOnly = opts.noBuild ? { cachedOnly: true } : {};
  const rootfs = await ensureRootfs({ log, ...cachedOnly });
  if ((opts.kernel ?? 'hutch') === 'debian') {
    const d = await ensureDebianKernel({ log, ...cachedOnly });
    return {
      kernel: d.vmlinuz,
      initrd: d.initrd,
      flavor: 'debian',
      rootfs: rootfs.image,
      key: hash(['debian', fileId(d.vmlinuz), fileId(d.initrd), rootfs.imageSha256]),
      describe: `Debian ${d.kernelRelease} + initramfs, rootfs ${rootfs.hash.slice(0, 12)}`,
      built: { kernelSeconds: 0, rootfsSeconds: rootfs.cached ? 0 : rootfs.buildSeconds },
    };
  }
  const k = await ensureKernel({ log, ...cachedOnly });
  return {
    kernel: k.vmlinux,
    flavor: 'hutch',
    rootfs: rootfs.image,
    key: hash(['hutch', k.info.hash, rootfs.imageSha256]),
    describe: `hutch kernel ${k.info.hash.slice(0, 12)} (${k.info.sourceVersion}), rootfs ${rootfs.hash.slice(0, 12)}`,
    built: { kernelSeconds: k.cached ? 0 : k.info.totalSeconds, rootfsSeconds: rootfs.cached ? 0 : rootfs.buildSeconds },
  };
}

function fileId(p: string): string {
  const st = statSync(p);
  return createHash('sha256').update(readFileSync(p)).update(String(st.size)).digest('hex');
}

function hash(parts: string[]): string {
  return createHash('sha256').update(parts.join('\0')).digest('hex').slice(0, 24);
}
