import { performance } from 'node:perf_hooks';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { lstatAt } from '../../../guest-agent/src/workspace/fd-path.ts';
import type { PlannedGrowth } from '../../../guest-agent/src/workspace/file-tools.ts';
import { walk } from '../../../guest-agent/src/workspace/walk.ts';
import { LoopSlicer } from '../../../guest-agent/src/workspace/work-budget.ts';

/** A session's workspace quota: allocated bytes and entries (files, directories, symlinks). */
export interface QuotaLimits {
  bytes: number;
  files: number;
}
export interface Usage extends QuotaLimits {
  /** The file with the largest apparent size (a sparse file's can be far above what it uses). */
  largest?: { path: string; size: number };
}

export const DEFAULT_QUOTA: QuotaLimits = { bytes: 2 * 1024 * 1024 * 1024, files: 200_000 };

/** Allocation unit assumed for a planned write (ext4's and tmpfs's page-sized blocks); the next measure corrects it. */
const BLOCK = 4096;
/** First look at a running fast-path command's usage (most commands are done by then: no cost). */
const WATCH_MIN_MS = 500;

/**
 * Measures a workspace as the quota counts it: allocated bytes (st_blocks * 512, so a sparse
 * file counts what it really holds, not its apparent size) and the number of entries below
 * the root. Walks by fds (walk.ts), never following a symlink, so a tenant's tree cannot
 * send the measure outside the workspace.
 */
export async function measureWorkspace(dir: string): Promise<Usage> {
  let bytes = 0;
  let files = 0;
  let largest: Usage['largest'];
  // What lies deeper than any path can name still takes disk: counted, never listed.
  const beyond = (dirFd: number, name: Buffer) => {
    const st = lstatAt(dirFd, name);
    if (!st) return;
    bytes += st.blocks * 512;
    files++;
  };
  // A 200,000-entry walk must not stall other sessions: it yields every few milliseconds.
  const slicer = new LoopSlicer();
  for await (const e of walk(dir, { beyond, tick: () => slicer.tick() })) {
    const st = lstatAt(e.dirFd, e.name);
    if (!st) continue; // gone since it was listed
    bytes += st.blocks * 512;
    files++;
    if (st.isFile() && st.size > (largest?.size ?? 0)) largest = { path: e.rel, size: st.size };
  }
  return { bytes, files, ...(largest ? { largest } : {}) };
}

/**
 * One session's quota and its current usage. Usage is measured once (lazily, or at create),
 * kept current by the in-process tools' planned growth, and measured again after anything
 * that could change the tree behind the broker's back (a fast-path or VM call).
 */
export class WorkspaceQuota {
  private usage: Usage | undefined;

  constructor(
    readonly dir: string,
    readonly limits: QuotaLimits,
    /** What the session's VM holds in /work (VmBackend.workCapacityBytes), when less than the quota may be. */
    readonly vm?: { bytes: number; memoryMiB: number },
  ) {}

  /** The usage, measured now if nothing current is known. */
  async current(): Promise<Usage> {
    return this.usage ?? (await this.measure());
  }

  async measure(): Promise<Usage> {
    this.usage = await measureWorkspace(this.dir);
    return this.usage;
  }

  /** Something changed the tree in a way not accounted for: the next current() measures again. */
  stale(): void {
    this.usage = undefined;
  }

  /**
   * RLIMIT_FSIZE for a command on the host workspace: the file limit, or the bytes still free
   * under the quota plus one block, whichever is less. The block lets a write that runs into
   * the quota end just above it (instead of exactly at it, like a command that fits), so the
   * measure after the run tells the two apart and the call reports quota_exceeded.
   */
  fileSizeLimit(maxFileBytes: number): number {
    const remaining = Math.max(0, this.limits.bytes - (this.usage?.bytes ?? 0));
    return Math.min(maxFileBytes, remaining + BLOCK);
  }

  /** Which limit a usage is above, if any. */
  over(u: Usage): 'bytes' | 'files' | undefined {
    return u.bytes > this.limits.bytes ? 'bytes' : u.files > this.limits.files ? 'files' : undefined;
  }

  /** Throws quota_exceeded when `u` is above a limit. */
  check(u: Usage, what: string): void {
    const limit = this.over(u);
    if (limit) throw this.error(limit, u, what);
  }

  /**
   * The FileTools beforeGrow hook: refuses a write, edit or mkdir whose result would be above
   * the quota (before anything is written), else counts it. Growth that shrinks or keeps
   * usage is always let through, so a session over its quota can still cut files down.
   * Needs a current usage (the session awaits current() before an in-process call).
   */
  plan(g: PlannedGrowth): void {
    const u = this.usage;
    if (!u) throw new HutchError('internal', 'workspace usage not measured before a write');
    const replaced = g.file?.replaces ? g.file.replaces.blocks * 512 : 0;
    const addBytes = g.dirs * BLOCK + (g.file ? Math.ceil(g.file.bytes / BLOCK) * BLOCK - replaced : 0);
    const addFiles = g.dirs + (g.file && !g.file.replaces ? 1 : 0);
    const next = { ...u, bytes: u.bytes + addBytes, files: u.files + addFiles };
    if (addBytes > 0 && next.bytes > this.limits.bytes) throw this.error('bytes', next, `writing ${g.path}`);
    if (addFiles > 0 && next.files > this.limits.files) throw this.error('files', next, `writing ${g.path}`);
    this.usage = next;
  }

