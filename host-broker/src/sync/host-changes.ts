import { watch, type FSWatcher } from 'chokidar';
import { relative } from 'node:path';
import type { Logger } from '../../../guest-agent/src/log.ts';

export type HostChanges = { kind: 'none' } | { kind: 'all' } | { kind: 'paths'; paths: string[] };

/**
 * What changed in a host workspace since the guest last saw it. File tools and the fast
 * path report their own writes as they happen (no race with the next VM call); chokidar
 * catches everything else (someone editing the workspace directory directly).
 */
export class HostChangeTracker {
  private all = false;
  private readonly paths = new Set<string>();
  private watcher: FSWatcher | undefined;

  constructor(
    private readonly root: string,
    private readonly log: Logger,
  ) {}

  /** Starts watching; events only mark paths, so a slow or missed event costs a push, not correctness. */
  watch(): void {
    if (this.watcher) return;
    this.watcher = watch(this.root, { ignoreInitial: true, followSymlinks: false, persistent: false, atomic: false });
    this.watcher.on('all', (_ev, abs) => {
      const rel = relative(this.root, abs);
      if (rel && !rel.startsWith('..')) this.mark(rel);
    });
    this.watcher.on('error', (err) => {
      this.log.warn('workspace.watch_error', { error: (err as Error).message });
      this.markAll();
    });
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
    if (this.all) {
      this.all = false;
      return { kind: 'all' };
    }
    if (this.paths.size === 0) return { kind: 'none' };
    const paths = [...this.paths];
    this.paths.clear();
    return { kind: 'paths', paths };
  }

  async close(): Promise<void> {
    await this.watcher?.close();
    this.watcher = undefined;
  }
}
