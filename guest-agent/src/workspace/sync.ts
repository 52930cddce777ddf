import { constants, promises as fsp, type BigIntStats } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { HutchError, toHutchError } from '../protocol/errors.ts';
import type { ResultOf, SyncChange, SyncEntry } from '../protocol/methods.ts';
import { writeFileAtomic } from './atomic-write.ts';
import type { Workspace } from './confine.ts';
import { walk } from './walk.ts';

/**
 * Workspace sync primitives. The host workspace is the source of truth: the broker
 * pushes it into the guest with `apply`, and after each call asks what changed since the
 * marker it took (`mark`/`changes`) and pulls that back. Both directions apply through
 * this module, so both get the same guarantees: every file lands atomically, symlinks are
 * stored as symlinks and never followed, and nothing outside the workspace is touched.
 */

export interface ManifestEntry {
  kind: 'file' | 'dir' | 'symlink';
  size: number;
  mtimeNs: bigint;
  ino: bigint;
  mode: number;
  target?: string;
}
export type Manifest = Map<string, ManifestEntry>;

export interface SyncOptions {
  owner?: { uid: number; gid: number } | undefined;
  durable?: boolean;
  /** Files larger than this are reported as skipped instead of synced. */
  maxFileBytes?: number;
  /** Markers kept; older ones are forgotten (a pull against them falls back to a full diff). */
  keepMarkers?: number;
}

export type ContentSource = (change: Extract<SyncChange, { op: 'write' }>) => Uint8Array | AsyncIterable<Uint8Array>;

export class WorkspaceSync {
  private readonly markers = new Map<string, Manifest>();

  constructor(
    readonly ws: Workspace,
    private readonly opts: SyncOptions = {},
  ) {}

  /** Applies a batch in order; a failed entry is reported and the rest still applied. */
  async apply(changes: SyncChange[], content: ContentSource): Promise<ResultOf<'sync.apply'>> {
    let applied = 0;
    const failed: ResultOf<'sync.apply'>['failed'] = [];
    for (const [index, c] of changes.entries()) {
      try {
        await this.applyOne(c, content);
        applied++;
      } catch (err) {
        const e = toHutchError(err, { path: c.path });
        failed.push({ index, path: c.path, code: e.code, message: e.message });
      }
    }
    return { applied, failed };
  }

  /** Records the current state; `changes(marker)` later reports what differs from it. */
  async mark(): Promise<{ marker: string; entries: number }> {
    const m = await this.scan();
    return { marker: this.remember(m), entries: m.size };
  }

  async changes(since: string, inline: { maxBytes: number; budgetBytes: number }): Promise<ResultOf<'sync.changes'>> {
    const before = this.markers.get(since);
    if (!before) throw new HutchError('not_found', `unknown sync marker ${since}`, { marker: since });
    const now = await this.scan();
    const skipped: Array<{ path: string; reason: string }> = [];
    const deleted: SyncEntry[] = [];
    const changed: SyncEntry[] = [];
    for (const path of before.keys()) {
      if (!now.has(path) && !hasDeletedAncestor(path, before, now)) deleted.push({ path, kind: 'deleted' });
    }
    let budget = inline.budgetBytes;
    for (const [path, e] of now) {
      const old = before.get(path);
      if (old && sameEntry(old, e)) continue;
      if (e.kind === 'file' && this.opts.maxFileBytes !== undefined && e.size > this.opts.maxFileBytes) {
        skipped.push({ path, reason: `file of ${e.size} bytes is above the sync limit of ${this.opts.maxFileBytes}` });
        continue;
      }
      const entry: SyncEntry = { path, kind: e.kind, mode: e.mode, mtimeMs: Number(e.mtimeNs / 1_000_000n) };
      if (e.kind === 'file') {
        entry.size = e.size;
        if (e.size <= inline.maxBytes && e.size <= budget) {
          const data = await this.readFile(path).catch(() => undefined);
          if (data && data.length === e.size) {
            entry.data = data;
            budget -= data.length;
          }
        }
      }
      if (e.kind === 'symlink') entry.target = e.target as string;
      changed.push(entry);
    }
    for (const s of this.lastScanSkipped) skipped.push(s);
    // Deletions deepest first, then creations parents first: applying in order never
    // needs a directory that is not there yet.
    deleted.sort((a, b) => (a.path < b.path ? 1 : -1));
    changed.sort((a, b) => (a.path < b.path ? -1 : 1));
    return { marker: this.remember(now), changes: [...deleted, ...changed], skipped };
  }

  /** Content of a workspace file, read without following a final symlink or blocking on a FIFO. */
  async openFile(path: string): Promise<{ size: number; stream: AsyncIterable<Uint8Array>; close: () => Promise<void> }> {
    const r = this.ws.resolve(path, { followFinal: false });
    if (!r.stat?.isFile()) throw new HutchError('bad_request', `${path} is not a regular file`, { path });
    const fh = await fsp.open(r.abs, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK);
    const st = await fh.stat();
    return {
      size: st.size,
      stream: fh.createReadStream({ autoClose: false, highWaterMark: 128 * 1024 }),
      close: () => fh.close(),
    };
  }

  private async readFile(path: string): Promise<Buffer> {
    const f = await this.openFile(path);
    try {
      const parts: Buffer[] = [];
      for await (const c of f.stream) parts.push(Buffer.from(c));
      return Buffer.concat(parts);
    } finally {
      await f.close();
    }
  }

  private lastScanSkipped: Array<{ path: string; reason: string }> = [];

