import { closeSync, constants, fstatSync, lstatSync, mkdirSync, openSync, promises as fsp, readFile, readdirSync, readlinkSync, readSync, renameSync, rmdirSync, statfsSync, unlinkSync, type Dirent, type Stats } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { promisify } from 'node:util';
import { HutchError } from '../protocol/errors.ts';
import { LoopSlicer } from './work-budget.ts';

/**
 * Operations relative to an open directory, the way openat(2), mkdirat(2), unlinkat(2)...
 * work, for a Node that has none of them.
 *
 * Every path handed to the kernel here is `/proc/self/fd/<dirfd>/<name>`: the kernel jumps
 * through the magic link straight to the directory the fd holds (wherever it now is, whatever
 * replaced its old path) and looks up the single component `name` there. `name` never holds
 * a `/` and is never `.` or `..`, and the calls that open it pass O_NOFOLLOW (or are calls
 * that do not follow a final symlink: lstat, readlink, mkdir, unlink, rmdir, rename), so
 * each is exactly openat(dirfd, name, O_NOFOLLOW...). Nothing a tenant does to the tree
 * between two calls can make one of them act outside the directory whose fd we hold.
 *
 * Why this and not the alternatives issue 12 named:
 * - openat2(RESOLVE_IN_ROOT) through a native helper needs a compiler and node-gyp at
 *   install time and a prebuilt .node for the guest's Node 18 ABI in a rootfs that has no
 *   toolchain; a helper process instead would add an IPC hop to every 4 KiB read.
 * - A mount namespace holding only the workspace needs a process per workspace (the
 *   broker serves many), and still leaves the in-namespace code open to the same swap race
 *   unless it too resolves by fds.
 * The magic-link walk costs one extra path lookup per component (~5 us) and runs in the
 * same process on any Linux with procfs, which we verify once (a bind-mounted or fake
 * /proc would silently make these paths mean something else).
 */

const PROC_SUPER_MAGIC = 0x9fa0;
let procChecked = false;

export function assertProcfs(): void {
  if (procChecked) return;
  let type: number;
  try {
    type = statfsSync('/proc').type;
  } catch (err) {
    throw new HutchError('unavailable', `/proc is not mounted (${(err as Error).message}); the file tools need procfs to resolve paths safely`);
  }
  if (type !== PROC_SUPER_MAGIC) {
    throw new HutchError('unavailable', `/proc is not procfs (filesystem type 0x${type.toString(16)}); the file tools need procfs to resolve paths safely`);
  }
  procChecked = true;
}

const SLASH = 0x2f;

/** The magic path naming `name` inside the directory `dirFd` (or the directory itself). */
export function at(dirFd: number, name?: Uint8Array): Buffer {
  const head = Buffer.from(`/proc/self/fd/${dirFd}${name ? '/' : ''}`, 'latin1');
  return name ? Buffer.concat([head, name]) : head;
}

/** True for a name that may be handed to at(): one component, not `.` or `..`. */
export function isPlainName(name: Uint8Array): boolean {
  if (name.length === 0 || name.includes(SLASH) || name.includes(0)) return false;
  return !(name[0] === 0x2e && (name.length === 1 || (name.length === 2 && name[1] === 0x2e)));
}

const O_DIR = constants.O_RDONLY | constants.O_DIRECTORY | constants.O_NOFOLLOW;

/** Opens a directory entry as a directory, never through a symlink (ENOTDIR/ELOOP if it is one). */
export function openDirAt(dirFd: number, name: Uint8Array): number {
  return openSync(at(dirFd, name), O_DIR);
}

/** A second fd on the same directory (a fresh open file description, not a dup). */
export function reopenDir(dirFd: number): number {
  return openSync(at(dirFd), constants.O_RDONLY | constants.O_DIRECTORY);
}

/** lstat of an entry; undefined when it does not exist. */
export function lstatAt(dirFd: number, name: Uint8Array): Stats | undefined {
  try {
    return lstatSync(at(dirFd, name));
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT') return undefined;
    throw err;
  }
}

export function readlinkAt(dirFd: number, name: Uint8Array): Buffer {
  return readlinkSync(at(dirFd, name), { encoding: 'buffer' });
}

