import { createHash } from 'node:crypto';
import { readFileSync, statSync } from 'node:fs';
import { ensureKernel } from '../../../kernel-configs/build.ts';
import { ensureDebianKernel } from '../../../kernel-configs/debian-kernel.ts';
import { ensureAgentLayer, ensureRootfs } from '../../../rootfs/build.ts';
import type { GuestImage } from './vmm.ts';

export type KernelChoice = 'hutch' | 'debian';

/** Which part of the image a build message is about (a progress display shows it). */
export type GuestPart = 'agent layer' | 'kernel' | 'root filesystem';
export type GuestBuildLog = (message: string, part?: GuestPart) => void;

export interface ResolvedGuestImage extends GuestImage {
  /** Identity of kernel + agent layer + template root, for snapshot cache keys. */
  key: string;
  describe: string;
  /** Seconds spent building in this call (0 when taken from the cache). */
  built: { kernelSeconds: number; rootfsSeconds: number };
  /** The kernel and agent layer, for the images of other templates. */
  base: GuestBase;
}

/** The guest's parts that do not depend on the template: the kernel and the agent layer. */
export interface GuestBase {
  kernel: string;
  initrd?: string;
  flavor: 'hutch' | 'debian';
  agentLayer: string;
  /** Identity of kernel + agent layer (the agent bundle is in the layer). */
  key: string;
  describe: string;
  built: { kernelSeconds: number; layerSeconds: number };
}

/**
 * The kernel and the agent layer, built (or taken from ~/.cache/hutch) on demand. `hutch`
 * is our own kernel (drivers built in, idle page tracking, PVH entry); `debian` is the
 * packaged kernel with a generated initramfs, lacking idle page tracking.
 */
export async function ensureGuestBase(opts: { kernel?: KernelChoice; log?: GuestBuildLog; noBuild?: boolean } = {}): Promise<GuestBase> {
  const to = opts.log ?? ((m: string) => process.stderr.write(`[guest] ${m}\n`));
  const part = (p: GuestPart) => (m: string) => to(m, p);
  // --no-build: each builder answers a cache miss with `unavailable` instead of building.
  const cachedOnly = opts.noBuild ? { cachedOnly: true } : {};
  const layer = await ensureAgentLayer({ log: part('agent layer'), ...cachedOnly });
  const layerSeconds = layer.cached ? 0 : layer.buildSeconds;
  if ((opts.kernel ?? 'hutch') === 'debian') {
    const d = await ensureDebianKernel({ log: part('kernel'), ...cachedOnly });
    return {
      kernel: d.vmlinuz,
      initrd: d.initrd,
      flavor: 'debian',
      agentLayer: layer.image,
      key: hash(['debian', fileId(d.vmlinuz), fileId(d.initrd), layer.imageSha256]),
      describe: `Debian ${d.kernelRelease} + initramfs, agent layer ${layer.hash.slice(0, 12)}`,
      built: { kernelSeconds: 0, layerSeconds },
    };
  }
  const k = await ensureKernel({ log: part('kernel'), ...cachedOnly });
  return {
    kernel: k.vmlinux,
    flavor: 'hutch',
    agentLayer: layer.image,
    key: hash(['hutch', k.info.hash, layer.imageSha256]),
    describe: `hutch kernel ${k.info.hash.slice(0, 12)} (${k.info.sourceVersion}), agent layer ${layer.hash.slice(0, 12)}`,
    built: { kernelSeconds: k.cached ? 0 : k.info.totalSeconds, layerSeconds },
  };
}

/** A guest image: the kernel and agent layer with one template's root filesystem. */
export function withTemplateRoot(base: GuestBase, root: { rootfs: string; id: string; name: string; builtSeconds?: number }): ResolvedGuestImage {
  return {
    kernel: base.kernel,
    ...(base.initrd ? { initrd: base.initrd } : {}),
    flavor: base.flavor,
    agentLayer: base.agentLayer,
    rootfs: root.rootfs,
    key: hash([base.key, root.id]),
    describe: `${base.describe}, template ${root.name} (${root.id.slice(0, 12)})`,
    built: { kernelSeconds: base.built.kernelSeconds, rootfsSeconds: base.built.layerSeconds + (root.builtSeconds ?? 0) },
    base,
  };
}

/** The default template's image: the kernel, the agent layer and the Debian bookworm root. */
export async function ensureGuestImage(opts: { kernel?: KernelChoice; log?: GuestBuildLog; noBuild?: boolean } = {}): Promise<ResolvedGuestImage> {
  const log = opts.log ?? ((m: string) => process.stderr.write(`[guest] ${m}\n`));
  const base = await ensureGuestBase({ ...opts, log });
  const rootfs = await ensureRootfs({ log: (m) => log(m, 'root filesystem'), ...(opts.noBuild ? { cachedOnly: true } : {}) });
  return withTemplateRoot(base, { rootfs: rootfs.image, id: rootfs.imageSha256, name: 'default', builtSeconds: rootfs.cached ? 0 : rootfs.buildSeconds });
}

function fileId(p: string): string {
  const st = statSync(p);
  return createHash('sha256').update(readFileSync(p)).update(String(st.size)).digest('hex');
}

function hash(parts: string[]): string {
  return createHash('sha256').update(parts.join('\0')).digest('hex').slice(0, 24);
}
