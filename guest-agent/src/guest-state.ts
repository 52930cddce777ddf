import { promises as fsp } from 'node:fs';
import type { ResultOf } from './protocol/methods.ts';
import { walk } from './workspace/walk.ts';

/**
 * The guest's root is an overlay over the read-only image; every write outside /work and
 * /tmp lands in its upper directory. An empty upper means the VM can be thrown away and
 * restored from the pristine snapshot without losing anything.
 */
export async function guestState(opts: { overlayUpper?: string | undefined; workloadCgroup?: string | undefined; maxPaths: number }): Promise<ResultOf<'agent.state'>> {
  const dirtyPaths: string[] = [];
  let dirty = false;
  if (opts.overlayUpper) {
    for await (const e of walk(opts.overlayUpper)) {
      dirty = true;
      if (e.type !== 'dir') dirtyPaths.push(e.rel);
      if (dirtyPaths.length >= opts.maxPaths) break;
    }
  }
  let processes = 0;
  if (opts.workloadCgroup) {
    const procs = await fsp.readFile(`${opts.workloadCgroup}/cgroup.procs`, 'utf8').catch(() => '');
    processes = procs.split('\n').filter((l) => l.trim() !== '').length;
  }
  return { dirty, dirtyPaths, processes, tracked: opts.overlayUpper !== undefined };
}
