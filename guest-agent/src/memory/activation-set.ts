import { readFileSync } from 'node:fs';
import { performance } from 'node:perf_hooks';
import type { Logger } from '../log.ts';
import { markIdle, pageIdleAvailable, stillIdle } from './page-idle.ts';
import { listMappings, PAGE, walkPagemap } from './pagemap.ts';

/**
 * Activation sets: for each call, the pages the long-lived workload processes (servers,
 * REPLs, language servers: what survives between calls; a call's own process is gone by
 * the time it ends) touched while it ran, as sorted virtual page numbers per process.
 * The next wake prefetches that set; its overlap with the set before says how well one
 * call predicts the next.
 *
 * Two ways to see what a call touched:
 * - idle: page idle tracking. After a call (and before the first one), every present page
 *   of the workload processes is marked idle; at the end of the next call, a present page
 *   whose idle bit is clear was accessed, or faulted in anew (a new frame is never idle).
 *   Marking at the end rather than the start keeps the work off the next call's path.
 * - pagemap: the fallback without CONFIG_IDLE_PAGE_TRACKING. Pages present at the end of
 *   a call that were swapped out or absent at its start; it sees only what was brought
 *   back in (after a reclaim that is the whole point), not accesses to resident pages.
 */

export type ActivationMethod = 'idle' | 'pagemap';

export interface ProcessRef {
  pid: number;
  /** Start time in clock ticks since boot: pid plus start time names one process, even across pid reuse. */
  start: string;
  comm: string;
}

export interface ProcessSet extends ProcessRef {
  /** Sorted virtual page numbers (address / 4096). */
  pages: Float64Array;
}

export const keyOf = (p: ProcessRef) => `${p.pid}:${p.start}`;

export function processRef(pid: number): ProcessRef | null {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    const close = stat.lastIndexOf(')');
    const comm = stat.slice(stat.indexOf('(') + 1, close);
    const fields = stat.slice(close + 2).split(' ');
    // fields[0] is the state (field 3); starttime is field 22. Zombies have no memory left.
    if (fields[0] === 'Z' || fields[0] === 'X') return null;
    return { pid, start: fields[19] ?? '0', comm };
  } catch {
    return null;
  }
}

/** Processes in the workload cgroup, minus the agent itself. */
export function workloadProcesses(cgroup: string): ProcessRef[] {
  let text = '';
  try {
    text = readFileSync(`${cgroup}/cgroup.procs`, 'utf8');
  } catch {
    return [];
  }
  const pids = text.split('\n').filter((l) => l.trim() !== '').map(Number).filter((pid) => pid !== process.pid);
  return pids.map(processRef).filter((p): p is ProcessRef => p !== null);
}

function contains(sorted: Float64Array, v: number): boolean {
  let lo = 0;
  let hi = sorted.length - 1;
  while (lo <= hi) {
    const mid = (lo + hi) >> 1;
    const x = sorted[mid] as number;
    if (x === v) return true;
    if (x < v) lo = mid + 1;
    else hi = mid - 1;
  }
  return false;
}

/** |a ∩ b| of two sorted page arrays. */
export function intersectCount(a: Float64Array, b: Float64Array): number {
  let i = 0;
  let j = 0;
  let n = 0;
  while (i < a.length && j < b.length) {
    const x = a[i] as number;
    const y = b[j] as number;
    if (x === y) {
      n++;
      i++;
      j++;
    } else if (x < y) i++;
    else j++;
  }
  return n;
}

/** Sorted pages as [start, end) address ranges. */
export function toRanges(pages: Float64Array): Array<[number, number]> {
  const out: Array<[number, number]> = [];
  for (const p of pages) {
    const last = out[out.length - 1];
    if (last && last[1] === p * PAGE) last[1] += PAGE;
    else out.push([p * PAGE, (p + 1) * PAGE]);
  }
  return out;
}

export interface Overlap {
  /** Jaccard: |a ∩ b| / |a ∪ b|. */
  overlap: number;
  /** |a ∩ b| / |a|. */
  coverage: number;
}

export function overlapOf(cur: Map<string, ProcessSet>, prev: Map<string, ProcessSet>): Overlap {
  let inter = 0;
  let curN = 0;
  let prevN = 0;
  for (const [k, s] of cur) {
    curN += s.pages.length;
    const p = prev.get(k);
    if (p) inter += intersectCount(s.pages, p.pages);
  }
  for (const s of prev.values()) prevN += s.pages.length;
  const union = curN + prevN - inter;
  return { overlap: union === 0 ? 1 : inter / union, coverage: curN === 0 ? 1 : inter / curN };
}

export interface CallRecord {
  sets: Map<string, ProcessSet>;
  ms: number;
}

export class ActivationRecorder {
  /** idle: processes whose present pages are marked idle (the baseline of the next call). */
  private readonly marked = new Set<string>();
  /** pagemap: pages present at the start of the call, per process. */
  private readonly presentAtStart = new Map<string, Float64Array>();

  constructor(
    private readonly cgroup: string,
    readonly method: ActivationMethod,
    private readonly log: Logger,
  ) {}

  static defaultMethod(): ActivationMethod {
    return pageIdleAvailable() ? 'idle' : 'pagemap';
  }

  /** Before a call: what the end of the call compares with. */
  async begin(): Promise<void> {
    for (const p of workloadProcesses(this.cgroup)) {
      const key = keyOf(p);
      try {
        if (this.method === 'idle') {
          if (this.marked.has(key)) continue;
          const { pfns } = await this.scan(p.pid);
          markIdle(pfns);
          this.marked.add(key);
        } else {
          this.presentAtStart.set(key, (await this.scan(p.pid)).pages);
        }
      } catch (err) {
        this.log.debug('mem.activation_begin_skipped', { pid: p.pid, error: (err as Error).message });
      }
    }
  }

  /** After a call: what each workload process touched; marks the baseline for the next call. */
  async end(): Promise<CallRecord> {
    const t0 = performance.now();
    const sets = new Map<string, ProcessSet>();
    const alive = new Set<string>();
    for (const p of workloadProcesses(this.cgroup)) {
      const key = keyOf(p);
      alive.add(key);
      try {
        const { pages, pfns } = await this.scan(p.pid);
        let touched: number[];
        if (this.method === 'idle') {
          const idle = stillIdle(pfns);
          touched = [];
          for (let i = 0; i < pages.length; i++) if (!idle.has(pfns[i] as number)) touched.push(pages[i] as number);
          markIdle(pfns);
          this.marked.add(key);
        } else {
          const before = this.presentAtStart.get(key) ?? new Float64Array(0);
          touched = [];
          for (const pg of pages) if (!contains(before, pg)) touched.push(pg);
        }
        sets.set(key, { ...p, pages: Float64Array.from(touched) });
      } catch (err) {
        // The process exited while we looked at it.
        this.log.debug('mem.activation_end_skipped', { pid: p.pid, error: (err as Error).message });
      }
    }
    for (const k of this.marked) if (!alive.has(k)) this.marked.delete(k);
    this.presentAtStart.clear();
    return { sets, ms: performance.now() - t0 };
  }

  /** Present pages of a process in address order, with their frames. */
  private async scan(pid: number): Promise<{ pages: Float64Array; pfns: Float64Array }> {
    const pages: number[] = [];
    const pfns: number[] = [];
    await walkPagemap(pid, listMappings(pid), {
      present: (page, pfn) => {
        pages.push(page);
        pfns.push(pfn);
      },
    });
    return { pages: Float64Array.from(pages), pfns: Float64Array.from(pfns) };
  }
}
