/**
 * envd's directory watching (Filesystem.WatchDir, and the polling watcher: CreateWatcher,
 * GetWatcherEvents, RemoveWatcher) on the host workspace. Changes made in the VM reach the
 * host workspace when the call that made them ends (the workspace sync), so that is when
 * their events come.
 */
import { realpathSync } from 'node:fs';
import { basename, relative } from 'node:path';
import type { FSWatcher } from 'chokidar';
import { watchTree } from '../sync/watch-tree.ts';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { isAtomicTempName } from '../../../guest-agent/src/workspace/atomic-write.ts';
import type { Session } from '../sessions/session.ts';
import { depthBelow, MAX_WATCHED_DEPTH, MAX_WATCHED_DIRS } from '../sync/host-changes.ts';
import { watchBudget } from '../sync/watch-budget.ts';

export interface FsEvent {
  name: string;
  type: 'EVENT_TYPE_CREATE' | 'EVENT_TYPE_WRITE' | 'EVENT_TYPE_REMOVE';
}

/** A polling watcher keeps at most this many undelivered events (the oldest go first). */
const MAX_PENDING_EVENTS = 10_000;

const TYPES: Record<string, FsEvent['type']> = { add: 'EVENT_TYPE_CREATE', addDir: 'EVENT_TYPE_CREATE', change: 'EVENT_TYPE_WRITE', unlink: 'EVENT_TYPE_REMOVE', unlinkDir: 'EVENT_TYPE_REMOVE' };

/**
 * Watches a workspace directory, resolved with the workspace's confinement. The watch
 * starts on the resolved host path; once it is set up, that path is checked again to be
 * free of symlinks (a swap in between would otherwise move the watch out of the workspace).
 */
export async function watchDir(s: Session, path: string, recursive: boolean, onEvent: (e: FsEvent) => void, onError?: (err: HutchError) => void): Promise<() => Promise<void>> {
  const r = s.files.ws.open(path);
  let abs: string;
  try {
    if (!r.stat?.isDirectory()) throw new HutchError('not_a_directory', `${path} is not a directory`, { path });
    abs = r.abs;
  } finally {
    r.close();
  }
  // Each directory watched is an inotify watch of the broker's user (shared host-wide) and
  // chokidar's memory: a tree past the budget fails the watch, now or when it grows past it.
  let ready = false;
  let tooBig: HutchError | undefined;
  const dirs = new Set<string>();
  let w: FSWatcher | undefined;
  let closed = false;
  const close = async () => {
    if (!closed) {
      closed = true;
      watchBudget.give(dirs.size);
      dirs.clear();
    }
    await w?.close();
  };
  const ignored = (p: string, stats?: { isDirectory(): boolean }): boolean => {
    if (tooBig) return true;
    if (!stats?.isDirectory() || dirs.has(p)) return false;
    const tooDeep = depthBelow(abs, p) > MAX_WATCHED_DEPTH;
    if (!tooDeep && dirs.size < MAX_WATCHED_DIRS && watchBudget.take()) {
      dirs.add(p);
      return false;
    }
    tooBig = tooDeep
      ? new HutchError('too_large', `${path} holds directories more than ${MAX_WATCHED_DEPTH} levels deep; watch a shallower part of the workspace`, { path, limit: MAX_WATCHED_DEPTH })
      : dirs.size >= MAX_WATCHED_DIRS
        ? new HutchError('too_large', `${path} holds more than ${MAX_WATCHED_DIRS} directories; watch a smaller part of the workspace`, { path, limit: MAX_WATCHED_DIRS })
        : new HutchError('busy', `the broker watches as many directories as it may (${watchBudget.maxDirs}); try again later or watch less`, { path });
    // While it is set up the crawl runs on (ignoring the rest) to its 'ready', and fails there.
    if (ready) {
      void close();
      onError?.(tooBig);
    }
    return true;
  };
  // Not recursive: one directory watched, whatever lies below it.
  w = watchTree(abs, { ignoreInitial: true, followSymlinks: false, persistent: false, atomic: false, ...(recursive ? { ignored } : { depth: 0 }) });
  try {
    await new Promise<void>((resolve, reject) => {
      w?.once('ready', () => resolve());
      w?.once('error', reject);
    });
    if (tooBig) throw tooBig;
    if (realpathSync(abs) !== abs) throw new HutchError('outside_workspace', `${path} changed while the watch was set up`, { path });
    ready = true;
  } catch (err) {
    await close();
    throw err;
  }
  w.on('all', (ev, p) => {
    const type = TYPES[ev];
    const name = relative(abs, p);
    // hutch's own temporary files (atomic writes, sync staging) are not the tenant's events.
    if (type && name && !name.startsWith('..') && !isAtomicTempName(basename(name))) onEvent({ name, type });
  });
  return close;
}

/** The polling flavour: events kept until fetched. */
export class PollingWatcher {
  private events: FsEvent[] = [];
  /** The watch ended on its own (the tree grew past the directory budget): the next take() says so. */
  private failed: HutchError | undefined;

  constructor(readonly close: () => Promise<void>) {}

  static async start(s: Session, path: string, recursive: boolean): Promise<PollingWatcher> {
    let self: PollingWatcher | undefined;
    const close = await watchDir(
      s,
      path,
      recursive,
      (e) => self?.push(e),
      (err) => self && (self.failed = err),
    );
    self = new PollingWatcher(close);
    return self;
  }

  private push(e: FsEvent): void {
    this.events.push(e);
    if (this.events.length > MAX_PENDING_EVENTS) this.events.splice(0, this.events.length - MAX_PENDING_EVENTS);
  }

  take(): FsEvent[] {
    if (this.failed && this.events.length === 0) throw this.failed;
    const out = this.events;
    this.events = [];
    return out;
  }
}
