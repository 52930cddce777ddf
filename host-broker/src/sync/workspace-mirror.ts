import { constants, promises as fsp } from 'node:fs';
import { performance } from 'node:perf_hooks';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { SyncChange, SyncEntry } from '../../../guest-agent/src/protocol/methods.ts';
import type { Workspace } from '../../../guest-agent/src/workspace/confine.ts';
import type { WorkspaceSync } from '../../../guest-agent/src/workspace/sync.ts';
import type { AgentClient } from '../agent-client.ts';
import { diffManifests, scanTree, statEntry, type Manifest, type ManifestEntry } from './manifest.ts';

/** Files up to this size travel inline in the batch; larger ones on their own stream. */
const INLINE_MAX = 256 * 1024;
/** Inline bytes per sync.apply batch (well under the frame limit). */
const BATCH_BYTES = 512 * 1024;
const BATCH_STREAMS = 8;

export interface PushStats {
  files: number;
  bytes: number;
  removed: number;
  ms: number;
}

export interface PullStats {
  files: number;
  bytes: number;
  deleted: number;
  ms: number;
  skipped: Array<{ path: string; reason: string }>;
  failed: Array<{ path: string; code: string; message: string }>;
}

type Change = Parameters<AgentClient['syncApply']>[0][number];

/**
 * Mirrors the host workspace (the source of truth) into a guest and the guest's changes
 * back. It remembers what the guest holds (`guestView`, entry metadata), so a push after
 * host-side edits, or after a restore from a snapshot slot, carries only what differs.
 * Both directions go through the WorkspaceSync primitives: every file lands atomically,
 * symlinks stay symlinks and are never followed.
 */
export class WorkspaceMirror {
  /** What the guest's /work holds, as far as the broker knows; undefined before a push. */
  guestView: Manifest | undefined;

  constructor(
    private readonly hostWs: Workspace,
    private readonly hostSync: WorkspaceSync,
  ) {}

  /** Makes the guest's workspace equal to the host's, sending only what differs from `guestView`. */
  async push(agent: AgentClient, only?: Iterable<string>): Promise<PushStats> {
    const t0 = performance.now();
    const before: Manifest = this.guestView ?? new Map();
    let host: Manifest;
    let guestSubset: Manifest = before;
    if (only && this.guestView) {
      // Only these paths (and what is under them) may have changed on the host.
      host = new Map();
      guestSubset = new Map();
      for (const p of only) await this.scanPath(p, host, guestSubset, before);
    } else host = await scanTree(this.hostWs.root);
    const { write, remove } = diffManifests(host, guestSubset);
    const changes: Array<Change & { size: number }> = [];
    for (const p of remove) changes.push({ op: 'delete', path: p, size: 0 });
    for (const p of write) {
      const c = await this.describe(p, host.get(p) as ManifestEntry);
      if (c) changes.push(c);
    }
    const stats = await this.apply(agent, changes);
    const view: Manifest = this.guestView ?? new Map();
    for (const p of remove) for (const k of [...view.keys()]) if (k === p || k.startsWith(`${p}/`)) view.delete(k);
    for (const p of write) view.set(p, host.get(p) as ManifestEntry);
    this.guestView = view;
    return { ...stats, removed: remove.length, ms: performance.now() - t0 };
  }

  /** Brings back what changed in the guest since `marker`; returns the new marker. */
  async pull(agent: AgentClient, marker: string, maxFileBytes: number): Promise<{ marker: string; stats: PullStats }> {
    const t0 = performance.now();
    const r = await agent.call('sync.changes', { since: marker, inlineMaxBytes: INLINE_MAX });
    const changes: SyncChange[] = [];
    const skipped = [...r.skipped];
    let files = 0;
    let bytes = 0;
    let deleted = 0;
    const big = new Set<string>();
    for (const e of r.changes) {
      const c = toChange(e, maxFileBytes, skipped);
      if (!c) continue;
      if (c.op === 'delete') deleted++;
      if (c.op === 'write') {
        files++;
        bytes += e.size ?? 0;
        if (!e.data) big.add(e.path);
      }
      changes.push(c);
    }
    const applied = changes.length
      ? await this.hostSync.apply(changes, (c) => (c.data ? c.data : big.has(c.path) ? agent.syncReadStream(c.path) : new Uint8Array(0)))
      : { applied: 0, failed: [] };
    // The guest now holds what the host holds for these paths.
    const view = this.guestView ?? new Map();
    for (const c of changes) {
      if (c.op === 'delete') {
        for (const k of [...view.keys()]) if (k === c.path || k.startsWith(`${c.path}/`)) view.delete(k);
        continue;
      }
      const e = await statEntry(this.hostWs.hostPath(c.path));
      if (e) view.set(c.path, e);
    }
    this.guestView = view;
    return { marker: r.marker, stats: { files, bytes, deleted, ms: performance.now() - t0, skipped, failed: applied.failed } };
  }

