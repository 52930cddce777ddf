import { execFile } from 'node:child_process';
import { closeSync, existsSync, ftruncateSync, openSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';

/** The swap disk's file name in a VM's run directory and in a snapshot slot. */
export const SWAP_FILE = 'swap.img';
/** Copying a swap disk is bounded: a slot write that cannot finish fails (the last good slot stays). */
const COPY_TIMEOUT_MS = 120_000;

/**
 * Each VM's swap disk: a sparse file of its own (costs no disk until the guest swaps).
 * A VM restored from a snapshot slot gets a copy of the disk saved with that slot, since
 * the slot's RAM stream does not carry block devices: pages its guest had swapped out
 * would otherwise read back as zeros.
 */
export async function createSwapDisk(vmDir: string, mib: number, from?: string): Promise<void> {
  const path = join(vmDir, SWAP_FILE);
  if (from !== undefined) {
    await copySparse(from, path);
    if (statSync(path).size !== mib * 1024 * 1024) throw new HutchError('unavailable', `the swap disk saved at ${from} is ${statSync(path).size} bytes, not the ${mib} MiB this VM's snapshot expects`, { from });
    return;
  }
  const fd = openSync(path, 'w');
  try {
    ftruncateSync(fd, mib * 1024 * 1024);
  } finally {
    closeSync(fd);
  }
}

/**
 * Saves a paused VM's swap disk beside its snapshot (sparse: only what the guest wrote
 * takes space). Returns the saved file, or undefined when the VM has none.
 */
export async function saveSwapDisk(vmDir: string, slotDir: string): Promise<{ path: string; bytes: number } | undefined> {
  const src = join(vmDir, SWAP_FILE);
  if (!existsSync(src)) return undefined;
  const dst = join(slotDir, SWAP_FILE);
  await copySparse(src, dst);
  return { path: dst, bytes: statSync(dst).blocks * 512 };
}

/** `cp --sparse=always`: holes stay holes (and a reflink where the filesystem has them). */
function copySparse(src: string, dst: string): Promise<void> {
  return new Promise((resolve, reject) => {
    execFile('cp', ['--sparse=always', '--reflink=auto', '--', src, dst], { timeout: COPY_TIMEOUT_MS }, (err, _out, stderr) => {
      if (err) reject(new HutchError('internal', `copying the swap disk ${src} to ${dst} failed: ${stderr.trim() || err.message}`, { src, dst }));
      else resolve();
    });
  });
}
