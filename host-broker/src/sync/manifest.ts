import { constants, lstatSync, openSync, promises as fsp, readlinkSync } from 'node:fs';
import { at, closeQuietly } from '../../../guest-agent/src/workspace/fd-path.ts';
import { openSyncRoot, splitSyncPath, SyncParentCache } from '../../../guest-agent/src/workspace/sync-path.ts';
import { walk } from '../../../guest-agent/src/workspace/walk.ts';
import { LoopSlicer } from '../../../guest-agent/src/workspace/work-budget.ts';
import { sortSliced } from '../../../guest-agent/src/workspace/sliced-sort.ts';
import { AncestorTest } from '../../../guest-agent/src/workspace/ancestry.ts';
import { nameFromBytes, nameToBytes } from '../../../guest-agent/src/workspace/names.ts';

/**
 * What a workspace tree looks like, entry by entry, without contents: enough to tell
 * which paths differ between the host and what a guest holds (size, mtime, mode, kind,
 * symlink target), so a push carries only those. Paths and symlink targets are kept as
 * surrogateescape strings (names.ts): one to one with the bytes, and JSON-safe for the
 * manifest a snapshot slot keeps.
 */
export interface ManifestEntry {
  kind: 'file' | 'dir' | 'symlink';
  size: number;
  mtimeMs: number;
  mode: number;
  target?: string;
}
export type Manifest = Map<string, ManifestEntry>;

/**
 * A host workspace opened to look entries up by their relative paths, one directory at a
 * time through fds, never through a symlink. A whole host path would follow a symlink in
 * any component but the last: a guest that turned a directory into a link to a host
 * directory had the broker (root) stat and read the file behind it for the next push,
 * and write it into the guest. Paths past PATH_MAX resolve the same way. Close it after use.
 */
export class HostTree {
  private readonly rootFd: number;
  private readonly parents: SyncParentCache;

  constructor(root: string) {
    this.rootFd = openSyncRoot(root);
    this.parents = new SyncParentCache(this.rootFd);
  }

  /**
   * A path that names `rel` through its parent directory's fd (`/proc/self/fd/N/name`), for
   * one synchronous lstat or open right away: the fd is the tree's and moves on with the
   * next lookup. Undefined when a component is missing, not a directory (a symlink among
   * them) or the path is not a workspace path.
   */
  locate(rel: string): Buffer | undefined {
    let parts: Buffer[];
    let fd: number | undefined;
    try {
      parts = splitSyncPath(nameToBytes(rel));
      fd = this.parents.get(parts);
    } catch {
      return undefined;
    }
    return fd === undefined ? undefined : at(fd, parts[parts.length - 1] as Buffer);
  }

  /**
   * One entry's manifest data. Synchronous on purpose: a scan makes one of these per file
   * (100,000 for a node_modules), and an lstat is microseconds while a thread-pool round
   * trip is far more; the callers' loops yield between them.
   */
  stat(rel: string): ManifestEntry | undefined {
    const p = this.locate(rel);
    return p ? entryOf(p) : undefined;
  }

  /** An fd of the directory `rel` (the caller closes it), or undefined if it is not one now. */
  openDir(rel: string): number | undefined {
    const p = this.locate(rel);
    if (!p) return undefined;
    try {
      return openSync(p, constants.O_RDONLY | constants.O_DIRECTORY | constants.O_NOFOLLOW);
    } catch {
      return undefined;
    }
  }

  close(): void {
    this.parents.close();
    closeQuietly(this.rootFd);
  }
}

function entryOf(abs: Buffer): ManifestEntry | undefined {
  let st;
  try {
    st = lstatSync(abs);
  } catch {
    return undefined;
  }
  const mode = st.mode & 0o7777;
  if (st.isFile()) return { kind: 'file', size: st.size, mtimeMs: st.mtimeMs, mode };
  if (st.isDirectory()) return { kind: 'dir', size: 0, mtimeMs: 0, mode };
  if (st.isSymbolicLink()) {
    try {
      return { kind: 'symlink', size: 0, mtimeMs: 0, mode: 0, target: nameFromBytes(readlinkSync(abs, { encoding: 'buffer' })) };
    } catch {
      return undefined;
    }
  }
  return undefined; // sockets, fifos, devices never sync
}

