import type { z } from 'zod';
import type { Logger } from '../log.ts';
import type { ExecObserver } from '../process/exec-handler.ts';
import { HutchError } from '../protocol/errors.ts';
import type { ActivationResultSchema, PrefetchResultSchema, ReclaimResultSchema } from '../protocol/methods-memory.ts';
import { ActivationRecorder, intersectCount, overlapOf, toRanges, type ActivationMethod, type CallRecord, type ProcessSet } from './activation-set.ts';
import { pageIdleAvailable } from './page-idle.ts';
import { PAGE } from './pagemap.ts';
import { prefetch } from './prefetch.ts';
import { reclaim, resetHotSetLast } from './reclaim.ts';
import { swapStats } from './stats.ts';

/**
 * The agent's memory manager state: it watches calls start and end (as an exec observer)
 * to record activation sets, and runs reclaim and prefetch against what it recorded. One
 * per agent; every connection's mem.* handlers share it.
 */
export class MemoryController implements ExecObserver {
  private track = true;
  private recorder: ActivationRecorder | undefined;
  private active = 0;
  /** Recording work, in order: a begin, the end that follows it, the next begin... */
  private queue: Promise<void> = Promise.resolve();
  /** The end-of-call recording in flight, if any. */
  private recording: Promise<void> | undefined;
  private calls = 0;
  private last: CallRecord | undefined;
  private previous: Map<string, ProcessSet> | undefined;
  private prefetched: Map<string, Float64Array> | undefined;
  private lastPrefetch: { pages: number; hits: number | null; hitRatio: number | null } | null = null;
  private hotSetLastApplied = false;

  constructor(
    readonly cgroup: string | undefined,
    private readonly log: Logger,
  ) {
    if (cgroup) this.recorder = new ActivationRecorder(cgroup, ActivationRecorder.defaultMethod(), log);
  }

  get method(): ActivationMethod {
    return this.recorder?.method ?? ActivationRecorder.defaultMethod();
  }

  /**
   * Before a call. A call never waits for the recording of the one before it (that takes
   * up to seconds under TCG): if it is still in flight, this call's start is not marked
   * separately; the recording marks every page again when it is done, so at worst the
   * first moments of this call count towards the previous one. The pagemap method needs
   * its baseline taken before the call, so there the call waits.
   */
  beforeExec(): Promise<void> {
    if (this.active++ > 0 || !this.track || !this.recorder) return Promise.resolve();
    const rec = this.recorder;
    if (this.recording && rec.method === 'idle') return Promise.resolve();
    const begin = this.queue.then(() => rec.begin()).catch((err: unknown) => this.log.warn('mem.activation_begin_failed', { error: (err as Error).message }));
    this.queue = begin;
    return begin;
  }

  afterExec(): void {
    if (--this.active > 0 || !this.track || !this.recorder) return;
    const rec = this.recorder;
    const recording = this.queue
      .then(async () => this.recorded(await rec.end()))
      .catch((err: unknown) => this.log.warn('mem.activation_record_failed', { error: (err as Error).message }))
      .finally(() => {
        if (this.recording === recording) this.recording = undefined;
      });
    this.recording = recording;
    this.queue = recording;
  }

  private recorded(r: CallRecord): void {
    // A call with no long-lived process around has nothing to predict the next wake with.
    if (r.sets.size === 0) return;
    this.calls++;
    this.previous = this.last?.sets;
    this.last = r;
    if (this.prefetched) {
      let hits = 0;
      for (const [k, pages] of this.prefetched) {
        const s = r.sets.get(k);
        if (s) hits += intersectCount(pages, s.pages);
      }
      const pages = this.lastPrefetch?.pages ?? 0;
      this.lastPrefetch = { pages, hits, hitRatio: pages > 0 ? hits / pages : null };
      this.prefetched = undefined;
    }
    let pages = 0;
    for (const s of r.sets.values()) pages += s.pages.length;
    this.log.debug('mem.activation_recorded', { processes: r.sets.size, pages, ms: Math.round(r.ms) });
  }

