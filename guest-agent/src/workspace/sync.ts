import { constants, fchmodSync, fchownSync, fstatSync, fsyncSync, futimesSync, lchownSync, lstatSync, openSync, readdirSync, symlinkSync, writeSync, type BigIntStats, type promises as fsp } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { HutchError, toHutchError } from '../protocol/errors.ts';
import { encodeFrame } from '../protocol/frame-codec.ts';
import { SYNC_PATH_MAX_BYTES, SYNC_RECORD_MAX_BYTES, type ResultOf, type SyncChange, type SyncChangesBatch, type SyncEntry } from '../protocol/methods.ts';
import { isAtomicTempName, writeFileAtomic, writeFileAtomicSyncAt } from './atomic-write.ts';
import type { Workspace } from './confine.ts';
import { AncestorTest } from './ancestry.ts';
import { nameFromBytes, nameToBytes } from './names.ts';
import { at, closeQuietly, lstatAt, mkdirAt, openDirAt, openFileAt, readlinkAt, removeTreeAt, renameAt, unlinkAt } from './fd-path.ts';
import { closeSyncParent, openSyncParent, openSyncRoot, readSmallFile, splitSyncPath, SyncParentCache } from './sync-path.ts';
import { walk } from './walk.ts';

/**
 * Workspace sync primitives of the agent. The host workspace is the source of truth: the
 * broker pushes it into the guest with `apply`, and after each call asks what changed
 * since the marker it took (`mark`/`changes`) and pulls that back. Names are bytes
 * throughout (a file need not have a UTF-8 name); manifests key them by their
 * surrogateescape string (names.ts), which maps bytes one to one.
 */

export interface ManifestEntry {
  kind: 'file' | 'dir' | 'symlink' | 'other';
  size: number;
  mtimeNs: bigint;
  ino: bigint;
  mode: number;
  target?: Buffer;
}
/** Keyed by the surrogateescape form of the name (nameToBytes gives the bytes back); no Buffer per entry, to stay small at 100,000 files. */
export type Manifest = Map<string, ManifestEntry>;

export interface SyncOptions {
  owner?: { uid: number; gid: number } | undefined;
  durable?: boolean;
  /** Markers kept; older ones are forgotten (a pull against them is refused as not_found). */
  keepMarkers?: number;
  /** List directories through the thread pool as before (walk.ts syncListing): only bench/sync-scan.ts's baseline sets it. */
  threadPoolListing?: boolean;
}

export type ContentSource = (change: Extract<SyncChange, { op: 'write' }>) => Uint8Array | AsyncIterable<Uint8Array>;

/** Something that takes change-set records with back-pressure (the sync.changes outbound stream). */
export interface RecordSink {
  write(chunk: Uint8Array): Promise<void>;
}

export interface ChangesOptions {
  /** Files up to this size travel inline. */
  inlineMaxBytes: number;
  /** Files above this size are reported as too_large instead of listed. */
  maxFileBytes?: number | undefined;
}

/** Entries applied between two turns of the event loop. */
const APPLY_YIELD_EVERY = 64;
/** Inline data per record; with one more entry at most, records stay far below SYNC_RECORD_MAX_BYTES. */
const BATCH_TARGET_BYTES = 256 * 1024;
/** A single inline file never exceeds this, whatever the broker asks. */
const INLINE_CAP_BYTES = 256 * 1024;
/** Estimated msgpack overhead of one entry besides its path, target and data. */
const ENTRY_OVERHEAD_BYTES = 96;

export class WorkspaceSync {
  private readonly markers = new Map<string, Manifest>();
  private readonly rootBytes: Buffer;
  /**
   * What a push applied so far on top of what it started from (see apply): the empty /work
   * of a fresh push, or the manifest of the marker the broker last pulled from. `m` is null
   * once it cannot be trusted (`mark` then scans).
   */
  private recording: (PushRecord & { from: string; m: Manifest | null }) | undefined;

  constructor(
    readonly ws: Workspace,
    private readonly opts: SyncOptions = {},
  ) {
    this.rootBytes = Buffer.from(ws.root);
  }