export function mkdirAt(dirFd: number, name: Uint8Array, mode: number): void {
  mkdirSync(at(dirFd, name), { mode });
}

export function unlinkAt(dirFd: number, name: Uint8Array): void {
  unlinkSync(at(dirFd, name));
}

export function rmdirAt(dirFd: number, name: Uint8Array): void {
  rmdirSync(at(dirFd, name));
}

/** rename(2) between two held directories; neither final name is followed. */
export function renameAt(fromFd: number, from: Uint8Array, toFd: number, to: Uint8Array): void {
  renameSync(at(fromFd, from), at(toFd, to));
}

/** Opens a file entry without following a final symlink (ELOOP if it is one). */
export function openFileAt(dirFd: number, name: Uint8Array, flags: number, mode?: number): Promise<fsp.FileHandle> {
  return fsp.open(at(dirFd, name), flags | constants.O_NOFOLLOW, mode);
}

/** Below this size a file is read with synchronous calls: cheaper than two thread-pool round trips. */
const SYNC_READ_MAX = 64 * 1024;
const readFileFd = promisify(readFile) as (fd: number) => Promise<Buffer>;

export type OpenedFile = { buf: Buffer; st: Stats };

/**
 * Reads a regular file entry: opened with O_NOFOLLOW|O_NONBLOCK (a symlink is refused, a
 * FIFO cannot block), then `check` sees the fstat of what was actually opened before
 * anything is read (and may throw). Small files are read synchronously (the 4 KiB read
 * is the hot path of the in-process tools), larger ones on the thread pool.
 */
export async function readFileAt(dirFd: number, name: Uint8Array, check: (st: Stats) => void): Promise<OpenedFile> {
  const fd = openSync(at(dirFd, name), constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK);
  try {
    const st = fstatSync(fd);
    check(st);
    if (st.size > SYNC_READ_MAX) return { buf: await readFileFd(fd), st };
    // Read to EOF (one read more than fstat said, to see it): the file may have grown.
    const chunks: Buffer[] = [];
    let total = 0;
    let buf = Buffer.allocUnsafe(st.size + 1);
    let filled = 0;
    for (;;) {
      const n = readSync(fd, buf, filled, buf.length - filled, null);
      if (n === 0) break;
      filled += n;
      if (filled === buf.length) {
        chunks.push(buf);
        total += filled;
        // It grew past the small-file size: the rest goes through the thread pool.
        if (total > SYNC_READ_MAX) return { buf: Buffer.concat([...chunks, await readFileFd(fd)]), st };
        buf = Buffer.allocUnsafe(16 * 1024);
        filled = 0;
      }
    }
    chunks.push(buf.subarray(0, filled));
    return { buf: chunks.length === 1 ? (chunks[0] as Buffer) : Buffer.concat(chunks), st };
  } finally {
    closeSync(fd);
  }
}

export interface DirName {
  name: Buffer;
  type: 'file' | 'dir' | 'symlink' | 'other';
}

/** A directory larger than this (st_size, which grows with its entries on ext4, tmpfs, btrfs, xfs) is read in batches. */
const BATCHED_DIR_BYTES = 256 * 1024;
/** Entries per batch of a large directory: a few milliseconds of the loop each. */
const DIR_BATCH = 1024;

/**
 * Names in a held directory, raw bytes, with their d_type. One readdir builds every entry's
 * object on the loop in one go when it returns: a 200,000-entry directory held the loop for
 * 300-400 ms (every session waiting), so a large one is read in batches instead (each its
 * own thread-pool read, the loop free in between; about the same time in all).
 */
export async function readDirAt(dirFd: number): Promise<DirName[]> {
  if (fstatSync(dirFd).size <= BATCHED_DIR_BYTES) return direntNames(await fsp.readdir(at(dirFd), { withFileTypes: true, encoding: 'buffer' }));
  const out: DirName[] = [];
  const dir = await fsp.opendir(at(dirFd) as unknown as string, { encoding: 'buffer' as BufferEncoding, bufferSize: DIR_BATCH });
  for await (const d of dir) out.push(direntName(d as unknown as Dirent<Buffer>));
  return out;
}

