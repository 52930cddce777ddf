import { constants, fstatSync, openSync } from 'node:fs';
import { HutchError } from '../protocol/errors.ts';
import { isAtomicTempName } from './atomic-write.ts';
import { assertProcfs, at, closeQuietly, joinNames, openDirAt, readDirAt, readDirAtSync } from './fd-path.ts';
import { nameFromBytes, WORKSPACE_PATH_MAX_BYTES } from './names.ts';
import { sortSliced } from './sliced-sort.ts';

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
  /** Depth and entry limits: past either the walk stops short and says which (search tools, answer-bounds.ts). */
  budget?: WalkBudget;
  /** Called per directory entry, skipped ones included: lets a caller yield to the loop and enforce a deadline (work-budget.ts). */
  tick?: () => Promise<void>;
  /** List each directory on the calling thread (fd-path.ts readDirAtSync says when that is right). */
  syncListing?: boolean;
  /**
   * Entries whose path is longer than this many bytes are not listed (default
   * WORKSPACE_PATH_MAX_BYTES: nothing can name them) nor descended into, unless `beyond` is
   * given. Infinity lists everything (the guest's sync scan, which reports such trees).
   */
  maxPathBytes?: number;
  /**
   * Called for each entry past maxPathBytes, its directory's fd valid during the call, and
   * those directories are walked too: the quota counts what no path can name.
   */
  beyond?: (dirFd: number, name: Buffer, type: WalkType) => void;
}

/**
 * How far a walk may go. Without one, a walk sees the whole tree (the quota and the sync
 * must); a tool that answers a tenant stops where its answer would stop mattering.
 */
export interface WalkBudget {
  /** Levels listed below the start: a directory at this level is reported, not entered. */
  maxDepth: number;
  /** Directory entries listed, skipped ones included: the walk ends at the next one. */
  maxEntries: number;
  /** Set when the walk stopped short of the whole tree, and why. */
  hit?: 'depth' | 'entries';
  /** Entries listed so far. */
  entries?: number;
}

interface Frame {
  fd: number;
  /** Levels below the start (the start is 0; its entries are at level 1). */
  depth: number;
  closed?: boolean;
  /** The directory's path from the start; undefined past maxPathBytes (its entries go to `beyond`). */
  raw: Buffer | undefined;
  /** Subdirectories still to descend into, in order. */
  subdirs: Buffer[];
  /** Set while the frame's fd is closed to bound the fds a deep branch holds: reopened through its child's `..`, checked to be the same directory. */
  parked?: { dev: number; ino: number };
}

/**
 * Directory fds a walk holds at most besides its start: deeper branches park the
 * shallower fds and reopen them on the way back. A tenant's tree can be 100,000 levels
 * deep; one fd per level would exhaust the process's fds, and every other session's
 * opens with them.
 */
const FD_WINDOW = 64;
const DOTDOT = Buffer.from('..');

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
  const maxPath = opts.maxPathBytes ?? WORKSPACE_PATH_MAX_BYTES;
  try {
    let frame: Frame | undefined = { fd: startFd, depth: 0, raw: Buffer.alloc(0), subdirs: [] };
    while (frame) {
      stack.push(frame);
      if (stack.length > FD_WINDOW + 1) park(stack[stack.length - 1 - FD_WINDOW] as Frame);
      yield* listDir(frame, opts, maxPath);
      if (opts.budget?.hit === 'entries') return;
      frame = undefined;
      // Next: the first pending subdirectory of the deepest frame that has one.
      while (!frame && stack.length > 0) {
        const top = stack[stack.length - 1] as Frame;
        const next = top.subdirs.shift();
        if (next === undefined) {
          const done = stack.pop() as Frame;
          const parent = stack[stack.length - 1];
          try {
            if (parent?.parked) unpark(parent, done);
          } finally {
            close(done, startFd);
          }
          continue;
        }
        const fd = openChild(top.fd, next);
        if (fd === undefined) continue;
        const raw = top.raw === undefined ? undefined : top.raw.length ? joinNames([top.raw, next]) : next;
        frame = { fd, depth: top.depth + 1, raw: raw !== undefined && raw.length <= maxPath ? raw : undefined, subdirs: [] };
      }
    }
  } finally {
    for (const f of stack) if (!f.parked) close(f, startFd);
    if (typeof start !== 'number') closeQuietly(startFd);
  }
}

