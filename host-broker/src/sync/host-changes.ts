import type { FSWatcher } from 'chokidar';
import { watchTree } from './watch-tree.ts';
import { relative } from 'node:path';
import type { Logger } from '../../../guest-agent/src/log.ts';
import { watchBudget, type WatchBudget } from './watch-budget.ts';

export type HostChanges = { kind: 'none' } | { kind: 'all' } | { kind: 'paths'; paths: string[] };

/**
 * Directories one workspace's watcher may watch. Each is an inotify watch of the broker's
 * user (a budget shared with everything else that user runs, about 190,000 here) and
 * chokidar's memory: a tenant's 100,000 directories must not spend either. Past it every
 * VM call scans the tree instead, as after any fast-path call.
 */
export const MAX_WATCHED_DIRS = 5_000;
/**
 * Levels below the root a watcher follows. chokidar's bookkeeping per event is linear in a
 * path's length and its removal of a tree recursive: a tenant's chain of 2,000 nested
 * directories held the broker's loop 0.7-0.8 s when removed. Deeper than this, the same as
 * past MAX_WATCHED_DIRS: nothing is watched and each VM call scans the tree.
 */
export const MAX_WATCHED_DEPTH = 64;

/**
 * What changed in a host workspace since the guest last saw it. File tools and the fast
 * path report their own writes as they happen (no race with the next VM call); chokidar
 * catches everything else (someone editing the workspace directory directly) while a VM
 * lives: a wake's push scans the whole tree anyway.
 */
export class HostChangeTracker {
  private all = false;
  private readonly paths = new Set<string>();
  private watcher: FSWatcher | undefined;
  /** Past MAX_WATCHED_DIRS: nothing is watched and every take() answers 'all' until the next watch(). */
  private overflow = false;
  /** Which watch() is current: a watcher being closed must not touch the state of the next. */
  private generation = 0;
  /** Gives the current watch's directories back to the budget. */
  private release: () => void = () => undefined;

  constructor(
    private readonly root: string,
    private readonly log: Logger,
    private readonly maxDirs = MAX_WATCHED_DIRS,
    private readonly budget: WatchBudget = watchBudget,
  ) {}

  /** Something is marked for the next take() (a peek: nothing is consumed). */
  get pending(): boolean {
    return this.all || this.overflow || this.paths.size > 0;
  }

  get watching(): boolean {
    return this.watcher !== undefined;
  }

  /** Starts watching; events only mark paths, so a slow or missed event costs a push, not correctness. */
  watch(): void {
    if (this.watcher) return;
    this.overflow = false;
    const gen = ++this.generation;
    const dirs = new Set<string>();
    const ignored = (path: string, stats?: { isDirectory(): boolean }): boolean => {
      if (gen !== this.generation || this.overflow) return true;
      if (!stats?.isDirectory() || dirs.has(path)) return false;
      const tooDeep = depthBelow(this.root, path) > MAX_WATCHED_DEPTH;
      const charged = !tooDeep && dirs.size < this.maxDirs && this.budget.take();
      if (charged) {
        dirs.add(path);
        return false;
      }
      this.overflow = true;
      this.log.info('workspace.watch_overflow', {
        dirs: dirs.size,
        why: tooDeep
          ? `a directory more than ${MAX_WATCHED_DEPTH} levels deep`
          : dirs.size >= this.maxDirs
            ? `more than ${this.maxDirs} directories`
            : `the broker's watch budget (${this.budget.maxDirs} directories) is spent`,
        hint: 'each VM call scans the tree instead',
      });
      void this.unwatch();
      return true;
    };
    this.release = () => {
      this.budget.give(dirs.size);
      dirs.clear();
    };
    const w = watchTree(this.root, { ignoreInitial: true, followSymlinks: false, persistent: false, atomic: false, ignored });
    this.watcher = w;
    w.on('all', (_ev, abs) => {
      if (gen !== this.generation) return;
      const rel = relative(this.root, abs);
      if (rel && !rel.startsWith('..')) this.mark(rel);
    });
    w.on('error', (err) => {
      if (gen !== this.generation) return;
      this.log.warn('workspace.watch_error', { error: (err as Error).message });
      this.markAll();
    });
  }

  /** Stops watching (the VM is gone: the next wake scans the tree); marks are kept. */
  async unwatch(): Promise<void> {
    const w = this.watcher;
    this.watcher = undefined;
    this.release();
    this.release = () => undefined;
    await w?.close();
  }

  mark(rel: string): void {
    if (!this.all) this.paths.add(rel);
  }

  markAll(): void {
    this.all = true;
    this.paths.clear();
  }

  /** Returns what changed and starts over. */
  take(): HostChanges {
    if (this.all || this.overflow) {
      this.all = false;
      return { kind: 'all' };
    }
    if (this.paths.size === 0) return { kind: 'none' };
    const paths = [...this.paths];
    this.paths.clear();
    return { kind: 'paths', paths };
  }

  async close(): Promise<void> {
    await this.unwatch();
  }
}

/** Levels of `path` below `root` (`root/a/b`: 2), counting separators without building strings. */
export function depthBelow(root: string, path: string): number {
  let n = 0;
  for (let i = path.indexOf('/', root.length); i !== -1; i = path.indexOf('/', i + 1)) n++;
  return n;
}
