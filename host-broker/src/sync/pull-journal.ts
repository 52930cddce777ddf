import { execFile } from 'node:child_process';
import { closeSync, constants, existsSync, fchmodSync, fdatasyncSync, futimesSync, mkdirSync, openSync, promises as fsp, readFileSync, rmSync, statSync, writeSync } from 'node:fs';
import { join } from 'node:path';
import { setImmediate as yieldToLoop } from 'node:timers/promises';
import { LoopSlicer } from '../../../guest-agent/src/workspace/work-budget.ts';
import { HutchError, toHutchError, type ErrorCode } from '../../../guest-agent/src/protocol/errors.ts';
import { nameFromBytes } from '../../../guest-agent/src/workspace/names.ts';
import { addWithAncestors } from '../../../guest-agent/src/workspace/ancestry.ts';
import { at, closeQuietly, lstatAt, mkdirAt, openDirAt, removeTreeAt, renameAt } from '../../../guest-agent/src/workspace/fd-path.ts';
import { openSyncRoot, splitSyncPath, SyncParentCache } from '../../../guest-agent/src/workspace/sync-path.ts';
import { fsyncPath } from '../lifecycle/snapshot-slots.ts';

/**
 * The host side of a pull, made atomic: a crash at any point leaves the workspace as it
 * was before the call or as it is after it, never a mix.
 *
 *   1. stage: every pulled file and symlink is written (and fsynced) into a staging
 *      directory on the workspace's file system; directories and deletions are noted.
 *   2. commit: the list of operations (the journal) is written, fsynced, and renamed to
 *      its final name. That rename is the commit point.
 *   3. apply: renames from the staging directory into the workspace, mkdirs, deletes.
 *   4. the journal is removed, then the staging directory.
 *
 * Recovery (recoverPullJournal, run where a session is loaded and before every pull)
 * replays a committed journal and discards an uncommitted stage. Replay is idempotent:
 * a staged entry already renamed is simply gone, mkdir of an existing directory only sets
 * its mode, and the operation list is built so a deletion never covers a path the same
 * journal writes (so replaying a delete cannot undo a rename that already happened).
 *
 * Everything a tenant's guest sends is masked here: files and directories land with
 * permission bits only (& 0o777: no setuid, setgid or sticky bit), and only regular
 * files, directories and symlinks are ever created.
 */

/** Staging directory name under the session's state dir. */
const STAGE_IN_STATE = 'sync-pull';
/**
 * Fallback inside the workspace when the state dir is on another file system (a rename
 * across file systems is not atomic). The name is one walk() and the file tools skip
 * (atomic-write's temp pattern), so scans, pushes and listings never see it.
 */
const STAGE_IN_WORKSPACE = '.sync-pull.hutch-stage.tmp';
const JOURNAL = 'journal';
const JOURNAL_TMP = 'journal.tmp';
const FILES = 'f';
/** Operations applied between yields to the event loop (other sessions keep being served). */
const APPLY_SLICE = 256;
/** Staged files fdatasynced one by one; a larger pull flushes its file system once (syncfs). */
const SYNC_EACH_MAX = 64;

export interface PullError {
  /** Workspace-relative path as the API shows it (surrogateescape for non-UTF-8 bytes). */
  path: string;
  code: ErrorCode;
  message: string;
}

type Op =
  | { op: 'write' | 'symlink'; p: string; s: number }
  | { op: 'mkdir'; p: string; m: number }
  | { op: 'delete'; p: string };

/** Points where a test can stop the process (to prove a crash anywhere leaves no mix). */
export type PullHookPoint = 'staged' | 'committed' | 'applying';
export type PullHook = (point: PullHookPoint, detail: { applied?: number }) => void | Promise<void>;

export interface PullStageOptions {
  /** The session's state dir (sessions/<id>/state); the stage goes there when it is on the workspace's file system. */
  stateDir?: string | undefined;
  /** fsync staged files and the journal (default true). */
  durable?: boolean;
  hook?: PullHook | undefined;
}

/** Where a workspace's pulls stage: under the state dir when it shares the workspace's file system. */
export function pullStageDir(workspaceRoot: string, stateDir: string | undefined): string {
  if (stateDir) {
    try {
      if (!existsSync(stateDir)) mkdirSync(stateDir, { recursive: true, mode: 0o700 });
      if (statSync(stateDir).dev === statSync(workspaceRoot).dev) return join(stateDir, STAGE_IN_STATE);
    } catch {
      // an unusable state dir: stage inside the workspace instead
    }
  }
  return join(workspaceRoot, STAGE_IN_WORKSPACE);
}

/**
 * Replays a committed pull journal (idempotently) or discards an uncommitted stage, for
 * both possible stage locations. Synchronous: it runs where a session is loaded, and a
 * leftover exists only after a crash.
 */
