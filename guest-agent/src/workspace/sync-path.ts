import { chownSync, closeSync, constants, fstatSync, openSync, readSync } from 'node:fs';
import { HutchError } from '../protocol/errors.ts';
import { assertProcfs, at, closeQuietly, lstatAt, mkdirAt, openDirAt } from './fd-path.ts';
import { nameFromBytes } from './names.ts';

/**
 * Paths of the workspace sync, in bytes. Sync paths differ from tenant paths (confine.ts):
 * they name an entry exactly as the other side's scan found it, so they are never
 * resolved through symlinks at all (a symlink where a parent directory should be is an
 * error, not something to follow), and they are bytes, since a name need not be UTF-8.
 * Both ends (the agent applying a push, the broker applying a pull) act on an entry
 * through its parent directory's fd (fd-path.ts), opened component by component with
 * O_NOFOLLOW, so nothing that changes the tree meanwhile can redirect a sync write.
 */

const SLASH = 0x2f;
const DOT = 0x2e;
/** Longest file name component Linux file systems take (NAME_MAX). */
export const NAME_MAX_BYTES = 255;

/** Splits a workspace-relative sync path into its components, refusing anything that could leave the root. */
export function splitSyncPath(p: Uint8Array): Buffer[] {
  const b = Buffer.from(p.buffer, p.byteOffset, p.byteLength);
  const shown = nameFromBytes(b);
  if (b.length === 0) throw new HutchError('bad_request', 'empty sync path');
  if (b.includes(0)) throw new HutchError('bad_request', 'sync path contains a NUL byte', { path: shown });
  if (b[0] === SLASH) throw new HutchError('outside_workspace', `sync path ${shown} is absolute`, { path: shown });
  const parts: Buffer[] = [];
  let start = 0;
  for (let i = 0; i <= b.length; i++) {
    if (i < b.length && b[i] !== SLASH) continue;
    const c = b.subarray(start, i);
    start = i + 1;
    if (c.length === 0 || (c.length === 1 && c[0] === DOT)) throw new HutchError('bad_request', `sync path ${shown} is not normalised`, { path: shown });
    if (c.length === 2 && c[0] === DOT && c[1] === DOT) throw new HutchError('outside_workspace', `sync path ${shown} contains ..`, { path: shown });
    if (c.length > NAME_MAX_BYTES) throw new HutchError('invalid_name', `a name in ${shown} is ${c.length} bytes, above the ${NAME_MAX_BYTES} a file system takes`, { path: shown });
    parts.push(c);
  }
  return parts;
}

/** Opens a workspace root to act under it; close with closeQuietly. */
export function openSyncRoot(root: string | Buffer): number {
  assertProcfs();
  return openSync(root, constants.O_RDONLY | constants.O_DIRECTORY);
}

/**
 * Opens the directory that holds the entry `parts` names, one component at a time and
 * never through a symlink. With `create`, missing parents are made (0755, owned by
 * `owner`) and a symlink or file in a parent position is a typed error; without it the
 * answer is undefined when the entry cannot exist as named (nothing to delete or read).
 * The caller closes the returned fd.
 */
export function openSyncParent(rootFd: number, parts: readonly Buffer[], create?: { owner?: { uid: number; gid: number } | undefined }): number | undefined {
  const shown = () => nameFromBytes(Buffer.concat(parts.flatMap((p, i) => (i ? [Buffer.from('/'), p] : [p]))));
  let fd = rootFd;
  try {
    for (let i = 0; i < parts.length - 1; i++) {
      const name = parts[i] as Buffer;
      const st = lstatAt(fd, name);
      if (!st) {
        if (!create) return closeAndUndefined(fd, rootFd);
        mkdirAt(fd, name, 0o755);
        if (create.owner) chownSync(at(fd, name), create.owner.uid, create.owner.gid);
      } else if (!st.isDirectory()) {
        if (!create) return closeAndUndefined(fd, rootFd);
        if (st.isSymbolicLink()) throw new HutchError('outside_workspace', `${shown()}: ${nameFromBytes(name)} is a symlink; sync never follows one`, { path: shown() });
        throw new HutchError('not_a_directory', `${shown()}: ${nameFromBytes(name)} is not a directory`, { path: shown() });
      }
      // O_NOFOLLOW: if the entry became a symlink since the lstat, this fails instead of following it.
      const next = openDirAt(fd, name);
      if (fd !== rootFd) closeQuietly(fd);
      fd = next;
    }
    return fd;
  } catch (err) {
    if (fd !== rootFd) closeQuietly(fd);
    throw err;
  }
}

