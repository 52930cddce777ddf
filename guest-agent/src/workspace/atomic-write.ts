import { closeSync, constants, fchmodSync, fchownSync, futimesSync, fsyncSync, openSync, writeSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { assertProcfs, at, openFileAt, renameAt, unlinkAt } from './fd-path.ts';

export interface AtomicWriteOptions {
  mode: number;
  /** Owner for a file that is created (the tenant user in the guest); kept when replacing. */
  owner?: { uid: number; gid: number } | undefined;
  mtimeMs?: number | undefined;
  /** fsync before rename; the host-side workspace is the source of truth and asks for it. */
  durable?: boolean;
}

/** A directory entry addressed through a held directory fd (see fd-path.ts). */
export interface AtTarget {
  dirFd: number;
  name: Uint8Array;
}

/**
 * Writes a file so that readers see either the old content or the new, never a mix:
 * a temp file in the same directory, then rename over the target. On any failure (a full
 * disk included) the temp file is removed and the target is untouched.
 *
 * Give the target as a held directory + name (race-free: the temp file is created with
 * O_EXCL|O_NOFOLLOW in that directory and renamed within it, and rename never follows the
 * final name), or as a host path, whose directory is then opened by path first.
 */
export async function writeFileAtomic(
  target: string | Buffer | AtTarget,
  data: Uint8Array | AsyncIterable<Uint8Array>,
  opts: AtomicWriteOptions,
): Promise<number> {
  if (typeof target !== 'string' && !Buffer.isBuffer(target)) return writeAt(target.dirFd, Buffer.from(target.name), data, opts);
  assertProcfs();
  const abs = Buffer.from(target);
  const slash = abs.lastIndexOf(0x2f);
  const dirFd = openSync(slash <= 0 ? '/' : abs.subarray(0, slash), constants.O_RDONLY | constants.O_DIRECTORY);
  try {
    return await writeAt(dirFd, abs.subarray(slash + 1), data, opts);
  } finally {
    closeSync(dirFd);
  }
}

async function writeAt(dirFd: number, name: Buffer, data: Uint8Array | AsyncIterable<Uint8Array>, opts: AtomicWriteOptions): Promise<number> {
  const tmp = Buffer.concat([Buffer.from('.'), name.subarray(0, 64), Buffer.from(`.hutch-${randomBytes(6).toString('hex')}.tmp`)]);
  // O_EXCL|O_NOFOLLOW: never write through something planted at the temp name.
  const fh = await openFileAt(dirFd, tmp, constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL, opts.mode & 0o7777);
  let written = 0;
  try {
    if (data instanceof Uint8Array) {
      await fh.writeFile(data);
      written = data.length;
    } else {
      for await (const chunk of data) {
        await fh.write(chunk);
        written += chunk.length;
      }
    }
    // umask applied to the open() mode; chmod sets exactly what was asked.
    await fh.chmod(opts.mode & 0o7777);
    if (opts.owner) await fh.chown(opts.owner.uid, opts.owner.gid);
    if (opts.mtimeMs !== undefined) await fh.utimes(new Date(), new Date(opts.mtimeMs));
    if (opts.durable) await fh.sync();
    await fh.close();
    renameAt(dirFd, tmp, dirFd, name);
    return written;
  } catch (err) {
    await fh.close().catch(() => undefined);
    try {
      unlinkAt(dirFd, tmp);
    } catch {
      // never created or already gone
    }
    throw err;
  }
}

/**
 * writeFileAtomic for bytes already in memory, with synchronous calls (the same temp file,
 * O_EXCL|O_NOFOLLOW, rename within the held directory). A workspace push writes many small
 * files: six thread-pool round trips each cost more than the writes themselves, and far
 * more in a guest under TCG just after a restore.
 */
export function writeFileAtomicSyncAt(target: AtTarget, data: Uint8Array, opts: AtomicWriteOptions): number {
  const name = Buffer.from(target.name);
  const tmp = tempName(name);
  const fd = openSync(at(target.dirFd, tmp), constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL | constants.O_NOFOLLOW, opts.mode & 0o7777);
  let open = true;
  try {
    for (let off = 0; off < data.length; ) off += writeSync(fd, data, off, data.length - off);
    fchmodSync(fd, opts.mode & 0o7777);
    if (opts.owner) fchownSync(fd, opts.owner.uid, opts.owner.gid);
    if (opts.mtimeMs !== undefined) futimesSync(fd, new Date(), new Date(opts.mtimeMs));
    if (opts.durable) fsyncSync(fd);
    open = false;
    closeSync(fd);
    renameAt(target.dirFd, tmp, target.dirFd, name);
    return data.length;
  } catch (err) {
    // Closed once only: the number may already belong to another file (the thread pool opens concurrently).
    try {
      if (open) closeSync(fd);
    } catch {
      // the error that matters is the first one
    }
    try {
      unlinkAt(target.dirFd, tmp);
    } catch {
      // never created, or already gone
    }
    throw err;
  }
}

function tempName(name: Buffer): Buffer {
  return Buffer.concat([Buffer.from('.'), name.subarray(0, 64), Buffer.from(`.hutch-${randomBytes(6).toString('hex')}.tmp`)]);
}

/** True for names this module creates, so walkers and sync can ignore in-flight temp files. */
export function isAtomicTempName(name: string): boolean {
  return name.startsWith('.') && name.endsWith('.tmp') && name.includes('.hutch-');
}