export function recoverPullJournal(workspaceRoot: string, stateDir?: string): { replayed: number; discarded: number; errors: PullError[] } {
  const out = { replayed: 0, discarded: 0, errors: [] as PullError[] };
  if (!existsSync(workspaceRoot)) return out;
  const candidates = [join(workspaceRoot, STAGE_IN_WORKSPACE), ...(stateDir ? [join(stateDir, STAGE_IN_STATE)] : [])];
  for (const dir of candidates) {
    if (!existsSync(dir)) continue;
    const journal = join(dir, JOURNAL);
    if (existsSync(journal)) {
      const ops = parseJournal(readFileSync(journal, 'utf8'));
      for (const _ of applySteps(dir, Buffer.from(workspaceRoot), ops, out.errors)) {
        // synchronous replay
      }
      finish(dir);
      out.replayed++;
    } else {
      rmSync(dir, { recursive: true, force: true });
      out.discarded++;
    }
  }
  return out;
}

/** One pull in progress: staged content plus the operations that will make it visible. */
export class PullStage {
  private readonly ops = new Map<string, Op>();
  private seq = 0;
  private needSyncfs = false;
  private state: 'staging' | 'committed' | 'done' = 'staging';
  /** The operations in journal order, as committed (apply uses the same). */
  private ordered: ReturnType<typeof orderOps> | undefined;

  private constructor(
    readonly dir: string,
    private readonly root: Buffer,
    private readonly opts: PullStageOptions,
  ) {}

  static async begin(workspaceRoot: string, opts: PullStageOptions = {}): Promise<PullStage> {
    // A stage left by an earlier pull of this process (or a crash) is settled first.
    recoverPullJournal(workspaceRoot, opts.stateDir);
    const dir = pullStageDir(workspaceRoot, opts.stateDir);
    await fsp.mkdir(join(dir, FILES), { recursive: true, mode: 0o700 });
    await fsp.chmod(dir, 0o700);
    return new PullStage(dir, Buffer.from(workspaceRoot), opts);
  }

  get size(): number {
    return this.ops.size;
  }

  /**
   * Stages a regular file's content; returns its size. Refuses more than maxBytes, with
   * `tooLarge`'s error when given (the limit was the pull's quota, not the file size limit).
   */
  async stageFile(path: Uint8Array, content: Uint8Array | AsyncIterable<Uint8Array>, o: { mode: number; mtimeMs?: number | undefined; maxBytes: number; tooLarge?: (() => HutchError) | undefined }): Promise<number> {
    const key = this.check(path);
    const s = this.seq++;
    const file = join(this.dir, FILES, String(s));
    const tooLarge = o.tooLarge ?? (() => new HutchError('too_large', `${key} is larger than the sync limit of ${o.maxBytes} bytes`, { path: key, limit: o.maxBytes }));
    const syncEach = this.syncEachFile();
    const flags = constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL | constants.O_NOFOLLOW;
    let n = 0;
    if (content instanceof Uint8Array) {
      // Inline content is small: a handful of synchronous syscalls beat six thread-pool round trips.
      if (content.length > o.maxBytes) throw tooLarge();
      const fd = openSync(file, flags, 0o600);
      try {
        for (let off = 0; off < content.length; ) off += writeSync(fd, content, off);
        this.finishStaged(fd, o, syncEach);
      } catch (err) {
        closeSync(fd);
        rmSync(file, { force: true });
        throw err;
      }
      closeSync(fd);
      n = content.length;
    } else {
      // Created 0600 and owned by the broker; the tenant's mode is applied masked, after the content.
      const fh = await fsp.open(file, flags, 0o600);
      try {
        for await (const c of content) {
          n += c.length;
          if (n > o.maxBytes) throw tooLarge();
          await fh.write(c);
        }
        this.finishStaged(fh.fd, o, syncEach);
        await fh.close();
      } catch (err) {
        await fh.close().catch(() => undefined);
        await fsp.rm(file, { force: true });
        throw err;
      }
    }
    this.ops.set(key, { op: 'write', p: b64(path), s });
    return n;
  }

  /** Masked mode, mtime, and (while the pull is small) the file's own fdatasync. */
  private finishStaged(fd: number, o: { mode: number; mtimeMs?: number | undefined }, syncEach: boolean): void {
    fchmodSync(fd, o.mode & 0o777);
    if (o.mtimeMs !== undefined) futimesSync(fd, new Date(), new Date(o.mtimeMs));
    if (syncEach) fdatasyncSync(fd);
  }

