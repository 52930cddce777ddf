/**
 * Where the fast path's processes are started from. Both ways go through runProcess (the
 * project's one process runner); they differ in which process calls it:
 *
 * - `in-process`: the broker itself. Node 20's libuv starts children with fork(), whose cost
 *   grows with the parent's memory (page tables are copied, then every page the parent
 *   writes afterwards takes a copy-on-write fault), so a broker holding a large heap pays
 *   more per command.
 * - `helper`: a small Node process forked when the fast path is created (while the broker is
 *   still small), which runs runProcess on the broker's behalf and relays output with
 *   backpressure. Its fork cost stays constant whatever the broker's heap.
 */
import { runProcess, type RunOptions, type RunResult } from '../../../guest-agent/src/process/run-process.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { HelperSpawner } from './spawn-helper-client.ts';

export type SpawnerKind = 'in-process' | 'helper';

export interface SpawnedRun {
  result: Promise<RunResult>;
  kill(signal: NodeJS.Signals): void;
}

export interface Spawner {
  readonly kind: SpawnerKind;
  /** Pid of the process that forks the sandboxes (the broker or the helper). */
  readonly forkerPid: number;
  /** Whether run() can take `cgroupTasks` (fork from inside a v1 cgroup, see RunSlot.threadEntry). */
  readonly threadEntry: boolean;
  /**
   * @param cgroupTasks v1 `tasks` files the forking thread joins for the length of its
   *   fork(), so the child starts in them; only when `threadEntry` is true.
   */
  run(opts: RunOptions, cgroupTasks?: string[]): SpawnedRun;
  close(): Promise<void>;
}

export class InProcessSpawner implements Spawner {
  readonly kind = 'in-process' as const;
  readonly forkerPid = process.pid;
  // Never for the broker itself: while its main thread sat in a tenant's memory cgroup, every
  // page the broker faulted (a GC, another thread) would be charged there, and an OOM kill in
  // that cgroup could pick the broker.
  readonly threadEntry = false;

  run(opts: RunOptions, cgroupTasks?: string[]): SpawnedRun {
    if (cgroupTasks) throw new HutchError('internal', 'the in-process spawner does not fork from inside a cgroup');
    const running = runProcess(opts);
    return { result: running.result, kill: (sig) => void running.kill(sig) };
  }

  async close(): Promise<void> {}
}

export async function createSpawner(kind: SpawnerKind, log: Logger): Promise<Spawner> {
  return kind === 'helper' ? HelperSpawner.start(log) : new InProcessSpawner();
}