function closeAndUndefined(fd: number, rootFd: number): undefined {
  if (fd !== rootFd) closeQuietly(fd);
  return undefined;
}

/** Closes a parent fd from openSyncParent (the root fd itself stays open). */
export function closeSyncParent(fd: number, rootFd: number): void {
  if (fd !== rootFd) closeQuietly(fd);
}

/**
 * Keeps the parent directory fd of the last entry open, so a pass over entries sorted
 * parents first (a change set) opens each directory once instead of once per entry.
 */
export class SyncParentCache {
  private key: Buffer | undefined;
  private fd: number | undefined;

  constructor(private readonly rootFd: number) {}

  /** The parent fd of `parts` (owned by the cache: do not close), or undefined when it cannot exist as named. */
  get(parts: readonly Buffer[], create?: { owner?: { uid: number; gid: number } | undefined }): number | undefined {
    const key = parentKey(parts);
    if (this.key && this.key.equals(key) && this.fd !== undefined) return this.fd;
    // Below the cached directory (a batch sorted parents first going down a branch): go on
    // from it rather than from the root, or a chain of N directories costs N^2 opens.
    if (this.key && this.fd !== undefined && this.fd !== this.rootFd && key.length > this.key.length && key.subarray(0, this.key.length).equals(this.key)) {
      const depth = countSlashes(this.key);
      const from = this.fd;
      const fd = openSyncParent(from, parts.slice(depth), create);
      if (fd === undefined) return undefined;
      if (fd !== from) closeSyncParent(from, this.rootFd);
      this.key = key;
      this.fd = fd;
      return fd;
    }
    this.close();
    const fd = openSyncParent(this.rootFd, parts, create);
    if (fd === undefined) return undefined;
    this.key = key;
    this.fd = fd;
    return fd;
  }

  close(): void {
    if (this.fd !== undefined) closeSyncParent(this.fd, this.rootFd);
    this.fd = undefined;
    this.key = undefined;
  }
}

/**
 * A regular file's whole content if it is at most `max` bytes, read with a few synchronous
 * syscalls (a sync may carry 100,000 small files); undefined when it vanished, is not a
 * regular file or is larger. Never follows a final symlink or blocks on a FIFO.
 */
export function readSmallFile(path: Buffer, max: number): Buffer | undefined {
  let fd: number;
  try {
    fd = openSync(path, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK);
  } catch {
    return undefined;
  }
  try {
    const st = fstatSync(fd);
    if (!st.isFile() || st.size > max) return undefined;
    const buf = Buffer.allocUnsafe(st.size);
    for (let off = 0; off < buf.length; ) {
      const n = readSync(fd, buf, off, buf.length - off, off);
      if (n === 0) return buf.subarray(0, off); // shrank while read
      off += n;
    }
    return buf;
  } finally {
    closeSync(fd);
  }
}

function countSlashes(b: Buffer): number {
  let n = 0;
  for (let i = b.indexOf(0x2f); i !== -1; i = b.indexOf(0x2f, i + 1)) n++;
  return n;
}

/** `a/b/` for `a/b/c`, in one allocation (a deep path has thousands of parts). */
function parentKey(parts: readonly Buffer[]): Buffer {
  let n = 0;
  for (let i = 0; i < parts.length - 1; i++) n += (parts[i] as Buffer).length + 1;
  const key = Buffer.allocUnsafe(n);
  let off = 0;
  for (let i = 0; i < parts.length - 1; i++) {
    off += (parts[i] as Buffer).copy(key, off);
    key[off++] = 0x2f;
  }
  return key;
}