  /**
   * Staged content must be on disk before the commit. A small pull fdatasyncs each file;
   * past SYNC_EACH_MAX files one syncfs at the commit is far cheaper than one flush per file.
   */
  private syncEachFile(): boolean {
    if (!(this.opts.durable ?? true)) return false;
    if (this.seq > SYNC_EACH_MAX) this.needSyncfs = true;
    return !this.needSyncfs;
  }

  async stageSymlink(path: Uint8Array, target: Uint8Array): Promise<void> {
    const key = this.check(path);
    const s = this.seq++;
    // The target is data (stored verbatim, never resolved by the broker).
    await fsp.symlink(Buffer.from(target.buffer, target.byteOffset, target.byteLength), join(this.dir, FILES, String(s)));
    this.ops.set(key, { op: 'symlink', p: b64(path), s });
  }

  mkdir(path: Uint8Array, mode: number): void {
    const key = this.check(path);
    this.ops.set(key, { op: 'mkdir', p: b64(path), m: mode & 0o777 });
  }

  delete(path: Uint8Array): void {
    const key = this.check(path);
    this.ops.set(key, { op: 'delete', p: b64(path) });
  }

  /** Makes the pull durable and decided: after this, a crash replays it. */
  async commit(): Promise<void> {
    this.ordered = orderOps(this.ops);
    const { ops } = this.ordered;
    const durable = this.opts.durable ?? true;
    const tmp = join(this.dir, JOURNAL_TMP);
    // 100,000 operations are megabytes of JSON: made in slices, the loop keeps turning.
    const slice = new LoopSlicer();
    const lines: string[] = [];
    for (const o of ops) {
      lines.push(JSON.stringify(o));
      await slice.tick();
    }
    await fsp.writeFile(tmp, lines.join('\n'), { mode: 0o600 });
    if (durable) {
      if (this.needSyncfs) await syncFileSystem(this.dir);
      fsyncPath(tmp);
      fsyncPath(join(this.dir, FILES));
    }
    await this.opts.hook?.('staged', {});
    await fsp.rename(tmp, join(this.dir, JOURNAL));
    if (durable) fsyncPath(this.dir);
    this.state = 'committed';
    await this.opts.hook?.('committed', {});
  }

  /** Applies a committed pull to the workspace; returns the entries that could not be applied. */
  async apply(): Promise<{ errors: PullError[]; applied: Array<{ key: string; op: Op['op'] }> }> {
    if (this.state !== 'committed') throw new HutchError('internal', 'pull applied before it was committed');
    const { ops, keys } = this.ordered ?? orderOps(this.ops);
    const errors: PullError[] = [];
    let i = 0;
    for (const step of applySteps(this.dir, this.root, ops, errors, removeTreeAt)) {
      if (step) await step;
      if (++i % APPLY_SLICE === 0) {
        await this.opts.hook?.('applying', { applied: i });
        await yieldToLoop();
      }
    }
    finish(this.dir);
    this.state = 'done';
    const failed = new Set(errors.map((e) => e.path));
    // The keys the ops were made from: no decoding 100,000 paths back in one turn of the loop.
    const applied = ops.map((o, i) => ({ key: keys[i] as string, op: o.op })).filter((o) => !failed.has(o.key));
    return { errors, applied };
  }

  /** Drops an uncommitted stage (the pull failed before its commit point). */
  async discard(): Promise<void> {
    if (this.state === 'committed') return; // decided: the next recovery replays it
    await fsp.rm(this.dir, { recursive: true, force: true });
    this.state = 'done';
  }

  /** Validates a path from the guest (typed error if the host cannot take it); returns its display form. */
  private check(path: Uint8Array): string {
    splitSyncPath(path);
    return nameFromBytes(path);
  }
}

/**
 * The journal's operation order: deletions deepest first, then the rest parents first.
 * A deletion that is, or is an ancestor of, a path the journal writes is dropped (the
 * write replaces the entry anyway), so a replayed deletion can never remove what an
 * earlier pass of the same journal put in place.
 */
function orderOps(all: Map<string, Op>): { ops: Op[]; keys: string[] } {
  const written = new Set<string>();
  for (const [k, o] of all) {
    if (o.op === 'delete') continue;
    addWithAncestors(written, k);
  }
  const sorted = [...all.keys()].sort();
  const deletes = sorted.filter((k) => all.get(k)?.op === 'delete' && !written.has(k)).reverse();
  const rest = sorted.filter((k) => all.get(k)?.op !== 'delete');
  const keys = [...deletes, ...rest];
  return { ops: keys.map((k) => all.get(k) as Op), keys };
}

/**
 * How a directory in the way is removed: by a pull, through fds and yielding to the loop
 * between entries (removeTreeAt: a tenant's tree of 2,000 nested directories held the
 * broker's loop 0.8 s in one synchronous rm); by the replay at open, synchronously.
 */