/**
 * The same, on the calling thread: no thread-pool round trip, which costs more than the
 * listing itself for the small directories of a workspace (and far more in an emulated
 * guest). It blocks its loop for one directory's listing: for a caller whose loop serves
 * nothing else meanwhile (the guest agent's sync scan), not the broker's.
 */
export function readDirAtSync(dirFd: number): DirName[] {
  return direntNames(readdirSync(at(dirFd), { withFileTypes: true, encoding: 'buffer' }));
}

function direntNames(ds: Array<Dirent<Buffer>>): DirName[] {
  return ds.map(direntName);
}

function direntName(d: Dirent<Buffer>): DirName {
  return { name: d.name, type: d.isFile() ? 'file' : d.isDirectory() ? 'dir' : d.isSymbolicLink() ? 'symlink' : 'other' };
}

/** Raw names joined with `/`. */
export function joinNames(names: Uint8Array[]): Buffer {
  const parts: Uint8Array[] = [];
  names.forEach((n, i) => {
    if (i > 0) parts.push(SLASH_BYTES);
    parts.push(n);
  });
  return Buffer.concat(parts);
}
const SLASH_BYTES = Buffer.from('/');

export function closeQuietly(fd: number): void {
  try {
    closeSync(fd);
  } catch {
    // already closed: nothing to release
  }
}


/**
 * Removes `name` in `dirFd` and, for a directory, everything below it however deep,
 * holding two fds and no path: each subdirectory is first moved up into `name` itself
 * (a rename inside the tree being removed), so nothing being emptied is ever more than one
 * level below it. fs.rm re-resolves a path per level (a tenant swapping a directory for a
 * symlink mid-walk could point it at the host, and past PATH_MAX it fails), and an fd per
 * level runs the process out of fds on a tree made 100,000 levels deep. Every step is
 * relative to a held fd and never follows a symlink: an entry that turns into a link is
 * unlinked as one.
 */
export async function removeTreeAt(dirFd: number, name: Uint8Array): Promise<void> {
  const st = lstatAt(dirFd, name);
  if (!st) return;
  if (!st.isDirectory()) {
    unlinkAt(dirFd, name);
    return;
  }
  const top = openDirAt(dirFd, name);
  try {
    let moved = 0;
    // Random: a tenant cannot have put a directory of that name in the way.
    const tag = `.hutch-rm-${randomBytes(6).toString('hex')}-`;
    // Directories directly in `top` still to empty; `top`'s own entries come first.
    const pending: Array<Uint8Array | undefined> = [undefined];
    // An unlink per entry: a directory of 100,000 files must not hold the loop for all of them.
    const slice = new LoopSlicer();
    while (pending.length > 0) {
      const sub = pending.pop();
      let fd = top;
      if (sub !== undefined) {
        try {
          fd = openDirAt(top, sub);
        } catch (err) {
          const code = (err as NodeJS.ErrnoException).code;
          // Not a directory any more (a link or a file in its place): it goes as it is.
          if (code === 'ELOOP' || code === 'ENOTDIR') unlinkAt(top, sub);
          else if (code !== 'ENOENT') throw err;
          continue;
        }
      }
      try {
        for (const e of await readDirAt(fd)) {
          await slice.tick();
          if (e.type === 'dir') {
            if (sub === undefined) {
              pending.push(e.name);
              continue;
            }
            const up = Buffer.from(`${tag}${moved++}`);
            renameAt(fd, e.name, top, up);
            pending.push(up);
            continue;
          }
          try {
            unlinkAt(fd, e.name);
          } catch (err) {
            const code = (err as NodeJS.ErrnoException).code;
            if (code === 'EISDIR') {
              const up = Buffer.from(`${tag}${moved++}`);
              renameAt(fd, e.name, top, up);
              pending.push(up);
            } else if (code !== 'ENOENT') throw err;
          }
        }
      } finally {
        if (fd !== top) closeSync(fd);
      }
      if (sub !== undefined) rmdirAt(top, sub);
    }
  } finally {
    closeSync(top);
  }
  rmdirAt(dirFd, name);
}