  /** Waits for the recording of the last call (results must describe a finished call). */
  settled(): Promise<void> {
    return this.queue;
  }

  configure(opts: { track?: boolean | undefined; method?: ActivationMethod | undefined }): void {
    if (opts.track !== undefined) this.track = opts.track;
    if (opts.method !== undefined && opts.method !== this.recorder?.method) {
      if (opts.method === 'idle' && !pageIdleAvailable()) {
        throw new HutchError('unavailable', 'idle page tracking is not in this kernel (no /sys/kernel/mm/page_idle/bitmap, CONFIG_IDLE_PAGE_TRACKING); use method pagemap');
      }
      if (!this.cgroup) throw new HutchError('unavailable', 'no workload cgroup: activation sets need the agent to run with --workload-cgroup');
      this.recorder = new ActivationRecorder(this.cgroup, opts.method, this.log);
    }
  }

  activation(maxRanges: number): z.infer<typeof ActivationResultSchema> {
    const sets = this.last?.sets ?? new Map<string, ProcessSet>();
    let pages = 0;
    const processes = [...sets.values()].map((s) => {
      pages += s.pages.length;
      const ranges = maxRanges > 0 ? toRanges(s.pages) : [];
      return {
        pid: s.pid,
        comm: s.comm,
        pages: s.pages.length,
        ranges: ranges.slice(0, maxRanges).map(([a, b]) => [a.toString(16), b.toString(16)] as [string, string]),
        rangeCount: maxRanges > 0 ? ranges.length : toRanges(s.pages).length,
      };
    });
    const o = this.last && this.previous ? overlapOf(this.last.sets, this.previous) : null;
    return {
      track: this.track,
      method: this.method,
      calls: this.calls,
      processes,
      pages,
      bytes: pages * PAGE,
      overlap: o?.overlap ?? null,
      coverage: o?.coverage ?? null,
      recordMs: this.last?.ms ?? 0,
      prefetch: this.lastPrefetch,
    };
  }

  async prefetch(): Promise<z.infer<typeof PrefetchResultSchema>> {
    await this.settled();
    const before = swapStats();
    const sets = this.last?.sets ?? new Map<string, ProcessSet>();
    const r = await prefetch(sets.values());
    this.prefetched = new Map([...sets].map(([k, s]) => [k, s.pages]));
    this.lastPrefetch = { pages: r.pages, hits: null, hitRatio: null };
    if (r.failedRanges > 0) this.log.info('mem.prefetch_partial', { failedRanges: r.failedRanges, ranges: r.ranges });
    return { pages: r.pages, bytes: r.bytes, ranges: r.ranges, processes: r.processes, skippedProcesses: r.skippedProcesses, ms: r.ms, before, after: swapStats() };
  }

  /** Active again: hot set last's idle settings (pool writeback off) are undone. */
  endIdle(): void {
    if (this.cgroup && this.hotSetLastApplied) resetHotSetLast(this.cgroup);
    this.hotSetLastApplied = false;
  }

  async reclaim(p: { target: 'all' | number; hotSetLast?: boolean | undefined; dropCaches?: boolean | undefined }): Promise<z.infer<typeof ReclaimResultSchema>> {
    // The last call's set must be recorded before its pages leave.
    await this.settled();
    if (this.cgroup && this.hotSetLastApplied && !p.hotSetLast) {
      resetHotSetLast(this.cgroup);
      this.hotSetLastApplied = false;
    }
    let hotSetBytes: number | undefined;
    if (p.hotSetLast) {
      hotSetBytes = 0;
      for (const s of this.last?.sets.values() ?? []) hotSetBytes += s.pages.length * PAGE;
      this.hotSetLastApplied = true;
    }
    return reclaim({ cgroup: this.cgroup, target: p.target, hotSetBytes, dropCaches: p.dropCaches });
  }
}