type RemoveTree = (dirFd: number, name: Buffer) => Promise<void> | void;
const removeTreeSync: RemoveTree = (dirFd, name) => rmSync(at(dirFd, name), { recursive: true, force: true });

/**
 * Applies operations one by one, yielding after each; each is safe to run twice. Every
 * entry is reached through its parent directory's fd, opened without following symlinks
 * (sync-path.ts), and staged entries move in with rename(2) between two held directories.
 * An operation still under way (a tree's removal) is the yielded promise, to await before
 * the next.
 */
function* applySteps(stageDir: string, root: Buffer, ops: Op[], errors: PullError[], removeTree: RemoveTree = removeTreeSync): Generator<Promise<void> | undefined> {
  const rootFd = openSyncRoot(root);
  // Operations come parents first, so consecutive ones mostly share a parent: open it once.
  const parents = new SyncParentCache(rootFd);
  let filesFd: number | undefined;
  try {
    filesFd = openSyncRoot(join(stageDir, FILES));
  } catch {
    // no staged files (a journal of mkdirs and deletes, or all moved in before a crash)
  }
  try {
    for (const o of ops) {
      const raw = Buffer.from(o.p, 'base64');
      const failed = (err: unknown) => {
        const path = nameFromBytes(raw);
        const e = toHutchError(err, { path });
        errors.push({ path, code: e.code, message: e.message });
      };
      let pending: Promise<void> | void = undefined;
      try {
        pending = applyOne(parents, filesFd, raw, o, removeTree);
      } catch (err) {
        failed(err);
      }
      yield pending ? pending.catch(failed) : undefined;
    }
  } finally {
    parents.close();
    closeQuietly(rootFd);
    if (filesFd !== undefined) closeQuietly(filesFd);
  }
}

function applyOne(parents: SyncParentCache, filesFd: number | undefined, raw: Buffer, o: Op, removeTree: RemoveTree): Promise<void> | void {
  const parts = splitSyncPath(raw);
  const name = parts[parts.length - 1] as Buffer;
  if (o.op === 'write' || o.op === 'symlink') {
    const staged = Buffer.from(String(o.s));
    if (filesFd === undefined || !lstatAt(filesFd, staged)) return; // moved into place before a crash
  }
  // A deletion behind a symlink or a file has nothing to delete; everything else makes its parents.
  // The parent fd belongs to the cache. An operation changes only its own entry, never
  // its parent, so the cached fd stays the directory it names.
  const dir = parents.get(parts, o.op === 'delete' ? undefined : {});
  if (dir === undefined) return;
  {
    const st = lstatAt(dir, name);
    switch (o.op) {
      case 'delete':
        // The broker is the only writer of the host workspace while it pulls (calls of a
        // session are serialised), so a recursive rm under the held parent is safe here.
        // The parent fd stays the cache's until the next operation, which waits for this one.
        if (st) return removeTree(dir, name);
        return;
      case 'mkdir': {
        if (!st?.isDirectory()) {
          if (st) rmSync(at(dir, name), { force: true });
          mkdirAt(dir, name, 0o700);
        }
        const fd = openDirAt(dir, name);
        try {
          fchmodSync(fd, o.m & 0o777);
        } finally {
          closeQuietly(fd);
        }
        return;
      }
      case 'write':
      case 'symlink': {
        const moveIn = () => renameAt(filesFd as number, Buffer.from(String(o.s)), dir, name);
        const removing = st?.isDirectory() ? removeTree(dir, name) : undefined;
        if (removing) return removing.then(moveIn);
        moveIn();
        return;
      }
    }
  }
}

/** The journal goes first (from then on a leftover stage is uncommitted and simply discarded), then the stage. */
function finish(dir: string): void {
  const journal = join(dir, JOURNAL);
  if (existsSync(journal)) {
    rmSync(journal, { force: true });
    fsyncPath(dir);
  }
  rmSync(dir, { recursive: true, force: true });
}

function parseJournal(text: string): Op[] {
  return text
    .split('\n')
    .filter((l) => l.length > 0)
    .map((l) => JSON.parse(l) as Op);
}

/** syncfs(2) of the file system holding `dir` (Node has no binding; coreutils' `sync -f` is that call). */
async function syncFileSystem(dir: string): Promise<void> {
  await new Promise<void>((resolve, reject) => {
    execFile('sync', ['-f', dir], (err) => (err ? reject(new HutchError('internal', `sync -f ${dir} failed: ${err.message}`)) : resolve()));
  });
}

function b64(p: Uint8Array): string {
  return Buffer.from(p.buffer, p.byteOffset, p.byteLength).toString('base64');
}