  /**
   * Applies a batch in order; a failed entry is reported and the rest still applied.
   *
   * What a push applies is recorded as it lands (an lstat per entry), on top of where it
   * started, and `mark` then remembers that record instead of scanning the tree:
   * - `fresh`: the broker is filling a /work it never pushed to since a pristine restore.
   *   If /work is indeed empty at the first such batch, the record starts empty (and files
   *   are created in place, applyIntoEmpty). A scan is the slowest step of a wake under TCG.
   * - `since`: the marker the broker last pulled from. The record starts from that marker's
   *   manifest, so what the guest changed since that pull (a background process writing a
   *   log between two calls) still differs from the new marker and is pulled after the
   *   call. A scan here would take those changes as the baseline and they would never reach
   *   the host.
   * An entry found otherwise than pushed (a background process raced the push) goes into a
   * `since` record as unknown, so the next pull carries whatever the guest has there now.
   * What makes the whole record doubtful (a failed entry, which fails the call anyway; an
   * unknown marker; anything odd in a fresh push) drops it and `mark` scans.
   */
  async apply(changes: SyncChange[], content: ContentSource, opts: { fresh?: boolean; mark?: boolean; since?: string | undefined } = {}): Promise<ResultOf<'sync.apply'>> {
    let applied = 0;
    const failed: ResultOf<'sync.apply'>['failed'] = [];
    const rootFd = openSyncRoot(this.ws.root);
    const parents = new SyncParentCache(rootFd);
    const from = opts.fresh ? FRESH : opts.since;
    if (from === undefined) this.recording = undefined;
    else if (this.recording?.from !== from) this.recording = { from, m: this.recordStart(from, rootFd), seq: 0, gone: new Map(), setAt: new Map() };
    const rec = this.recording;
    try {
      for (const [index, c] of changes.entries()) {
        // Small writes are synchronous: let the connection's other traffic (heartbeats) through now and then.
        if (index > 0 && index % APPLY_YIELD_EVERY === 0) await new Promise((r) => setImmediate(r));
        try {
          const st = rec?.from === FRESH && rec.m ? this.applyIntoEmpty(parents, c, content) : undefined;
          if (st === undefined) await this.applyOne(parents, c, content);
          applied++;
          if (rec?.m && !recordApplied(rec.m, rec, parents, c, st)) {
            // A fresh push has no tenant process to race it: something is off, scan. On top
            // of a pulled marker a scan would take every change since that pull as the
            // baseline; only this entry is in doubt, so only it is marked to be pulled.
            if (rec.from === FRESH) rec.m = null;
            else recordUnknown(rec.m, rec, c.path);
          }
        } catch (err) {
          const e = toHutchError(err, { path: nameFromBytes(c.path) });
          failed.push({ index, path: c.path, code: e.code, message: e.message });
          if (rec) rec.m = null;
        }
      }
    } finally {
      parents.close();
      closeQuietly(rootFd);
    }
    if (!opts.mark) return { applied, failed };
    this.recording = undefined;
    if (rec?.m) {
      dropRemovedTrees(rec.m, rec);
      return { applied, failed, marker: this.remember(rec.m), entries: rec.m.size, markedBy: 'recorded' };
    }
    return { applied, failed, ...(await this.mark()), markedBy: 'scan' };
  }

  /** Where a push's record starts: empty for a fresh push into an empty /work, a copy of a known marker's manifest; null otherwise. */
  private recordStart(from: string, rootFd: number): Manifest | null {
    if (from === FRESH) return readdirSync(at(rootFd)).length === 0 ? new Map() : null;
    const base = this.markers.get(from);
    return base ? new Map(base) : null;
  }

