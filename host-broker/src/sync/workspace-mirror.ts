import { constants, promises as fsp } from 'node:fs';
import { basename, dirname, join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { HutchError, toHutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { SYNC_PATH_MAX_BYTES, type ResultOf, type SyncEntry } from '../../../guest-agent/src/protocol/methods.ts';
import { AncestorTest } from '../../../guest-agent/src/workspace/ancestry.ts';
import { closeQuietly } from '../../../guest-agent/src/workspace/fd-path.ts';
import type { Workspace } from '../../../guest-agent/src/workspace/confine.ts';
import { hasEscapedBytes, nameFromBytes, nameToBytes } from '../../../guest-agent/src/workspace/names.ts';
import type { WorkspaceSync } from '../../../guest-agent/src/workspace/sync.ts';
import { readSmallFile } from '../../../guest-agent/src/workspace/sync-path.ts';
import { LoopSlicer } from '../../../guest-agent/src/workspace/work-budget.ts';
import type { AgentClient } from '../agent-client.ts';
import { diffManifests, HostTree, scanTree, TICK_EVERY, type Manifest, type ManifestEntry } from './manifest.ts';
import { PullStage, type PullError, type PullHook } from './pull-journal.ts';

export type { PullError } from './pull-journal.ts';

/** Files up to this size travel inline in a batch; larger ones on their own stream. */
const INLINE_MAX = 256 * 1024;
/** Estimated bytes per sync.apply batch (paths, targets, inline data): well under the 1 MiB frame limit. */
const BATCH_BYTES = 512 * 1024;
/** Streamed files per sync.apply batch (each holds an open file on the host). */
const BATCH_STREAMS = 8;
/** Estimated msgpack overhead of one change besides its path, target and data. */
const CHANGE_OVERHEAD_BYTES = 96;
/** Host paths a push checks one by one; more and it scans the whole tree once. */
const PARTIAL_PUSH_MAX = 1024;
/** Inline files of a change-set batch staged at once. */
const STAGE_CONCURRENCY = 16;

export interface PushStats {
  files: number;
  bytes: number;
  removed: number;
  /** Entries sent to the guest (writes, directories, links, deletions). */
  sent: number;
  ms: number;
  /** Host entries left out: their paths are longer than a sync path may be, or than the host can open by path (a tree made deep through relative names). */
  tooLong: number;
  /** With `mark`: the sync marker taken right after the push (undefined from an agent that predates it). */
  marker?: { marker: string; entries: number; markedBy?: 'recorded' | 'scan' | undefined } | undefined;
}

export interface PushOptions {
  /** The guest's /work was empty when this mirror was made (a pristine restore): it may record the push instead of scanning. */
  fresh?: boolean;
  /** Take the sync marker in the push's last round trip. */
  mark?: boolean;
  /**
   * With `mark`: when nothing needs sending, send nothing and take no marker (the caller's
   * marker still describes the guest). A host change that turns out to be what the guest
   * already has (a pull's own writes seen by the watcher, a fast-path call that only read)
   * then costs no round trip and no scan of the guest's tree.
   */
  markOnlyIfSent?: boolean;
  /**
   * The marker the caller last pulled from: the guest takes the new marker from it plus
   * what this push applied, so guest changes made since that pull are not lost (agent
   * WorkspaceSync.apply explains).
   */
  since?: string;
}

export interface PullStats {
  files: number;
  bytes: number;
  deleted: number;
  ms: number;
  /**
   * Everything of this pull that did not reach the host, typed: what the sync cannot carry
   * (`unsupported_file_type`, `too_large`), names the host cannot create (`invalid_name`,
   * `outside_workspace`), and entries that failed to apply. The call's result carries it.
   */
  errors: PullError[];
  /** Errors past the first MAX_REPORTED_PULL_ERRORS: counted, not listed (a guest can make 200,000 FIFOs). */
  errorsOmitted: number;
  /** The errors that are entries the sync cannot carry (type, size), as {path, reason}. */
  skipped: Array<{ path: string; reason: string }>;
  /** The other errors (the entry was carried but could not be applied). */
  failed: Array<{ path: string; code: string; message: string }>;
}

export interface PullOptions {
  /** Have the agent answer agent.state in the pull's last round trip. */
  state?: { maxPaths: number };
  /** The session's workspace quota: the most this pull may stage on the host (PullBudget). */
  quota?: { bytes: number; files: number } | undefined;
}

export interface MirrorOptions {
  /**
   * The session's state dir (sessions/<id>/state), where a pull stages its files. Default:
   * the `state` sibling of a session's `workspace` dir; anything else stages inside the
   * workspace under a name scans skip.
   */
  stateDir?: string;
  /** fsync staged pulls (default true). */
  durable?: boolean;
  /** Test hook at the pull's commit points (crash tests). */
  hook?: PullHook;
}

type Change = Parameters<AgentClient['syncApply']>[0][number];
/** Linux's PATH_MAX, the terminating NUL included: the longest path the host opens by name. */
const PATH_MAX_BYTES = 4096;
type PushItem = { rel: string; remove: true } | { rel: string; remove?: false; entry: ManifestEntry };

/**
 * Mirrors the host workspace (the source of truth) into a guest and the guest's changes
 * back. It remembers what the guest holds (`guestView`, entry metadata), so a push after
 * host-side edits, or after a restore from a snapshot slot, carries only what differs.
 * Both directions move in bounded batches whatever the number of files; a pull lands on
 * the host atomically (pull-journal.ts). Names are bytes on the wire; `guestView` keys
 * them by their surrogateescape strings.
 */
export class WorkspaceMirror {
  /** What the guest's /work holds, as far as the broker knows; undefined before a push. */
  guestView: Manifest | undefined;
  /**
   * Paths the guest holds that a pull could not bring to the host (their errors were on
   * those calls). Only the guest has them: a release that kills the VM instead of
   * snapshotting it loses them, so the release decision should weigh a non-empty set.
   */
  readonly unpulled = new Set<string>();
  /**
   * More paths went unpulled than `unpulled` keeps (MAX_UNPULLED): the guest is taken to
   * hold some of them for as long as this mirror lives (its VM is kept, never killed).
   */
  unpulledOverflow = false;
  private readonly stateDir: string | undefined;

  constructor(
    private readonly hostWs: Workspace,
    /** Unused since pulls are journaled here; kept so callers keep their shape. */
    _hostSync?: WorkspaceSync,
    private readonly opts: MirrorOptions = {},
  ) {
    this.stateDir = opts.stateDir ?? (basename(hostWs.root) === 'workspace' ? join(dirname(hostWs.root), 'state') : undefined);
  }

  /** Makes the guest's workspace equal to the host's, sending only what differs from `guestView`. */
  async push(agent: AgentClient, only?: Iterable<string>, opts: PushOptions = {}): Promise<PushStats> {
    const tree = new HostTree(this.hostWs.root);
    try {
      return await this.pushWith(tree, agent, only, opts);
    } finally {
      tree.close();
    }
  }

  private async pushWith(tree: HostTree, agent: AgentClient, only: Iterable<string> | undefined, opts: PushOptions): Promise<PushStats> {
    const t0 = performance.now();
    const before: Manifest = this.guestView ?? new Map();
    const onlyList = only ? [...only] : undefined;
    let host: Manifest;
    let guestSubset: Manifest = before;
    // A watcher's path with U+FFFD lost the name's real bytes, and a name that is not UTF-8
    // cannot be a string path for walk(): for those only a full scan finds the entry.
    // And past PARTIAL_PUSH_MAX paths (a watcher that saw a pull land 100,000 files) one
    // scan of the tree costs less than that many partial ones.
    if (onlyList && this.guestView && onlyList.length <= PARTIAL_PUSH_MAX && !onlyList.some((p) => p.includes('\ufffd') || hasEscapedBytes(p))) {
      // Only these paths (and what is under them) may have changed on the host.
      host = new Map();
      guestSubset = new Map();
      // A path under another listed one is in that one's subtree scan: a pull that landed a
      // chain of 2,000 directories lists every level, and scanning each level's subtree
      // was quadratic in the depth (minutes of the broker's time for one push).
      const listed = new Set(onlyList);
      const covered = new AncestorTest((a) => listed.has(a));
      for (const p of onlyList) if (!covered.anyAncestor(p)) await this.scanPath(tree, p, host, guestSubset, before);
    } else host = await scanTree(this.hostWs.root);
    const diff = await diffManifests(host, guestSubset);
    const remove = diff.remove;
    // A host path no sync path can carry, or the host cannot open by its path: the guest
    // never sees it (a scan does not list those; a watcher's path can name one).
    const maxRel = Math.min(SYNC_PATH_MAX_BYTES, PATH_MAX_BYTES - 1 - Buffer.byteLength(this.hostWs.root) - 1);
    const write = diff.write.filter((rel) => nameToBytes(rel).length <= maxRel);
    const items: PushItem[] = [
      ...remove.map((rel): PushItem => ({ rel, remove: true })),
      ...write.map((rel): PushItem => ({ rel, entry: host.get(rel) as ManifestEntry })),
    ];
    const { files, bytes, sent, marker } = await this.send(tree, agent, items, opts);
    const view: Manifest = this.guestView ?? new Map();
    await removeWithChildren(view, new Set(remove));
    for (const p of sent) view.set(p, host.get(p) as ManifestEntry);
    this.guestView = view;
    return { files, bytes, removed: remove.length, sent: sent.length, ms: performance.now() - t0, tooLong: diff.write.length - write.length, marker };
  }

  /**
   * Brings back what changed in the guest since `marker`, atomically: the host workspace
   * ends as it was or with every carried change, never a mix, even if the broker dies
   * midway. Returns the new marker and, in `stats.errors`, everything not carried.
   */
  async pull(agent: AgentClient, marker: string, maxFileBytes: number, opts: PullOptions = {}): Promise<{ marker: string; stats: PullStats; state?: ResultOf<'agent.state'> | undefined }> {
    const t0 = performance.now();
    const stage = await PullStage.begin(this.hostWs.root, { stateDir: this.stateDir, durable: this.opts.durable ?? true, hook: this.opts.hook });
    const errors = new PullErrorLog();
    const fetchLater: SyncEntry[] = [];
    const counts = { files: 0, bytes: 0, deleted: 0 };
    const budget = new PullBudget(opts.quota);
    let newMarker: string;
    let state: ResultOf<'agent.state'> | undefined;
    const slice = new LoopSlicer();
    try {
      const r = await agent.syncChanges({ since: marker, inlineMaxBytes: INLINE_MAX, maxFileBytes, ...(opts.state ? { state: opts.state } : {}) }, async (batch) => {
        for (const s of batch.skipped) {
          // What cannot be carried is still an entry of the guest's /work: within the quota.
          budget.entry(s);
          errors.push({ path: nameFromBytes(s.path), code: s.code, message: s.message });
        }
        for (let i = 0; i < batch.changes.length; i += STAGE_CONCURRENCY) {
          // Small files stage with synchronous syscalls and buffered records arrive without
          // a turn of the loop: a 100,000-file pull held it for a second at a time.
          await slice.tick();
          const part = batch.changes.slice(i, i + STAGE_CONCURRENCY);
          await settleAll(part.map((e) => this.stageEntry(agent, stage, e, maxFileBytes, budget, fetchLater, errors, counts)));
        }
      });
      newMarker = r.marker;
      state = r.state;
      // Files too large to inline come one by one on their own streams, after the change set.
      for (const e of fetchLater) {
        await this.guardEntry(agent, e, errors, async () => {
          budget.entry(e);
          // The stream is cut at what the quota has left, whatever size the guest announced.
          const room = budget.roomFor(e, maxFileBytes);
          const n = await stage.stageFile(e.path, agent.syncReadStream(e.path), { mode: e.mode ?? 0o644, mtimeMs: e.mtimeMs, ...room });
          budget.file(e, n);
          counts.bytes += n;
          counts.files++;
        });
      }
      if (stage.size > 0) {
        await stage.commit();
        const applied = await stage.apply();
        for (const e of applied.errors) errors.push(e);
        await this.noteApplied(applied.applied);
      } else await stage.discard();
    } catch (err) {
      await stage.discard().catch(() => undefined);
      throw err;
    }
    for (const p of errors.paths) {
      if (this.unpulled.size < MAX_UNPULLED) this.unpulled.add(p);
      else this.unpulledOverflow = true;
    }
    if (errors.pathsOmitted) this.unpulledOverflow = true;
    const carryLimits = new Set(['too_large', 'unsupported_file_type']);
    const listed = errors.listed;
    return {
      marker: newMarker,
      state,
      stats: {
        ...counts,
        ms: performance.now() - t0,
        errors: listed,
        errorsOmitted: errors.omitted,
        skipped: listed.filter((e) => carryLimits.has(e.code)).map((e) => ({ path: e.path, reason: e.message })),
        failed: listed.filter((e) => !carryLimits.has(e.code)),
      },
    };
  }

  private async stageEntry(
    agent: AgentClient,
    stage: PullStage,
    e: SyncEntry,
    maxFileBytes: number,
    budget: PullBudget,
    fetchLater: SyncEntry[],
    errors: PullErrorLog,
    counts: { files: number; bytes: number; deleted: number },
  ): Promise<void> {
    await this.guardEntry(agent, e, errors, async () => {
      switch (e.kind) {
        case 'deleted':
          budget.deletion(e);
          stage.delete(e.path);
          counts.deleted++;
          return;
        case 'dir':
          budget.entry(e, BLOCK);
          stage.mkdir(e.path, e.mode ?? 0o755);
          return;
        case 'symlink':
          if (!e.target) throw new HutchError('bad_request', `symlink ${nameFromBytes(e.path)} came without a target`);
          budget.entry(e);
          await stage.stageSymlink(e.path, e.target);
          return;
        case 'file':
          if ((e.size ?? 0) > maxFileBytes) throw new HutchError('too_large', `${nameFromBytes(e.path)} is ${e.size} bytes, above the sync limit of ${maxFileBytes}`);
          if (!e.data) {
            fetchLater.push(e);
            return;
          }
          budget.entry(e);
          budget.file(e, e.data.length);
          counts.bytes += await stage.stageFile(e.path, e.data, { mode: e.mode ?? 0o644, mtimeMs: e.mtimeMs, maxBytes: maxFileBytes });
          counts.files++;
          return;
      }
    });
  }

  /** One entry's failure is that entry's typed error; a dead channel or a full host disk fails the whole pull. */
  private async guardEntry(agent: AgentClient, e: SyncEntry, errors: PullErrorLog, fn: () => Promise<void>): Promise<void> {
    try {
      await fn();
    } catch (err) {
      const path = nameFromBytes(e.path);
      const he = toHutchError(err, { path });
      if (!agent.connection.isOpen || FATAL_PULL_CODES.has(he.code)) throw he;
      errors.push({ path, code: he.code, message: he.message });
    }
  }

  /** The guest now holds what the host holds for the applied paths. */
  private async noteApplied(applied: Array<{ key: string; op: string }>): Promise<void> {
    const deleted = new Set<string>();
    for (const a of applied) {
      this.unpulled.delete(a.key);
      if (a.op === 'delete') deleted.add(a.key);
    }
    if (deleted.size) {
      const under = new AncestorTest((p) => deleted.has(p));
      const slice = new LoopSlicer();
      let n = 0;
      for (const u of [...this.unpulled]) {
        if (++n % TICK_EVERY === 0) await slice.tick();
        if (under.anyAncestor(u)) this.unpulled.delete(u);
      }
    }
    const view = this.guestView ?? new Map();
    await removeWithChildren(view, deleted);
    const slice = new LoopSlicer();
    const tree = new HostTree(this.hostWs.root);
    try {
      for (const a of applied) {
        if (a.op === 'delete') continue;
        // An lstat per entry: 100,000 of them held the loop for most of a second, every
        // other session's calls behind them. Others go between slices.
        await slice.tick();
        const e = tree.stat(a.key);
        if (e) view.set(a.key, e);
        else view.delete(a.key);
      }
    } finally {
      tree.close();
    }
    this.guestView = view;
  }

  private async scanPath(tree: HostTree, p: string, host: Manifest, guestSubset: Manifest, before: Manifest): Promise<void> {
    // The path, its ancestors (a write may have created them) and, for a directory, its
    // subtree. Up from the path to the first ancestor an earlier path already took (whose
    // own ancestors it took too), then down: a tenant's path can be 2,000 levels deep, and
    // rebuilding and stat-ing every prefix of every path held the loop for each.
    const slice = new LoopSlicer();
    const chain: string[] = [];
    for (let q: string | undefined = p; q !== undefined && !host.has(q) && !guestSubset.has(q); ) {
      chain.push(q);
      const i = q.lastIndexOf('/');
      q = i > 0 ? q.slice(0, i) : undefined;
    }
    for (const q of chain.reverse()) {
      await slice.tick();
      const e = tree.stat(q);
      if (e) host.set(q, e);
      const g = before.get(q);
      if (g) guestSubset.set(q, g);
    }
    const top = host.get(p);
    const dirFd = top?.kind === 'dir' ? tree.openDir(p) : undefined;
    if (dirFd !== undefined) {
      try {
        for (const [k, v] of await scanTree(dirFd)) host.set(`${p}/${k}`, v);
      } finally {
        closeQuietly(dirFd);
      }
    }
    // Only a directory has a subtree the guest may hold (this walks the whole view: keep it to directories).
    if (top?.kind === 'dir' || before.get(p)?.kind === 'dir') {
      const prefix = `${p}/`;
      let n = 0;
      for (const [k, v] of before) {
        if (++n % TICK_EVERY === 0) await slice.tick();
        if (k.startsWith(prefix)) guestSubset.set(k, v);
      }
    }
  }

  /** Sends a push plan in batches bounded by bytes and streams; contents are read only as their batch fills. */
  private async send(tree: HostTree, agent: AgentClient, items: PushItem[], opts: PushOptions): Promise<{ files: number; bytes: number; sent: string[]; marker: PushStats['marker'] }> {
    let marker: PushStats['marker'];
    let files = 0;
    let bytes = 0;
    const sent: string[] = [];
    let batch: Change[] = [];
    let batchPaths: string[] = [];
    let batchBytes = 0;
    let streams = 0;
    const flush = async (last = false) => {
      if (batch.length === 0 && !(last && opts.mark && !(opts.markOnlyIfSent && sent.length === 0))) return;
      const r = await agent.syncApply(batch, { ...(opts.fresh ? { fresh: true } : {}), ...(opts.since ? { since: opts.since } : {}), ...(last && opts.mark ? { mark: true } : {}) });
      if (r.marker !== undefined) marker = { marker: r.marker, entries: r.entries ?? 0, markedBy: r.markedBy };
      if (r.failed.length) {
        const f = r.failed[0] as { path: Uint8Array; code: string; message: string };
        throw new HutchError('internal', `workspace push failed for ${r.failed.length} entries, first ${nameFromBytes(f.path)}: ${f.code} ${f.message}`, { failed: r.failed.length });
      }
      sent.push(...batchPaths);
      batch = [];
      batchPaths = [];
      batchBytes = 0;
      streams = 0;
    };
    for (const item of items) {
      const path = nameToBytes(item.rel);
      const change = item.remove ? ({ op: 'delete', path } as Change) : await this.describe(tree, item.rel, path, item.entry);
      if (!change) continue;
      const streamed = 'source' in change;
      const size = 'data' in change && change.data ? change.data.length : 0;
      const cost = CHANGE_OVERHEAD_BYTES + path.length + ('target' in change ? change.target.length : 0) + size;
      if (batch.length > 0 && (batchBytes + cost > BATCH_BYTES || (streamed && streams >= BATCH_STREAMS))) await flush();
      if (change.op === 'write') {
        files++;
        bytes += streamed ? (item.remove ? 0 : item.entry.size) : size;
      }
      if (streamed) streams++;
      batch.push(change);
      batchPaths.push(item.rel);
      batchBytes += cost;
    }
    await flush(true);
    return { files, bytes, sent, marker };
  }

  private async describe(tree: HostTree, rel: string, path: Buffer, e: ManifestEntry): Promise<Change | undefined> {
    if (e.kind === 'dir') return { op: 'mkdir', path, mode: e.mode };
    if (e.kind === 'symlink') return { op: 'symlink', path, target: nameToBytes(e.target as string) };
    // Vanished, or a directory on the way became a link since the scan: the next push sees it.
    const abs = tree.locate(rel);
    if (!abs) return undefined;
    if (e.size <= INLINE_MAX) {
      // Small files are read synchronously: a push may carry 100,000 of them.
      const data = readSmallFile(abs, INLINE_MAX);
      return data ? { op: 'write', path, mode: e.mode, mtimeMs: e.mtimeMs, data } : undefined;
    }
    // The located parent is the tree's until its next lookup, and this push's tree is its own.
    const fh = await fsp.open(abs, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK).catch(() => undefined);
    if (!fh) return undefined;
    const source = (async function* () {
      try {
        for await (const c of fh.createReadStream({ autoClose: false, highWaterMark: 128 * 1024 })) yield c as Buffer;
      } finally {
        await fh.close();
      }
    })();
    return { op: 'write', path, mode: e.mode, mtimeMs: e.mtimeMs, source };
  }
}

/** Errors that mean the pull as a whole cannot be trusted: it is discarded and the call fails. */
const FATAL_PULL_CODES = new Set(['no_space', 'quota_exceeded', 'connection_closed', 'guest_crashed', 'cancelled', 'timeout']);

/** Errors a pull lists one by one in its result; past this it counts them. */
export const MAX_REPORTED_PULL_ERRORS = 100;
/** Unpulled paths a mirror remembers (each up to 4 KiB); past this it only knows there are more. */
const MAX_UNPULLED = 10_000;

/**
 * A pull's errors: the first MAX_REPORTED_PULL_ERRORS listed, the rest counted, and the paths
 * for `unpulled` up to MAX_UNPULLED. A tenant's 200,000 FIFOs with 4 KiB paths would
 * otherwise be a call result of close to a gigabyte, built in the broker's memory.
 */
class PullErrorLog {
  readonly listed: PullError[] = [];
  omitted = 0;
  readonly paths: string[] = [];
  pathsOmitted = 0;

  push(e: PullError): void {
    if (this.listed.length < MAX_REPORTED_PULL_ERRORS) this.listed.push(e);
    else this.omitted++;
    if (this.paths.length < MAX_UNPULLED) this.paths.push(e.path);
    else this.pathsOmitted++;
  }
}

/** Allocation unit the budget assumes on the host (as the quota's planned writes do). */
const BLOCK = 4096;

/**
 * What one pull may stage on the host: at most the session's quota, in allocated bytes and
 * entries. The guest's /work is sized to the quota, but what it holds is not what the host
 * would store: a file hard-linked 1,000 times there is 1,000 files here, and a sparse file
 * is written out in full. Without this a tenant fills the host's disk for every tenant
 * (measured: 4 MB and 50 links in an 8 MiB-quota VM put 322 MB in its host workspace).
 * Everything staged ends in the tree the pull commits, so staging beyond the quota is
 * never a workspace within it: the pull fails whole, typed, and the guest keeps its changes.
 */
/** Deletions a pull may report beyond the entry quota (the quota counts what the host holds, the guest's marker may differ by a few). */
const DELETION_SLACK = 1024;

class PullBudget {
  private bytes = 0;
  private entries = 0;
  private deletions = 0;

  constructor(private readonly quota: { bytes: number; files: number } | undefined) {}

  /** Counts an entry (and `bytes` of allocation for it), refusing one beyond the quota. */
  entry(e: { path: Uint8Array }, bytes = 0): void {
    if (!this.quota) return;
    this.entries++;
    this.bytes += bytes;
    if (this.entries > this.quota.files) throw this.over(e, 'files');
    if (this.bytes > this.quota.bytes) throw this.over(e, 'bytes');
  }

  /**
   * Counts a deletion. An honest agent reports at most what its marker held, which /work's
   * inode limit keeps within the entry quota; a compromised one could send deletion records
   * without end, each kept in the stage's memory until the pull ends.
   */
  deletion(e: { path: Uint8Array }): void {
    if (!this.quota) return;
    if (++this.deletions > this.quota.files + DELETION_SLACK) {
      throw new HutchError('quota_exceeded', `the guest reported more than ${this.quota.files + DELETION_SLACK} deletions in one pull, more than its /work can hold entries (at ${nameFromBytes(e.path)}); nothing was carried back`, {
        limit: 'files',
        quota: this.quota.files,
        path: nameFromBytes(e.path),
      });
    }
  }

  /** Counts a file's content as the host allocates it. */
  file(e: SyncEntry, size: number): void {
    if (!this.quota) return;
    this.bytes += Math.ceil(size / BLOCK) * BLOCK;
    if (this.bytes > this.quota.bytes) throw this.over(e, 'bytes');
  }

  /** The most a streamed file may bring, and the error past it when that is the quota's doing. */
  roomFor(e: SyncEntry, maxFileBytes: number): { maxBytes: number; tooLarge?: () => HutchError } {
    const left = this.quota ? this.quota.bytes - this.bytes : Infinity;
    return left < maxFileBytes ? { maxBytes: Math.max(0, left), tooLarge: () => this.over(e, 'bytes') } : { maxBytes: maxFileBytes };
  }

  private over(e: { path: Uint8Array }, limit: 'bytes' | 'files'): HutchError {
    const q = this.quota ?? { bytes: 0, files: 0 };
    const what = limit === 'bytes' ? `more than the workspace quota of ${q.bytes} bytes` : `more than the workspace quota of ${q.files} files`;
    return new HutchError(
      'quota_exceeded',
      `workspace quota exceeded: the guest's changes to /work take ${what} on the host (hard links and sparse files count in full there), at ${nameFromBytes(e.path)}; nothing was carried back: remove files in the VM`,
      { limit, quota: q[limit], path: nameFromBytes(e.path), quotaBytes: q.bytes, quotaFiles: q.files },
    );
  }
}

/** Waits for every promise, then throws the first failure (none is left running behind the throw). */
async function settleAll(ps: Array<Promise<void>>): Promise<void> {
  const rs = await Promise.allSettled(ps);
  for (const r of rs) if (r.status === 'rejected') throw r.reason;
}

/**
 * Removes the given paths and everything under them from a manifest, in one pass that
 * yields to the loop (the view holds up to the quota's entries, at any depth). Exported
 * for bench/loop-gaps.ts.
 */
export async function removeWithChildren(view: Manifest, gone: Set<string>): Promise<void> {
  if (gone.size === 0) return;
  const under = new AncestorTest((p) => gone.has(p));
  const slice = new LoopSlicer();
  let n = 0;
  for (const k of [...view.keys()]) {
    if (++n % TICK_EVERY === 0) await slice.tick();
    if (under.selfOrAncestor(k)) view.delete(k);
  }
}
