import { promises as fsp } from 'node:fs';
import { walk } from '../../../guest-agent/src/workspace/walk.ts';
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

/** The bytes path of a workspace-relative name (a name need not be UTF-8, so never a plain string join). */
export function hostPathBytes(root: string, rel: string): Buffer {
  return Buffer.concat([Buffer.from(root), Buffer.from('/'), nameToBytes(rel)]);
}

export async function statEntry(root: string, rel: string): Promise<ManifestEntry | undefined> {
  const abs = hostPathBytes(root, rel);
  const st = await fsp.lstat(abs).catch(() => undefined);
  if (!st) return undefined;
  const mode = st.mode & 0o7777;
  if (st.isFile()) return { kind: 'file', size: st.size, mtimeMs: st.mtimeMs, mode };
  if (st.isDirectory()) return { kind: 'dir', size: 0, mtimeMs: 0, mode };
  if (st.isSymbolicLink()) {
    const target = await fsp.readlink(abs, { encoding: 'buffer' }).catch(() => undefined);
    return target === undefined ? undefined : { kind: 'symlink', size: 0, mtimeMs: 0, mode: 0, target: nameFromBytes(target) };
  }
  return undefined; // sockets, fifos, devices never sync
}

export async function scanTree(root: string): Promise<Manifest> {
  const m: Manifest = new Map();
  for await (const e of walk(root)) {
    // walk() gives the raw name bytes where it can; its string form maps back one to one.
    const raw = (e as { raw?: Buffer }).raw;
    const rel = raw ? nameFromBytes(raw) : e.rel;
    const entry = await statEntry(root, rel);
    if (entry) m.set(rel, entry);
  }
  return m;
}

export function sameEntry(a: ManifestEntry, b: ManifestEntry): boolean {
  if (a.kind !== b.kind || a.mode !== b.mode) return false;
  if (a.kind === 'file') return a.size === b.size && Math.abs(a.mtimeMs - b.mtimeMs) < 1;
  if (a.kind === 'symlink') return a.target === b.target;
  return true;
}

/** Paths to (re)write, parents first, and paths to delete, deepest first, to turn `to` into `from`. */
export function diffManifests(from: Manifest, to: Manifest): { write: string[]; remove: string[] } {
  const write: string[] = [];
  const remove: string[] = [];
  for (const [p, e] of from) {
    const t = to.get(p);
    if (!t || !sameEntry(e, t)) write.push(p);
  }
  for (const p of to.keys()) if (!from.has(p) && !hasMissingAncestor(p, from, to)) remove.push(p);
  write.sort();
  remove.sort().reverse();
  return { write, remove };
}

function hasMissingAncestor(p: string, from: Manifest, to: Manifest): boolean {
  for (let i = p.lastIndexOf('/'); i > 0; i = p.lastIndexOf('/', i - 1)) {
    const a = p.slice(0, i);
    if (to.has(a) && !from.has(a)) return true;
  }
  return false;
}

export function manifestToJson(m: Manifest): string {
  return JSON.stringify([...m.entries()]);
}

export function manifestFromJson(s: string): Manifest {
  return new Map(JSON.parse(s) as Array<[string, ManifestEntry]>);
}
