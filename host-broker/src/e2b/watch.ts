/**
 * envd's directory watching (Filesystem.WatchDir, and the polling watcher: CreateWatcher,
 * GetWatcherEvents, RemoveWatcher) on the host workspace. Changes made in the VM reach the
 * host workspace when the call that made them ends (the workspace sync), so that is when
 * their events come.
 */
import { realpathSync } from 'node:fs';
import { basename, relative } from 'node:path';
import { watch, type FSWatcher } from 'chokidar';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { isAtomicTempName } from '../../../guest-agent/src/workspace/atomic-write.ts';
import type { Session } from '../sessions/session.ts';

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
export async function watchDir(s: Session, path: string, recursive: boolean, onEvent: (e: FsEvent) => void): Promise<() => Promise<void>> {
  const r = s.files.ws.open(path);
  let abs: string;
  try {
    if (!r.stat?.isDirectory()) throw new HutchError('not_a_directory', `${path} is not a directory`, { path });
    abs = r.abs;
  } finally {
    r.close();
  }
  const w: FSWatcher = watch(abs, { ignoreInitial: true, followSymlinks: false, persistent: false, atomic: false, ...(recursive ? {} : { depth: 0 }) });
  const close = () => w.close();
  try {
    await new Promise<void>((resolve, reject) => {
      w.once('ready', () => resolve());
      w.once('error', reject);
    });
    if (realpathSync(abs) !== abs) throw new HutchError('outside_workspace', `${path} changed while the watch was set up`, { path });
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

  constructor(readonly close: () => Promise<void>) {}

  static async start(s: Session, path: string, recursive: boolean): Promise<PollingWatcher> {
    let self: PollingWatcher | undefined;
    const close = await watchDir(s, path, recursive, (e) => self?.push(e));
    self = new PollingWatcher(close);
    return self;
  }

  private push(e: FsEvent): void {
    this.events.push(e);
    if (this.events.length > MAX_PENDING_EVENTS) this.events.splice(0, this.events.length - MAX_PENDING_EVENTS);
  }

  take(): FsEvent[] {
    const out = this.events;
    this.events = [];
    return out;
  }
}