  /**
   * A fresh push into a /work that was empty when it began (recording): nothing can be in
   * the way (no tenant process runs before the wake ends, and entries come parents first,
   * each once), so a file is created in place with O_EXCL instead of through a temporary
   * name and a rename, and its fstat is the record. Under TCG each syscall a wake saves
   * counts. Returns undefined when the entry takes the general path (anything else, or a
   * name that exists after all).
   */
  private applyIntoEmpty(parents: SyncParentCache, c: SyncChange, content: ContentSource): BigIntStats | undefined {
    if (c.op !== 'write' && c.op !== 'mkdir') return undefined;
    if (c.op === 'write' && c.data === undefined) return undefined;
    const parts = splitSyncPath(c.path);
    const name = parts[parts.length - 1] as Buffer;
    if (isAtomicTempName(nameFromBytes(name))) return undefined;
    const owner = this.opts.owner;
    const dir = parents.get(parts, { owner });
    if (dir === undefined) return undefined;
    if (c.op === 'mkdir') {
      try {
        mkdirAt(dir, name, 0o700);
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code === 'EEXIST') return undefined;
        throw err;
      }
      const fd = openDirAt(dir, name);
      try {
        fchmodSync(fd, c.mode);
        if (owner) fchownSync(fd, owner.uid, owner.gid);
        return fstatSync(fd, { bigint: true });
      } finally {
        closeQuietly(fd);
      }
    }
    const data = content(c) as Uint8Array;
    let fd: number;
    try {
      fd = openSync(at(dir, name), constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL | constants.O_NOFOLLOW, c.mode & 0o7777);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === 'EEXIST') return undefined;
      throw err;
    }
    try {
      for (let off = 0; off < data.length; ) off += writeSync(fd, data, off, data.length - off);
      fchmodSync(fd, c.mode & 0o7777);
      if (owner) fchownSync(fd, owner.uid, owner.gid);
      if (c.mtimeMs !== undefined) futimesSync(fd, new Date(), new Date(c.mtimeMs));
      if (this.opts.durable) fsyncSync(fd);
      return fstatSync(fd, { bigint: true });
    } catch (err) {
      // Never leave a half-written file under the real name.
      try {
        unlinkAt(dir, name);
      } catch {
        // already gone
      }
      throw err;
    } finally {
      closeQuietly(fd);
    }
  }

  /** Records the current state; `changes(marker)` later reports what differs from it. */
  async mark(): Promise<{ marker: string; entries: number }> {
    this.recording = undefined;
    const m = await this.scan();
    return { marker: this.remember(m), entries: m.size };
  }

  /**
   * Streams what changed since `since` to `sink` as records (frame-codec frames, each a
   * SyncChangesBatch), waiting on the sink's flow control, so a change set of any size
   * costs bounded memory on both sides. Deletions first (deepest first), then creations
   * parents first: applying in order never needs a directory that is not there yet.
   */
  async changes(since: string, opts: ChangesOptions, sink: RecordSink): Promise<ResultOf<'sync.changes'>> {
    const before = this.markers.get(since);
    if (!before) throw new HutchError('not_found', `unknown sync marker ${since}`, { marker: since });
    this.recording = undefined;
    // A scan of a big tree takes a while (minutes under TCG): empty records on the stream
    // meanwhile tell the broker the guest is working, not stuck.
    const keepalive = keepaliveFor(sink);
    const now = await this.scan(keepalive);
    const rootFd = openSyncRoot(this.ws.root);
    const parents = new SyncParentCache(rootFd);
    try {
      return { ...(await this.emit(before, now, opts, sink, parents, keepalive)), entries: now.size };
    } finally {
      parents.close();
      closeQuietly(rootFd);
    }
  }

  private async emit(
    before: Manifest,
    now: Manifest,
    opts: ChangesOptions,
    sink: RecordSink,
    parents: SyncParentCache,
    keepalive: ReturnType<typeof keepaliveFor>,
  ): Promise<Omit<ResultOf<'sync.changes'>, 'entries'>> {
    const inlineMax = Math.min(opts.inlineMaxBytes, INLINE_CAP_BYTES);
    let batch: SyncChangesBatch = { changes: [], skipped: [] };
    let batchBytes = 0;
    const totals = { changes: 0, skipped: 0, batches: 0 };
    const flush = async (): Promise<void> => {
      if (batch.changes.length === 0 && batch.skipped.length === 0) return;
      await sink.write(encodeFrame(batch, SYNC_RECORD_MAX_BYTES));
      keepalive.sent();
      totals.batches++;
      batch = { changes: [], skipped: [] };
      batchBytes = 0;
    };
    const add = async (e: SyncEntry): Promise<void> => {
      batch.changes.push(e);
      totals.changes++;
      batchBytes += ENTRY_OVERHEAD_BYTES + e.path.length + (e.target?.length ?? 0) + (e.data?.length ?? 0);
      if (batchBytes >= BATCH_TARGET_BYTES) await flush();
    };
    const skip = async (path: Buffer, code: 'too_large' | 'unsupported_file_type' | 'invalid_name', message: string): Promise<void> => {
      batch.skipped.push({ path, code, message });
      totals.skipped++;
      batchBytes += ENTRY_OVERHEAD_BYTES + path.length + message.length;
      if (batchBytes >= BATCH_TARGET_BYTES) await flush();
    };

    // A path above what a sync path may be (a tree made deep through relative names) was
    // never on the host: its deletion is nothing to send, and it is reported once per
    // directory it lies under instead of failing the whole change set.
    const underDeleted = new AncestorTest((a) => before.has(a) && !now.has(a));
    const gone = [...before.keys()].filter((p) => !now.has(p) && !underDeleted.anyAncestor(p) && nameToBytes(p).length <= SYNC_PATH_MAX_BYTES).sort().reverse();
    for (const p of gone) await add({ path: nameToBytes(p), kind: 'deleted' });
    const tooLongUnder = new Set<string>();
    for (const p of [...now.keys()].sort()) {
      const e = now.get(p) as ManifestEntry;
      const old = before.get(p);
      if (old && sameEntry(old, e)) {
        await keepalive();
        continue;
      }
      const raw = nameToBytes(p);
      if (raw.length > SYNC_PATH_MAX_BYTES) {
        const under = raw.subarray(0, raw.lastIndexOf(0x2f, SYNC_PATH_MAX_BYTES));
        const key = under.toString('latin1');
        if (under.length > 0 && !tooLongUnder.has(key)) {
          tooLongUnder.add(key);
          await skip(under, 'invalid_name', `${nameFromBytes(under)} holds paths longer than ${SYNC_PATH_MAX_BYTES} bytes; they stay in the VM and are not synced to the host`);
        }
        continue;
      }
      if (e.kind === 'other') {
        await skip(raw, 'unsupported_file_type', `${p} is a FIFO, socket or device node; sync carries regular files, directories and symlinks`);
        continue;
      }
      if (e.kind === 'file' && opts.maxFileBytes !== undefined && e.size > opts.maxFileBytes) {
        await skip(raw, 'too_large', `${p} is ${e.size} bytes, above the sync limit of ${opts.maxFileBytes}`);
        continue;
      }
      const entry: SyncEntry = { path: raw, kind: e.kind, mode: e.mode, mtimeMs: Number(e.mtimeNs / 1_000_000n) };
      if (e.kind === 'file') {
        entry.size = e.size;
        if (e.size <= inlineMax) {
          // A file changed since the scan goes without data: the broker then reads it as it is now.
          const data = this.readSmall(parents, raw, inlineMax);
          if (data && data.length === e.size) entry.data = data;
        }
      }
      if (e.kind === 'symlink' && e.target) entry.target = e.target;
      await add(entry);
    }
    await flush();
    return { marker: this.remember(now), ...totals };
  }

  /** Content of a workspace file, read without following a symlink anywhere or blocking on a FIFO. */
  async openFile(path: Uint8Array): Promise<{ size: number; stream: AsyncIterable<Uint8Array>; close: () => Promise<void> }> {
    const parts = splitSyncPath(path);
    const shown = nameFromBytes(path);
    const rootFd = openSyncRoot(this.ws.root);
    let fh: fsp.FileHandle | undefined;
    try {
      const dir = openSyncParent(rootFd, parts);
      if (dir === undefined) throw new HutchError('not_found', `no such file: ${shown}`, { path: shown });
      try {
        fh = await openFileAt(dir, parts[parts.length - 1] as Buffer, constants.O_RDONLY | constants.O_NONBLOCK);
      } catch (err) {
        const code = (err as NodeJS.ErrnoException).code;
        if (code === 'ELOOP') throw new HutchError('bad_request', `${shown} is not a regular file`, { path: shown });
        throw toHutchError(err, { path: shown });
      } finally {
        closeSyncParent(dir, rootFd);
      }
    } finally {
      closeQuietly(rootFd);
    }
    const fst = await fh.stat();
    if (!fst.isFile()) {
      await fh.close();
      throw new HutchError('bad_request', `${shown} is not a regular file`, { path: shown });
    }
    const handle = fh;
    return {
      size: fst.size,
      stream: handle.createReadStream({ autoClose: false, highWaterMark: 128 * 1024 }),
      close: () => handle.close(),
    };
  }

  /** A small file's content for inlining, through its parent's fd; undefined sends the broker to sync.read. */
  private readSmall(parents: SyncParentCache, path: Buffer, max: number): Buffer | undefined {
    try {
      const parts = splitSyncPath(path);
      const dir = parents.get(parts);
      return dir === undefined ? undefined : readSmallFile(at(dir, parts[parts.length - 1] as Buffer), max);
    } catch {
      return undefined;
    }
  }

  private async scan(progress?: () => Promise<void>): Promise<Manifest> {
    const m: Manifest = new Map();
    // Every path, however long: what the sync cannot carry is reported (emit), not taken as gone.
    for await (const e of walk(this.ws.root, { syncListing: !this.opts.threadPoolListing, maxPathBytes: Infinity })) {
      if (progress) await progress();
      let st: BigIntStats | undefined;
      try {
        // Through the walk's held directory fd: what is stat-ed is the entry the walk listed.
        st = lstatSync(at(e.dirFd, e.name), { bigint: true });
      } catch {
        continue; // vanished while scanning: it is not there now
      }
      const base = { size: Number(st.size), mtimeNs: st.mtimeNs, ino: st.ino, mode: Number(st.mode & 0o7777n) };
      const key = nameFromBytes(e.raw);
      if (st.isFile()) m.set(key, { kind: 'file', ...base });
      else if (st.isDirectory()) m.set(key, { kind: 'dir', ...base });
      else if (st.isSymbolicLink()) {
        let target: Buffer | undefined;
        try {
          target = readlinkAt(e.dirFd, e.name);
        } catch {
          continue; // replaced while scanning
        }
        if (target.length > 0) m.set(key, { kind: 'symlink', ...base, target });
      } else m.set(key, { kind: 'other', ...base });
    }
    return m;
  }

  private remember(m: Manifest): string {
    const marker = randomBytes(8).toString('hex');
    this.markers.set(marker, m);
    const keep = this.opts.keepMarkers ?? 4;
    while (this.markers.size > keep) this.markers.delete(this.markers.keys().next().value as string);
    return marker;
  }

  private async applyOne(parents: SyncParentCache, c: SyncChange, content: ContentSource): Promise<void> {
    const owner = this.opts.owner;
    const parts = splitSyncPath(c.path);
    const name = parts[parts.length - 1] as Buffer;
    const shown = nameFromBytes(c.path);
    // Removing never creates parents; everything else does.
    // The parent fd is the cache's (one open per directory for a batch sorted parents first).
    const dir = parents.get(parts, c.op === 'delete' || c.op === 'chmod' ? undefined : { owner });
    if (dir === undefined) {
      // Behind a symlink, a file or a missing directory the entry cannot exist as named.
      if (c.op === 'delete') return;
      throw new HutchError('not_found', `no such file: ${shown}`, { path: shown });
    }
    {
      switch (c.op) {
        case 'write': {
          await clearForReplace(dir, name, 'file');
          const data = content(c);
          const opts = { mode: c.mode, owner, mtimeMs: c.mtimeMs, durable: this.opts.durable ?? false };
          if (data instanceof Uint8Array) writeFileAtomicSyncAt({ dirFd: dir, name }, data, opts);
          else await writeFileAtomic({ dirFd: dir, name }, data, opts);
          return;
        }
        case 'mkdir': {
          if (!lstatAt(dir, name)?.isDirectory()) {
            await clearForReplace(dir, name, 'dir');
            mkdirAt(dir, name, 0o700);
          }
          // Mode and owner through an O_NOFOLLOW fd of the directory itself, never by path.
          const fd = openDirAt(dir, name);
          try {
            fchmodSync(fd, c.mode);
            if (owner) fchownSync(fd, owner.uid, owner.gid);
          } finally {
            closeQuietly(fd);
          }
          return;
        }
        case 'symlink': {
          await clearForReplace(dir, name, 'symlink');
          // The target is stored verbatim and never resolved here: it is data, not a path we use.
          const tmp = Buffer.concat([Buffer.from('.'), name.subarray(0, 64), Buffer.from(`.hutch-${randomBytes(6).toString('hex')}.tmp`)]);
          symlinkSync(Buffer.from(c.target), at(dir, tmp));
          try {
            if (owner) lchownSync(at(dir, tmp), owner.uid, owner.gid);
            renameAt(dir, tmp, dir, name);
          } catch (err) {
            unlinkAt(dir, tmp);
            throw err;
          }
          return;
        }
        case 'delete':
          await removeTreeAt(dir, name);
          return;
        case 'chmod': {
          const st = lstatAt(dir, name);
          if (!st) throw new HutchError('not_found', `no such file: ${shown}`, { path: shown });
          if (st.isSymbolicLink()) return;
          const fd = st.isDirectory() ? openDirAt(dir, name) : undefined;
          if (fd !== undefined) {
            try {
              fchmodSync(fd, c.mode);
            } finally {
              closeQuietly(fd);
            }
            return;
          }
          const fh = await openFileAt(dir, name, constants.O_RDONLY | constants.O_NONBLOCK);
          try {
            await fh.chmod(c.mode);
          } finally {
            await fh.close();
          }
          return;
        }
      }
    }
  }
}

