import type { Handlers } from '../protocol/connection.ts';

export interface MemoryContext {
  /** cgroup v2 directory tenant commands run in (memory.reclaim target). */
  workloadCgroup?: string | undefined;
}

/** Handlers of the mem.* methods. */
export function memoryHandlers(_ctx: MemoryContext): Handlers {
  return {};
}