  /**
   * Before a VM call: a workspace over its quota cannot be pushed into a guest whose /work is
   * sized to the quota, and a file whose apparent size is above the quota (a sparse file made
   * by truncate) would be written out in full there, so both fail now, typed and naming what,
   * instead of a push that runs out of space a minute later.
   */
  async beforeVm(): Promise<void> {
    const known = this.usage;
    const refusal = this.vmRefusal(await this.current());
    // Refused on a usage kept by planning: measure once more before failing the call.
    if (refusal && known) {
      const again = this.vmRefusal(await this.measure());
      if (again) throw again;
    } else if (refusal) throw refusal;
  }

  private vmRefusal(u: Usage): HutchError | undefined {
    const limit = this.over(u);
    if (limit) return this.error(limit, u, 'the workspace as it is (remove files to get under it)');
    if (u.largest && u.largest.size > this.limits.bytes) {
      const { path, size } = u.largest;
      return new HutchError('quota_exceeded', `workspace quota exceeded: ${path} has an apparent size of ${size} bytes (sparse on the host), above the quota of ${this.limits.bytes} bytes that sizes the VM's /work; remove or shrink it`, {
        limit: 'bytes',
        quota: this.limits.bytes,
        path,
        size,
      });
    }
    // Within the quota but not within the VM: its /work (in guest RAM and swap) cannot take it.
    const vm = this.vm;
    if (vm && vm.bytes < this.limits.bytes) {
      const big = u.bytes > vm.bytes ? { what: `the workspace takes ${u.bytes} bytes`, size: u.bytes } : u.largest && u.largest.size > vm.bytes ? { what: `${u.largest.path} has an apparent size of ${u.largest.size} bytes (sparse on the host)`, size: u.largest.size, path: u.largest.path } : undefined;
      if (big) {
        return new HutchError('too_large', `${big.what}, more than this session's ${vm.memoryMiB} MiB VM holds in /work (${vm.bytes} bytes: half its memory plus its swap); create the session with more memoryMiB, or remove files (the fast path and file tools still work on it)`, {
          vmBytes: vm.bytes,
          memoryMiB: vm.memoryMiB,
          size: big.size,
          ...(big.path ? { path: big.path } : {}),
        });
      }
    }
    return undefined;
  }

  /**
   * After a command ran on the workspace (fast path or VM): measures again and throws
   * quota_exceeded when it grew the workspace above a limit. `full` (the VM route) also counts
   * a workspace exactly at the quota: the guest's /work is sized to it, so it being full is the
   * command having hit ENOSPC there.
   */
  async afterRun(before: Usage, route: string, full = false): Promise<void> {
    const u = await this.measure();
    // Only a run that grew the workspace is blamed: one that reads (or removes) while the
    // session is still over its quota succeeds, so the tenant can get under it again.
    if (u.bytes > before.bytes && (u.bytes > this.limits.bytes || (full && u.bytes >= this.limits.bytes))) {
      throw this.error('bytes', u, `the command (${route})`);
    }
    if (u.files > before.files && u.files > this.limits.files) throw this.error('files', u, `the command (${route})`);
  }

  /**
   * While a command runs on the host workspace: measures every so often and calls onOver once
   * usage is above the quota, so a command writing many files (each under its RLIMIT_FSIZE) is
   * stopped while it writes. The pause between measures grows with their cost (a big tree).
   */
  watch(onOver: (err: HutchError) => void): () => void {
    let stopped = false;
    let timer: NodeJS.Timeout | undefined;
    const tick = (delayMs: number) => {
      timer = setTimeout(() => {
        const t0 = performance.now();
        void measureWorkspace(this.dir).then(
          (u) => {
            if (stopped) return;
            const limit = this.over(u);
            if (limit) onOver(this.error(limit, u, 'the running command'));
            else tick(Math.max(WATCH_MIN_MS, 4 * (performance.now() - t0)));
          },
          () => stopped || tick(WATCH_MIN_MS),
        );
      }, delayMs);
      timer.unref();
    };
    tick(WATCH_MIN_MS);
    return () => {
      stopped = true;
      clearTimeout(timer);
    };
  }

  error(limit: 'bytes' | 'files', u: Usage, what: string): HutchError {
    const max = this.limits[limit];
    const msg =
      limit === 'bytes'
        ? `workspace quota exceeded: ${what} takes the workspace to ${u.bytes} bytes; its quota is ${max} bytes`
        : `workspace quota exceeded: ${what} takes the workspace to ${u.files} files; its quota is ${max} files`;
    return new HutchError('quota_exceeded', msg, { limit, quota: max, bytes: u.bytes, files: u.files, quotaBytes: this.limits.bytes, quotaFiles: this.limits.files });
  }
}
