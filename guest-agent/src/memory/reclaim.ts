import { writeFileSync } from 'node:fs';
import { performance } from 'node:perf_hooks';
import type { z } from 'zod';
import { HutchError } from '../protocol/errors.ts';
import type { ReclaimResultSchema } from '../protocol/methods-memory.ts';
import { readKnob, writeKnob } from './knobs.ts';
import { swapStats } from './stats.ts';
import { setCgroupZswapMax, setCgroupZswapWriteback } from './zswap.ts';

/**
 * Proactive reclaim of the workload cgroup through cgroup v2's memory.reclaim: the kernel
 * picks what to evict with its own LRU (MGLRU here), anonymous pages go to zswap (or the
 * swap disk), clean page cache is dropped.
 */

type ReclaimResult = z.infer<typeof ReclaimResultSchema>;

export interface ReclaimRequest {
  cgroup: string | undefined;
  target: 'all' | number;
  /** Bytes of the recorded activation set still resident, for hot set last; undefined = stock reclaim. */
  hotSetBytes?: number | undefined;
  dropCaches?: boolean | undefined;
}

function current(cgroup: string): number {
  return Number(readKnob(`${cgroup}/memory.current`));
}

/**
 * One write to memory.reclaim. The kernel retries internally and answers EAGAIN when it
 * could not reclaim the whole amount (what is left is unevictable, pinned or hot): that is
 * a normal outcome for 'all', reported as partial rather than as an error.
 */
function reclaimOnce(cgroup: string, bytes: number): { partial: boolean } {
  if (bytes <= 0) return { partial: false };
  try {
    writeFileSync(`${cgroup}/memory.reclaim`, String(bytes));
    return { partial: false };
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    if (code === 'EAGAIN') return { partial: true };
    if (code === 'ENOENT') throw new HutchError('unavailable', `${cgroup}/memory.reclaim missing: cgroup v2 memory controller not enabled for the workload`, { cgroup });
    throw new HutchError('internal', `memory.reclaim of ${bytes} bytes failed: ${code ?? (err as Error).message}`, { cgroup, bytes, errno: code });
  }
}

export function reclaim(req: ReclaimRequest): ReclaimResult {
  const cg = req.cgroup;
  if (!cg) throw new HutchError('unavailable', 'no workload cgroup to reclaim (the agent runs without --workload-cgroup)');
  const before = swapStats();
  const t0 = performance.now();
  const start = current(cg);
  const want = req.target === 'all' ? start : Math.min(req.target, start);
  let passes = 0;
  let partial = false;
  if (req.hotSetBytes === undefined) {
    partial = reclaimOnce(cg, want).partial;
    passes = 1;
  } else {
    // Phase 1, pool closed: the coldest pages (the LRU's tail) go straight to the swap disk.
    const cold = Math.max(0, want - req.hotSetBytes);
    setCgroupZswapMax(cg, 0);
    setCgroupZswapWriteback(cg, true);
    try {
      if (cold > 0) {
        reclaimOnce(cg, cold);
        passes++;
      }
    } finally {
      setCgroupZswapMax(cg, 'max');
    }
    // Phase 2, pool open and writeback off: what is left (the hot set, touched last) is
    // compressed into RAM and stays there; the next wake reads it without disk I/O.
    setCgroupZswapWriteback(cg, false);
    const rest = req.target === 'all' ? current(cg) : Math.max(0, want - (start - current(cg)));
    partial = reclaimOnce(cg, rest).partial;
    passes++;
  }
  if (req.dropCaches) writeKnob('/proc/sys/vm/drop_caches', '1');
  const end = current(cg);
  return {
    reclaimedBytes: Math.max(0, start - end),
    residentBytes: end,
    ms: performance.now() - t0,
    passes,
    partial,
    ...(req.hotSetBytes !== undefined ? { hotSetBytes: req.hotSetBytes } : {}),
    before,
    after: swapStats(),
  };
}

/** Undo hot set last's per-cgroup settings before a stock reclaim (pool open, writeback on). */
export function resetHotSetLast(cgroup: string): void {
  setCgroupZswapMax(cgroup, 'max');
  setCgroupZswapWriteback(cgroup, true);
}
