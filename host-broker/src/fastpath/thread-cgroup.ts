/**
 * Forking from inside a cgroup v1 slot without an extra exec: the calling thread joins the
 * slot's `tasks` files (v1 moves single threads), forks, and goes home. A child starts in
 * its forking thread's cgroups, so the sandbox is counted and charged from its first
 * instruction. Only the spawn helper does this (spawner.ts says why never the broker).
 *
 * Node runs JavaScript, synchronous fs calls and libuv's fork() on the same thread, so the
 * thread that writes the `tasks` file is the one that forks. It writes "0" (the writing
 * thread itself), not its id: for a nonzero id the kernel takes the global
 * cgroup_threadgroup_rwsem for writing, which waits out an RCU grace period whenever the lock
 * has been idle, and that wait was most of what a fast-path call cost above bubblewrap (a
 * mean of 2-6 ms per move here under load, up to 20 ms); for the writing thread itself it
 * needs no such lock (kernel/cgroup/cgroup.c, cgroup_procs_write_start).
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
  const self = '0';
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
