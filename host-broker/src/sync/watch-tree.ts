import { watch, type ChokidarOptions, type FSWatcher } from 'chokidar';

/**
 * How long chokidar may hold a directory's re-read back. chokidar re-reads a directory after
 * a burst of events only if its read ended within this window (1 s as shipped): a longer
 * read (5,100 new entries on a loaded 2-core machine) had its timer drop the events counted
 * meanwhile, and the directories made in them were never watched: an E2B watch never saw
 * them (nor reached its directory limit), a host change made beside hutch was missed. With
 * a long window the read's own end decides whether to read again.
 */
const READDIR_WINDOW_MS = 60_000;

type Throttle = (action: string, path: string, timeoutMs: number) => unknown;

/** chokidar's watch, its directory re-read never dropped under load (see READDIR_WINDOW_MS). */
export function watchTree(path: string, opts: ChokidarOptions): FSWatcher {
  const w = watch(path, opts);
  // A private method of chokidar 5 (pinned); if it is gone, the watch works as shipped.
  const own = w as unknown as { _throttle?: Throttle };
  const throttle = own._throttle;
  if (typeof throttle === 'function') {
    own._throttle = (action, p, timeoutMs) => throttle.call(w, action, p, action === 'readdir' ? Math.max(timeoutMs, READDIR_WINDOW_MS) : timeoutMs);
  }
  return w;
}