/** Every entry under `root` (a path, or a directory fd the caller keeps and closes). */
export async function scanTree(root: string | number): Promise<Manifest> {
  const m: Manifest = new Map();
  // A tenant's directory of 200,000 files was one uninterrupted block of the broker's loop
  // (3.4 s): the entries of one directory come without a turn of the loop unless it yields.
  const slicer = new LoopSlicer();
  for await (const e of walk(root, { tick: () => slicer.tick() })) {
    // Through the walk's held directory fd: the entry the walk listed, under its raw name.
    const entry = entryOf(at(e.dirFd, e.name));
    if (entry) m.set(nameFromBytes(e.raw), entry);
  }
  return m;
}

export function sameEntry(a: ManifestEntry, b: ManifestEntry): boolean {
  if (a.kind !== b.kind || a.mode !== b.mode) return false;
  if (a.kind === 'file') return a.size === b.size && Math.abs(a.mtimeMs - b.mtimeMs) < 1;
  if (a.kind === 'symlink') return a.target === b.target;
  return true;
}

/**
 * Paths to (re)write, parents first, and paths to delete, deepest first, to turn `to` into
 * `from`. Sliced (a LoopSlicer every TICK_EVERY entries, sorts in runs): a fresh push of a
 * 200,000-entry workspace held the broker's loop 200-340 ms here in one block.
 */
export async function diffManifests(from: Manifest, to: Manifest): Promise<{ write: string[]; remove: string[] }> {
  const slicer = new LoopSlicer();
  const tick = () => slicer.tick();
  let n = 0;
  const write: string[] = [];
  const remove: string[] = [];
  for (const [p, e] of from) {
    if (++n % TICK_EVERY === 0) await tick();
    const t = to.get(p);
    if (!t || !sameEntry(e, t)) write.push(p);
  }
  // A path under a directory that goes is removed with it: only the top of each removed tree is listed.
  const underRemoved = new AncestorTest((a) => to.has(a) && !from.has(a));
  for (const p of to.keys()) {
    if (++n % TICK_EVERY === 0) await tick();
    if (!from.has(p) && !underRemoved.anyAncestor(p)) remove.push(p);
  }
  return { write: await sortedList(write, tick), remove: (await sortedList(remove, tick)).reverse() };
}

/** Entries between ticks in the manifest's loops: a tick costs a promise, an entry far less. */
export const TICK_EVERY = 256;

async function sortedList(paths: string[], tick: () => Promise<void>): Promise<string[]> {
  const out: string[] = [];
  for (const p of await sortSliced(paths, (x) => x, tick)) {
    out.push(p);
    if (out.length % TICK_EVERY === 0) await tick();
  }
  return out;
}

/** Bytes of a manifest file written at a time. */
const MANIFEST_CHUNK_BYTES = 1024 * 1024;

/**
 * Writes a manifest (a slot keeps the guest's view of /work) as one JSON line per entry, a
 * chunk at a time between ticks: one JSON.stringify of a 200,000-entry manifest held the
 * broker's loop 220-300 ms at every snapshot release. The caller makes the file durable.
 */
export async function writeManifest(path: string, m: Manifest): Promise<void> {
  const slicer = new LoopSlicer();
  const fh = await fsp.open(path, 'w', 0o600);
  try {
    let chunk: string[] = [];
    let bytes = 0;
    let n = 0;
    for (const e of m) {
      const line = `${JSON.stringify(e)}\n`;
      chunk.push(line);
      bytes += line.length;
      if (bytes >= MANIFEST_CHUNK_BYTES) {
        await fh.write(chunk.join(''));
        chunk = [];
        bytes = 0;
      }
      if (++n % TICK_EVERY === 0) await slicer.tick();
    }
    if (chunk.length) await fh.write(chunk.join(''));
  } finally {
    await fh.close();
  }
}

/** Reads what writeManifest wrote, a line at a time between ticks (and the one-array JSON that slots written before it hold). */
export async function readManifest(path: string): Promise<Manifest> {
  const text = await fsp.readFile(path, 'utf8');
  // The older format is one array of [path, entry] pairs; a line here is one such pair.
  if (text.startsWith('[[') || text.trim() === '[]') return new Map(JSON.parse(text) as Array<[string, ManifestEntry]>);
  const slicer = new LoopSlicer();
  const m: Manifest = new Map();
  let n = 0;
  for (let at = 0; at < text.length; ) {
    let end = text.indexOf('\n', at);
    if (end < 0) end = text.length;
    if (end > at) {
      const [k, v] = JSON.parse(text.slice(at, end)) as [string, ManifestEntry];
      m.set(k, v);
    }
    at = end + 1;
    if (++n % TICK_EVERY === 0) await slicer.tick();
  }
  return m;
}