/** Closes a shallow frame's fd while the walk is deeper, remembering which directory it was. */
function park(f: Frame): void {
  if (f.parked || f.closed) return;
  const st = fstatSync(f.fd);
  f.parked = { dev: st.dev, ino: st.ino };
  closeQuietly(f.fd);
  f.closed = true;
}

/**
 * Reopens a parked frame as its child's `..`. Only the same directory will do: one that
 * moved meanwhile (a tenant renaming the branch under the walk) ends the walk with an
 * error, never a partial listing (a sync scan would take what it missed as deleted).
 */
function unpark(f: Frame, child: Frame): void {
  const fd = openSync(at(child.fd, DOTDOT), constants.O_RDONLY | constants.O_DIRECTORY);
  const st = fstatSync(fd);
  if (st.dev !== f.parked?.dev || st.ino !== f.parked.ino) {
    closeQuietly(fd);
    throw new HutchError('busy', `the tree changed while it was walked (a directory ${f.raw ? nameFromBytes(f.raw) : 'deep below the start'} moved); try again`);
  }
  f.fd = fd;
  f.closed = false;
  delete f.parked;
}

function close(f: Frame, startFd: number): void {
  f.closed = true;
  if (f.fd !== startFd) closeQuietly(f.fd);
}

async function* listDir(frame: Frame, opts: WalkOptions, maxPath: number): AsyncGenerator<WalkEntry> {
  // Past the longest nameable path there is nothing to list: only the quota (`beyond`) looks.
  if (frame.raw === undefined && !opts.beyond) return;
  let entries;
  try {
    entries = opts.syncListing ? readDirAtSync(frame.fd) : await readDirAt(frame.fd);
  } catch (err) {
    if (isFdExhaustion(err)) throw err;
    return; // unreadable: skip, as find does
  }
  const budget = opts.budget;
  // Its subdirectories would be listed one level further down than the budget goes.
  const leaf = budget !== undefined && frame.depth + 1 >= budget.maxDepth;
  const descend = (d: { name: Buffer }) => {
    if (!leaf) frame.subdirs.push(d.name);
    else if (budget) budget.hit ??= 'depth';
  };
  for (const d of await nameOrder(entries, opts.tick)) {
    if (budget) {
      budget.entries = (budget.entries ?? 0) + 1;
      if (budget.entries > budget.maxEntries) {
        budget.hit = 'entries';
        return;
      }
    }
    if (opts.tick) await opts.tick();
    const nameStr = nameFromBytes(d.name);
    if (isAtomicTempName(nameStr)) continue;
    if (d.type === 'dir' && opts.skipDirs?.has(nameStr)) continue;
    const raw = frame.raw === undefined ? undefined : frame.raw.length ? joinNames([frame.raw, d.name]) : d.name;
    if (raw === undefined || raw.length > maxPath) {
      if (!opts.beyond) continue;
      opts.beyond(frame.fd, d.name, d.type);
      if (d.type === 'dir') descend(d);
      continue;
    }
    const rel = nameFromBytes(raw);
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
    if (d.type === 'dir') descend(d);
  }
}

/**
 * Entries in byte order of their names. Compared as latin1 strings (one code unit per byte,
 * so the same order as Buffer.compare) instead of one Buffer.compare call per comparison:
 * half the time on a wide directory (200,000 names: 125 against 265 ms), which the broker's
 * tools spend on its event loop and the guest's scan under emulation. A wide directory is
 * sorted in runs between ticks (sliced-sort.ts): the walk ticks per entry as it takes them.
 */
function nameOrder<T extends { name: Buffer }>(entries: T[], tick: (() => Promise<void>) | undefined): Promise<Iterable<T>> {
  return sortSliced(entries, (d) => d.name.toString('latin1'), tick);
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
