import { execFile } from 'node:child_process';
import { createHash } from 'node:crypto';
import { readFile } from 'node:fs/promises';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';

/**
 * Native helpers the agent spawns in the guest, built with the host's gcc as static
 * binaries (the guest image has no toolchain, and a static binary does not care which
 * glibc the guest's Debian ships). rootfs/image.ts bakes them into /opt/hutch.
 */
const here = dirname(fileURLToPath(import.meta.url));

export interface NativeHelper {
  /** Built binary on the host. */
  path: string;
  /** Path inside the guest root, relative (what the image stages). */
  dest: string;
  sha256: string;
}

/** hutch-madvise: process_madvise(2) for prefetch on wake (guest-agent/src/memory/prefetch.ts). */
export const MADVISE_HELPER_IN_GUEST = '/opt/hutch/hutch-madvise';

/** hutch-spawn: starts tenant commands inside the workload cgroup (guest-agent/src/process/exec-handler.ts). */
export const SPAWN_HELPER_IN_GUEST = '/opt/hutch/hutch-spawn';

/** hutch-resume: after a restore, reseeds the kernel CRNG and sets the clock (guest-agent/src/resume.ts). */
export const RESUME_HELPER_IN_GUEST = '/opt/hutch/hutch-resume';

const HELPERS = [
  { src: 'hutch-madvise.c', dest: MADVISE_HELPER_IN_GUEST },
  { src: 'hutch-spawn.c', dest: SPAWN_HELPER_IN_GUEST },
  { src: 'hutch-resume.c', dest: RESUME_HELPER_IN_GUEST },
];

export async function buildNativeHelpers(outDir: string): Promise<NativeHelper[]> {
  const out: NativeHelper[] = [];
  for (const h of HELPERS) {
    const src = resolve(here, h.src);
    const bin = join(outDir, h.src.replace(/\.c$/, ''));
    try {
      await promisify(execFile)('gcc', ['-O2', '-static', '-s', '-Wall', '-Wextra', '-Werror', '-o', bin, src]);
    } catch (err) {
      const e = err as { stderr?: string; message: string };
      throw new Error(`building ${src} failed (needs gcc and libc6-dev on the host): ${e.stderr || e.message}`);
    }
    const sha256 = createHash('sha256').update(await readFile(bin)).digest('hex');
    out.push({ path: bin, dest: h.dest.slice(1), sha256 });
  }
  return out;
}
