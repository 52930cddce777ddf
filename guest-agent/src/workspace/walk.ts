import { constants, openSync } from 'node:fs';
import { isAtomicTempName } from './atomic-write.ts';
import { assertProcfs, closeQuietly, joinNames, openDirAt, readDirAt, readDirAtSync } from './fd-path.ts';
import { nameFromBytes } from './names.ts';

export type WalkType = 'file' | 'dir' | 'symlink' | 'other';
export interface WalkEntry {
  /** Path relative to the walk's start ('' never appears), odd bytes surrogate-escaped (names.ts). */
  rel: string;
  /** The same path as raw name bytes. */
  raw: Buffer;
  type: WalkType;
  /**
   * The directory holding the entry and its raw name: act on the entry through
   * fd-path.ts (openFileAt(dirFd, name), lstatAt...) and nothing can redirect it. Valid
   * while the walk is in that directory or below it; reading it later throws rather than
   * hand out a number the process may have reused for another file.
   */
  readonly dirFd: number;
  name: Buffer;
}

export interface WalkOptions {
  /** Directory names never descended into (matched against the name only). */
  skipDirs?: ReadonlySet<string>;
  /** Entries to leave out; a directory left out is not descended into either. */
  skip?: (rel: string, type: WalkType) => boolean;
  /** Stop after this many entries. */
  limit?: number;
  /** Called per directory entry, skipped ones included: lets a caller yield to the loop and enforce a deadline (work-budget.ts). */
  tick?: () => Promise<void>;
  /** List each directory on the calling thread (fd-path.ts readDirAtSync says when that is right). */
  syncListing?: boolean;
}

interface Frame {
  fd: number;
  closed?: boolean;
  raw: Buffer;
  /** Subdirectories still to descend into, in order. */
  subdirs: Buffer[];
}

/**
 * Walk that never follows symlinks (a link is reported, not entered), so it cannot leave
 * the tree it started in: each directory is opened from its parent's held fd with
 * O_NOFOLLOW|O_DIRECTORY and listed through that fd, so a directory swapped for a symlink
 * mid-walk is skipped, never entered. Entries come sorted by name within a directory
 * (deterministic results); a directory's entries all come before its subdirectories'.
 *
 * `start` is a host path (trusted: opened as given) or a directory fd the caller holds
 * (not closed here). Holds one fd per level of the current branch.
 */
export async function* walk(start: string | number, opts: WalkOptions = {}): AsyncGenerator<WalkEntry> {
  let startFd: number;
  if (typeof start === 'number') startFd = start;
  else {
    assertProcfs();
    try {
      startFd = openSync(start, constants.O_RDONLY | constants.O_DIRECTORY);
    } catch {
      return; // nothing to walk, as find on a missing directory prints nothing useful
    }
  }
  const stack: Frame[] = [];
  let count = 0;
  try {
    let frame: Frame | undefined = { fd: startFd, raw: Buffer.alloc(0), subdirs: [] };
    while (frame) {
      stack.push(frame);
      for await (const e of listDir(frame, opts)) {
        yield e;
        if (opts.limit !== undefined && ++count >= opts.limit) return;
      }
      frame = undefined;
      // Next: the first pending subdirectory of the deepest frame that has one.
      while (!frame && stack.length > 0) {
        const top = stack[stack.length - 1] as Frame;
        const next = top.subdirs.shift();
        if (next === undefined) {
          close(stack.pop() as Frame, startFd);
          continue;
        }
        const fd = openChild(top.fd, next);
        if (fd !== undefined) frame = { fd, raw: top.raw.length ? joinNames([top.raw, next]) : next, subdirs: [] };
      }
    }
  } finally {
    for (const f of stack) close(f, startFd);
    if (typeof start !== 'number') closeQuietly(startFd);
  }
}

function close(f: Frame, startFd: number): void {
  f.closed = true;
  if (f.fd !== startFd) closeQuietly(f.fd);
}

async function* listDir(frame: Frame, opts: WalkOptions): AsyncGenerator<WalkEntry> {
  let entries;
  try {
    entries = opts.syncListing ? readDirAtSync(frame.fd) : await readDirAt(frame.fd);
  } catch (err) {
    if (isFdExhaustion(err)) throw err;
    return; // unreadable: skip, as find does
  }
  entries.sort((a, b) => Buffer.compare(a.name, b.name));
  for (const d of entries) {
    if (opts.tick) await opts.tick();
    const nameStr = nameFromBytes(d.name);
    if (isAtomicTempName(nameStr)) continue;
    const raw = frame.raw.length ? joinNames([frame.raw, d.name]) : d.name;
    const rel = nameFromBytes(raw);
    if (d.type === 'dir' && opts.skipDirs?.has(nameStr)) continue;
    if (opts.skip?.(rel, d.type)) continue;
    yield {
      rel,
      raw,
      type: d.type,
      name: d.name,
      get dirFd(): number {
        if (frame.closed) throw new Error(`walk entry ${rel}: its directory was closed (the walk moved on)`);
        return frame.fd;
      },
    };
    if (d.type === 'dir') frame.subdirs.push(d.name);
  }
}

/** Opens a subdirectory from its parent's fd; undefined if it vanished or is no longer a directory. */
function openChild(parentFd: number, name: Buffer): number | undefined {
  try {
    return openDirAt(parentFd, name);
  } catch (err) {
    // Running out of fds must not look like an empty directory (sync would delete its files).
    if (isFdExhaustion(err)) throw err;
    return undefined;
  }
}

function isFdExhaustion(err: unknown): boolean {
  const code = (err as NodeJS.ErrnoException).code;
  return code === 'EMFILE' || code === 'ENFILE';
}
