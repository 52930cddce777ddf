/**
 * Forking from inside a cgroup v1 slot without an extra exec: the calling thread joins the
 * slot's `tasks` files (v1 moves single threads), forks, and goes home. A child starts in
 * its forking thread's cgroups, so the sandbox is counted and charged from its first
 * instruction. Only the spawn helper does this (spawner.ts says why never the broker).
 *
 * Node runs JavaScript and libuv's fork() on the process's first thread, whose thread id is
 * the process id, so `process.pid` names the thread to move.
 */
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { ownDir, readCgroupLayout } from './cgroup-detect.ts';

/** Home `tasks` file per v1 hierarchy mount point, read before the first move. */
let homes: Map<string, string> | undefined;

function homeTasksFor(tasksFile: string): string {
  if (!homes) {
    homes = new Map();
    const layout = readCgroupLayout();
    for (const m of layout.mounts) {
      const dir = m.fstype === 'cgroup' ? ownDir(layout, m) : undefined;
      if (dir !== undefined) homes.set(m.mountPoint, join(dir, 'tasks'));
    }
  }
  let best: [string, string] | undefined;
  for (const [mount, home] of homes) {
    if (tasksFile.startsWith(mount + '/') && (!best || mount.length > best[0].length)) best = [mount, home];
  }
  if (!best) throw new HutchError('internal', `no cgroup v1 hierarchy holds ${tasksFile}`);
  return best[1];
}

/**
 * Runs `fork` (synchronous: it must return once the child exists) with this thread inside
 * `tasksFiles`, and always moves the thread back. If it cannot get back, it throws
 * `internal`; the caller should then exit rather than keep forking from a tenant's cgroup.
 */
export function forkInCgroups<T>(tasksFiles: string[], fork: () => T): T {
  const back = tasksFiles.map(homeTasksFor);
  const self = String(process.pid);
  try {
    for (const f of tasksFiles) writeFileSync(f, self);
    return fork();
  } finally {
    for (const f of back) {
      try {
        writeFileSync(f, self);
      } catch (err) {
        throw new HutchError('internal', `cannot leave a tenant cgroup (${f}): ${(err as Error).message}`, { file: f });
      }
    }
  }
}
