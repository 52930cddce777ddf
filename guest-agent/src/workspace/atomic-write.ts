import { constants, promises as fsp } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { basename, dirname } from 'node:path';

export interface AtomicWriteOptions {
  mode: number;
  /** Owner for a file that is created (the tenant user in the guest); kept when replacing. */
  owner?: { uid: number; gid: number } | undefined;
  mtimeMs?: number | undefined;
  /** fsync before rename; the host-side workspace is the source of truth and asks for it. */
  durable?: boolean;
}

/**
 * Writes a file so that readers see either the old content or the new, never a mix:
 * a temp file in the same directory, then rename over the target. On any failure (a full
 * disk included) the temp file is removed and the target is untouched.
 */
export async function writeFileAtomic(
  abs: string,
  data: Uint8Array | AsyncIterable<Uint8Array>,
  opts: AtomicWriteOptions,
): Promise<number> {
  const tmp = `${dirname(abs)}/.${basename(abs).slice(0, 64)}.hutch-${randomBytes(6).toString('hex')}.tmp`;
  // O_EXCL|O_NOFOLLOW: never write through something planted at the temp name.
  const fh = await fsp.open(tmp, constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL | constants.O_NOFOLLOW, opts.mode & 0o7777);
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
    await fsp.rename(tmp, abs);
    return written;
  } catch (err) {
    await fh.close().catch(() => undefined);
    await fsp.rm(tmp, { force: true }).catch(() => undefined);
    throw err;
  }
}

/** True for names this module creates, so walkers and sync can ignore in-flight temp files. */
export function isAtomicTempName(name: string): boolean {
  return name.startsWith('.') && name.endsWith('.tmp') && name.includes('.hutch-');
}