  private async scanPath(p: string, host: Manifest, guestSubset: Manifest, before: Manifest): Promise<void> {
    // The path, its ancestors (a write may have created them) and, for a directory, its subtree.
    const parts = p.split('/');
    for (let i = 1; i <= parts.length; i++) {
      const q = parts.slice(0, i).join('/');
      if (host.has(q) || guestSubset.has(q)) continue;
      const e = await statEntry(this.hostWs.hostPath(q));
      if (e) host.set(q, e);
      const g = before.get(q);
      if (g) guestSubset.set(q, g);
    }
    const top = host.get(p);
    if (top?.kind === 'dir') for (const [k, v] of await scanTree(this.hostWs.hostPath(p))) host.set(`${p}/${k}`, v);
    for (const [k, v] of before) if (k.startsWith(`${p}/`)) guestSubset.set(k, v);
  }

  private async apply(agent: AgentClient, changes: Array<Change & { size: number }>): Promise<{ files: number; bytes: number }> {
    let files = 0;
    let bytes = 0;
    let batch: Change[] = [];
    let batchBytes = 0;
    let streams = 0;
    const flush = async () => {
      if (batch.length === 0) return;
      const r = await agent.syncApply(batch);
      if (r.failed.length) {
        const f = r.failed[0] as { path: string; code: string; message: string };
        throw new HutchError('internal', `workspace push failed for ${r.failed.length} entries, first ${f.path}: ${f.code} ${f.message}`, { failed: r.failed.length });
      }
      batch = [];
      batchBytes = 0;
      streams = 0;
    };
    for (const c of changes) {
      const { size, ...change } = c;
      if (c.op === 'write') {
        files++;
        bytes += size;
        if ('source' in c) {
          if (streams >= BATCH_STREAMS) await flush();
          streams++;
        } else {
          if (batchBytes + size > BATCH_BYTES) await flush();
          batchBytes += size;
        }
      }
      batch.push(change);
      if (batch.length >= 2000) await flush();
    }
    await flush();
    return { files, bytes };
  }

  private async describe(rel: string, e: ManifestEntry): Promise<(Change & { size: number }) | undefined> {
    const abs = this.hostWs.hostPath(rel);
    if (e.kind === 'dir') return { op: 'mkdir', path: rel, mode: e.mode, size: 0 };
    if (e.kind === 'symlink') return { op: 'symlink', path: rel, target: e.target as string, size: 0 };
    if (e.size <= INLINE_MAX) {
      const fh = await fsp.open(abs, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK).catch(() => undefined);
      if (!fh) return undefined; // vanished or replaced by a link since the scan: the next push sees it
      try {
        const data = await fh.readFile();
        return { op: 'write', path: rel, mode: e.mode, mtimeMs: e.mtimeMs, data, size: data.length };
      } finally {
        await fh.close();
      }
    }
    const fh = await fsp.open(abs, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK);
    const source = (async function* () {
      try {
        for await (const c of fh.createReadStream({ autoClose: false, highWaterMark: 128 * 1024 })) yield c as Buffer;
      } finally {
        await fh.close();
      }
    })();
    return { op: 'write', path: rel, mode: e.mode, mtimeMs: e.mtimeMs, source, size: e.size };
  }
}

function toChange(e: SyncEntry, maxFileBytes: number, skipped: Array<{ path: string; reason: string }>): SyncChange | undefined {
  switch (e.kind) {
    case 'deleted':
      return { op: 'delete', path: e.path };
    case 'dir':
      return { op: 'mkdir', path: e.path, mode: e.mode ?? 0o755 };
    case 'symlink':
      return { op: 'symlink', path: e.path, target: e.target ?? '' };
    case 'file':
      if ((e.size ?? 0) > maxFileBytes) {
        skipped.push({ path: e.path, reason: `file of ${e.size} bytes is above the limit of ${maxFileBytes}` });
        return undefined;
      }
      return { op: 'write', path: e.path, mode: e.mode ?? 0o644, ...(e.mtimeMs !== undefined ? { mtimeMs: e.mtimeMs } : {}), ...(e.data ? { data: e.data } : {}) };
  }
}