  private async scan(): Promise<Manifest> {
    const m: Manifest = new Map();
    const skipped: Array<{ path: string; reason: string }> = [];
    for await (const e of walk(this.ws.root)) {
      let st: BigIntStats;
      try {
        st = await fsp.lstat(`${this.ws.root}/${e.rel}`, { bigint: true });
      } catch {
        continue;
      }
      const base = { size: Number(st.size), mtimeNs: st.mtimeNs, ino: st.ino, mode: Number(st.mode & 0o7777n) };
      if (st.isFile()) m.set(e.rel, { kind: 'file', ...base });
      else if (st.isDirectory()) m.set(e.rel, { kind: 'dir', ...base });
      else if (st.isSymbolicLink()) {
        const target = await fsp.readlink(`${this.ws.root}/${e.rel}`).catch(() => undefined);
        if (target !== undefined) m.set(e.rel, { kind: 'symlink', ...base, target });
      } else skipped.push({ path: e.rel, reason: 'not a regular file, directory or symlink' });
    }
    this.lastScanSkipped = skipped;
    return m;
  }

  private remember(m: Manifest): string {
    const marker = randomBytes(8).toString('hex');
    this.markers.set(marker, m);
    const keep = this.opts.keepMarkers ?? 4;
    while (this.markers.size > keep) this.markers.delete(this.markers.keys().next().value as string);
    return marker;
  }

  private async applyOne(c: SyncChange, content: ContentSource): Promise<void> {
    const owner = this.opts.owner;
    switch (c.op) {
      case 'write': {
        const r = this.ws.resolve(c.path, { followFinal: false, missing: 'parents' });
        if (r.rel === '') throw new HutchError('bad_request', 'cannot write the workspace root');
        await this.clearForReplace(r.abs, r.stat, 'file');
        await this.makeParents(r.rel, r.missingDepth - 1);
        await writeFileAtomic(r.abs, content(c), { mode: c.mode, owner, mtimeMs: c.mtimeMs, durable: this.opts.durable ?? false });
        return;
      }
      case 'mkdir': {
        const r = this.ws.resolve(c.path, { followFinal: false, missing: 'parents' });
        if (r.stat?.isDirectory()) {
          await fsp.chmod(r.abs, c.mode);
          return;
        }
        await this.clearForReplace(r.abs, r.stat, 'dir');
        await this.makeParents(r.rel, r.missingDepth - 1);
        await fsp.mkdir(r.abs, { mode: c.mode });
        await fsp.chmod(r.abs, c.mode);
        if (owner) await fsp.chown(r.abs, owner.uid, owner.gid);
        return;
      }
      case 'symlink': {
        const r = this.ws.resolve(c.path, { followFinal: false, missing: 'parents' });
        if (r.rel === '') throw new HutchError('bad_request', 'cannot replace the workspace root');
        await this.clearForReplace(r.abs, r.stat, 'symlink');
        await this.makeParents(r.rel, r.missingDepth - 1);
        // The target is stored verbatim and never resolved here: it is data, not a path we use.
        const tmp = `${r.abs}.hutch-${randomBytes(6).toString('hex')}.tmp`;
        await fsp.symlink(c.target, tmp);
        try {
          if (owner) await fsp.lchown(tmp, owner.uid, owner.gid);
          await fsp.rename(tmp, r.abs);
        } catch (err) {
          await fsp.rm(tmp, { force: true });
          throw err;
        }
        return;
      }
      case 'delete': {
        let r;
        try {
          r = this.ws.resolve(c.path, { followFinal: false });
        } catch (err) {
          if (err instanceof HutchError && err.code === 'not_found') return; // already gone
          throw err;
        }
        if (r.rel === '') throw new HutchError('bad_request', 'cannot delete the workspace root');
        await fsp.rm(r.abs, { recursive: true, force: true });
        return;
      }
      case 'chmod': {
        const r = this.ws.resolve(c.path, { followFinal: false });
        if (!r.stat?.isSymbolicLink()) await fsp.chmod(r.abs, c.mode);
        return;
      }
    }
  }

  /** A path changing kind (dir -> file, file -> symlink, ...) loses its old entry first. */
  private async clearForReplace(abs: string, st: { isDirectory(): boolean } | undefined, kind: 'file' | 'dir' | 'symlink'): Promise<void> {
    if (!st) return;
    if (st.isDirectory()) {
      if (kind !== 'dir') await fsp.rm(abs, { recursive: true, force: true });
    } else if (kind === 'dir') {
      await fsp.rm(abs, { force: true });
    }
  }

  private async makeParents(rel: string, depth: number): Promise<void> {
    if (depth <= 0) return;
    const parts = rel.split('/');
    const upto = parts.length - 1;
    for (let i = upto - depth; i < upto; i++) {
      const abs = this.ws.hostPath(parts.slice(0, i + 1).join('/'));
      await fsp.mkdir(abs, { mode: 0o755 });
      if (this.opts.owner) await fsp.chown(abs, this.opts.owner.uid, this.opts.owner.gid);
    }
  }
}

function sameEntry(a: ManifestEntry, b: ManifestEntry): boolean {
  if (a.kind !== b.kind || a.mode !== b.mode) return false;
  if (a.kind === 'file') return a.size === b.size && a.mtimeNs === b.mtimeNs && a.ino === b.ino;
  if (a.kind === 'symlink') return a.target === b.target;
  return true;
}

/** A deleted directory's children are implied by its own deletion. */
function hasDeletedAncestor(path: string, before: Manifest, now: Manifest): boolean {
  for (let i = path.lastIndexOf('/'); i > 0; i = path.lastIndexOf('/', i - 1)) {
    const parent = path.slice(0, i);
    if (before.has(parent) && !now.has(parent)) return true;
  }
  return false;
}