/** A push's record that starts from an empty /work (apply's `fresh`). */
const FRESH = '';
/**
 * What a push removed, to take out of its record once at mark time: a directory removed
 * (deleted, or replaced by a file or link) takes its whole tree with it, except what the
 * push put back under it afterwards. Sequence numbers order the two, and one pass over the
 * record does it however many directories a push removes.
 */
interface PushRecord {
  seq: number;
  /** Directories removed, with when. */
  gone: Map<string, number>;
  /** Entries this push set, with when (entries from the base marker have none). */
  setAt: Map<string, number>;
}

/**
 * Puts an applied entry into a push's record as scan() would see it (`stat`: its fstat,
 * taken when it was created). False when the record can no longer be trusted (an entry
 * found otherwise than pushed: something raced the push).
 */
function recordApplied(m: Manifest, rec: PushRecord, parents: SyncParentCache, c: SyncChange, stat?: BigIntStats): boolean {
  const parts = splitSyncPath(c.path);
  // A scan never lists an in-flight temp name nor anything under one: neither does the record.
  if (parts.some((p) => isAtomicTempName(nameFromBytes(p)))) return true;
  const key = nameFromBytes(c.path);
  const seq = ++rec.seq;
  const wasDir = m.get(key)?.kind === 'dir';
  if (c.op === 'delete') {
    m.delete(key);
    rec.setAt.delete(key);
    if (wasDir) rec.gone.set(key, seq);
    return true;
  }
  const dir = stat ? undefined : parents.get(parts);
  const st = stat ?? (dir === undefined ? undefined : lstatSync(at(dir, parts[parts.length - 1] as Buffer), { bigint: true, throwIfNoEntry: false }));
  const kind = st?.isFile() ? 'file' : st?.isDirectory() ? 'dir' : st?.isSymbolicLink() ? 'symlink' : undefined;
  if (!st || !kind) return false;
  if (c.op !== 'chmod' && kind !== (c.op === 'write' ? 'file' : c.op === 'mkdir' ? 'dir' : 'symlink')) return false;
  const e: ManifestEntry = { kind, size: Number(st.size), mtimeNs: st.mtimeNs, ino: st.ino, mode: Number(st.mode & 0o7777n) };
  // A chmod changes the mode only: if anything else differs from the record, the guest
  // changed the entry since (rewrote the file, replaced a directory by a file) and taking
  // it as pushed would hide that change from the next pull.
  if (c.op === 'chmod') {
    const was = m.get(key);
    if (!was || kind === 'symlink' || !sameEntry(was, { ...e, mode: was.mode })) return false;
  }
  if (kind === 'symlink') {
    // Only a link this push made has a known target (a scan reads it; chmod does not apply to links).
    if (c.op !== 'symlink' || c.target.length === 0) return false;
    e.target = Buffer.from(c.target);
  }
  // A directory replaced by a file or a link took its whole tree with it (clearForReplace).
  if (wasDir && kind !== 'dir') rec.gone.set(key, seq);
  m.set(key, e);
  rec.setAt.set(key, seq);
  return true;
}

/**
 * An entry matches no scan: whatever the guest holds at `path` when the next pull scans
 * (a file, a link, nothing) differs from it and is pulled. Its tree is left as recorded, so
 * each entry under it is still compared with what the guest has.
 */
const UNKNOWN_ENTRY: ManifestEntry = Object.freeze({ kind: 'other', size: -1, mtimeNs: -1n, ino: -1n, mode: -1 });

function recordUnknown(m: Manifest, rec: PushRecord, path: Uint8Array): void {
  const key = nameFromBytes(path);
  m.set(key, UNKNOWN_ENTRY);
  rec.setAt.set(key, ++rec.seq);
}

/** Takes out of the record what lay under a directory the push removed, unless the push set it again after. */
function dropRemovedTrees(m: Manifest, rec: PushRecord): void {
  if (rec.gone.size === 0) return;
  for (const key of m.keys()) {
    const set = rec.setAt.get(key) ?? 0;
    for (let i = key.indexOf('/'); i !== -1; i = key.indexOf('/', i + 1)) {
      const removed = rec.gone.get(key.slice(0, i));
      if (removed !== undefined && removed > set) {
        m.delete(key);
        break;
      }
    }
  }
}

async function clearForReplace(dir: number, name: Buffer, kind: 'file' | 'dir' | 'symlink'): Promise<void> {
  const st = lstatAt(dir, name);
  if (!st) return;
  if (st.isDirectory()) {
    if (kind !== 'dir') await removeTreeAt(dir, name);
  } else if (kind === 'dir') {
    unlinkAt(dir, name);
  }
}

/** Records sent while nothing else goes out, so the broker sees a working guest at least this often. */
const KEEPALIVE_MS = 1000;
const EMPTY_RECORD = encodeFrame({ changes: [], skipped: [] }, SYNC_RECORD_MAX_BYTES);

/** Sends an empty record when nothing went out for KEEPALIVE_MS; `sent()` notes a real record. */
function keepaliveFor(sink: RecordSink): (() => Promise<void>) & { sent(): void } {
  let last = Date.now();
  const fn = async () => {
    if (Date.now() - last < KEEPALIVE_MS) return;
    last = Date.now();
    await sink.write(EMPTY_RECORD);
  };
  return Object.assign(fn, { sent: () => void (last = Date.now()) });
}

function sameEntry(a: ManifestEntry, b: ManifestEntry): boolean {
  if (a.kind !== b.kind || a.mode !== b.mode) return false;
  if (a.kind === 'file' || a.kind === 'other') return a.size === b.size && a.mtimeNs === b.mtimeNs && a.ino === b.ino;
  if (a.kind === 'symlink') return Buffer.compare(a.target as Buffer, b.target as Buffer) === 0;
  return true;
}

