import { performance } from 'node:perf_hooks';
import type { Logger } from '../log.ts';
import type { ExecObserver, ExecService } from '../process/exec-handler.ts';
import { DEFAULT_MEMORY_POLICY, type MemoryPolicyOutcome, type MemoryPolicySteps } from '../protocol/methods-memory.ts';
import type { MemoryController } from './controller.ts';
import { applyDamon, damonAvailable, damonState } from './damon.ts';
import { readKnobOr, writeKnob } from './knobs.ts';
import { setMglru } from './mglru.ts';
import { setReportingOrder } from './page-reporting.ts';
import { memInfo } from './stats.ts';
import { applyZswap, zswapAvailable, zswapPoolPercentFor } from './zswap.ts';

/** Free page reporting order while idle (every freed 4 KiB page) and while active (the kernel's default: per-page reports cost a VM exit each). */
const IDLE_REPORTING_ORDER = 0;
const ACTIVE_REPORTING_ORDER = 10;
/** How long the deferred start waits for the exec it follows to be spawned before giving up on it. */
const SPAWN_WAIT_MS = 10_000;

/**
 * The guest's own memory policy. The broker says `active` or `idle`; the agent does the rest:
 *
 * - active: nothing on the spot (the broker's wake waits for this answer). Once the first
 *   call of the active period has started (its process spawned), the agent sizes the zswap
 *   pool from its RAM, turns MGLRU on and starts the tuned DAMON_RECLAIM scheme through
 *   DAMON sysfs; if the wake followed an idle, it prefetches the last call's activation set
 *   (MADV_WILLNEED) at the same moment, alongside the call. Never before it: prefetch
 *   decompresses zswap pages synchronously (process_madvise), which on the wake's critical
 *   path made wakes slower than no prefetch at all.
 * - every exec: its activation set is recorded (controller.ts, an exec observer).
 * - idle: DAMON stops (kdamond would sample an idle guest every 5 ms, host CPU for
 *   nothing), the workload is reclaimed with the hot set last, free pages go back to the host.
 *
 * A step the kernel cannot do is a warning in the outcome and the log, never skipped silently.
 */
export class MemoryPolicy implements ExecObserver {
  private state: 'none' | 'active' | 'idle' = 'none';
  private steps: MemoryPolicySteps = { ...DEFAULT_MEMORY_POLICY };
  private atMs = Date.now();
  /** The active-period steps still to apply at the first call's start. */
  private pendingActive = false;
  /** A prefetch waits for the first call after an idle. */
  private prefetchArmed = false;
  private damon: MemoryPolicyOutcome['damon'] = null;
  private damonStarted = false;
  private zswap: MemoryPolicyOutcome['zswap'] = null;
  private lastReclaim: MemoryPolicyOutcome['reclaim'] = null;
  private lastPrefetch: MemoryPolicyOutcome['prefetch'] = null;
  private warnings: string[] = [];
  /** The deferred active steps in flight (an idle waits for them). */
  private applying: Promise<void> = Promise.resolve();

  constructor(
    private readonly mem: MemoryController,
    private readonly execs: ExecService | undefined,
    private readonly log: Logger,
  ) {}

  async set(p: { state: 'active' | 'idle'; steps?: Partial<MemoryPolicySteps> | undefined }): Promise<MemoryPolicyOutcome> {
    if (p.steps) this.steps = { ...this.steps, ...p.steps };
    this.mem.configure({ track: this.steps.activationSet });
    const wasIdle = this.state === 'idle';
    this.state = p.state;
    this.atMs = Date.now();
    if (p.state === 'active') {
      this.warnings = [];
      if (wasIdle) this.step('hotSetLast', () => this.mem.endIdle());
      this.pendingActive = true;
      this.prefetchArmed = wasIdle && this.steps.prefetch && this.steps.activationSet;
      this.lastPrefetch = this.prefetchArmed ? { state: 'armed', callStartedAtMs: null, startedAtMs: null, pages: 0, ms: 0, error: null } : null;
      // One knob write, and the next call frees pages in bulk: back to large blocks only.
      if (this.steps.reporting) this.step('reporting', () => void setReportingOrder(ACTIVE_REPORTING_ORDER));
      return this.outcome();
    }
    this.pendingActive = false;
    this.prefetchArmed = false;
    await this.applying;
    this.warnings = [];
    this.stopDamon();
    this.lastReclaim = null;
    // Before the reclaim, not after: the kernel starts a reporting pass only when a page is
    // freed at or above the order in force at that moment. Lowered after the frees, nothing
    // would report the pages the reclaim just freed until some later, unrelated free.
    if (this.steps.reporting) this.step('reporting', () => void setReportingOrder(IDLE_REPORTING_ORDER));
    if (this.steps.reclaim) {
      try {
        this.lastReclaim = await this.mem.reclaim({ target: 'all', hotSetLast: this.steps.hotSetLast && this.steps.activationSet, dropCaches: this.steps.dropCaches });
      } catch (err) {
        this.warn(`reclaim: ${(err as Error).message}`);
      }
    } else if (this.steps.dropCaches) {
      this.step('dropCaches', () => writeKnob('/proc/sys/vm/drop_caches', '1'));
    }
    return this.outcome();
  }

  outcome(): MemoryPolicyOutcome {
    const a = this.mem.activation(0);
    return {
      state: this.state,
      steps: { ...this.steps },
      atMs: this.atMs,
      damon: this.damon,
      zswap: this.zswap,
      reclaim: this.lastReclaim,
      activation: { track: a.track, calls: a.calls, pages: a.pages },
      prefetch: this.lastPrefetch,
      warnings: [...this.warnings],
    };
  }

  beforeExec(): Promise<void> {
    if (this.state !== 'active' || (!this.pendingActive && !this.prefetchArmed)) return Promise.resolve();
    const callStartedAtMs = Date.now();
    const prefetch = this.prefetchArmed;
    this.pendingActive = false;
    this.prefetchArmed = false;
    // The exec handler spawns the command right after its observers' beforeExec settle;
    // this runs once the command is running (or gives up waiting, a command that failed to spawn).
    this.applying = this.afterSpawn().then(() => this.startActive(callStartedAtMs, prefetch));
    return Promise.resolve();
  }

  afterExec(): void {
    // Recording is the controller's (it observes execs too).
  }

  private async afterSpawn(): Promise<void> {
    const t0 = performance.now();
    await new Promise((r) => setImmediate(r));
    while (this.execs && this.execs.activeCount === 0 && performance.now() - t0 < SPAWN_WAIT_MS) await new Promise((r) => setTimeout(r, 2));
  }

  private async startActive(callStartedAtMs: number, prefetch: boolean): Promise<void> {
    const fetched = prefetch ? this.runPrefetch(callStartedAtMs) : Promise.resolve();
    if (this.steps.zswap) this.step('zswap', () => this.sizeZswap());
    if (this.steps.mglru) this.step('mglru', () => void setMglru(true));
    if (this.steps.damon) this.startDamon();
    else this.stopDamon();
    await fetched;
  }

  private async runPrefetch(callStartedAtMs: number): Promise<void> {
    const startedAtMs = Date.now();
    const p = { state: 'running' as const, callStartedAtMs, startedAtMs, pages: 0, ms: 0, error: null };
    this.lastPrefetch = p;
    try {
      const r = await this.mem.prefetch();
      this.lastPrefetch = { ...p, state: 'done', pages: r.pages, ms: r.ms };
    } catch (err) {
      // Only speed is lost: the call faults its pages in itself.
      this.lastPrefetch = { ...p, state: 'failed', error: (err as Error).message };
      this.warn(`prefetch: ${(err as Error).message}`);
    }
  }

  private sizeZswap(): void {
    if (!zswapAvailable()) throw new Error('this kernel has no zswap (CONFIG_ZSWAP)');
    const percent = zswapPoolPercentFor(memInfo().totalBytes);
    // A full pool writes its coldest entries back to the swap disk rather than refusing new ones.
    const shrinker = readKnobOr('/sys/module/zswap/parameters/shrinker_enabled') !== null;
    const st = applyZswap({ maxPoolPercent: percent, ...(shrinker ? { shrinkerEnabled: true } : {}) }, undefined);
    this.zswap = { maxPoolPercent: st.maxPoolPercent, compressor: st.compressor };
  }

  private startDamon(): void {
    if (!damonAvailable()) {
      this.damon = { running: false, unavailable: 'this kernel has no DAMON (CONFIG_DAMON_SYSFS): nothing trims the page cache while the session is active', reclaimedBytes: 0 };
      this.warn(`damon: ${this.damon.unavailable}`);
      return;
    }
    if (this.damonStarted) return;
    try {
      const st = applyDamon('tuned', undefined, 'sysfs');
      this.damonStarted = true;
      this.damon = { running: st.enabled, unavailable: null, reclaimedBytes: 0 };
    } catch (err) {
      this.damon = { running: false, unavailable: (err as Error).message, reclaimedBytes: 0 };
      this.warn(`damon: ${(err as Error).message}`);
    }
  }

  private stopDamon(): void {
    if (!this.damonStarted) return;
    try {
      const reclaimedBytes = damonState().stats.bytesReclaimedRegions;
      applyDamon('off', undefined, 'sysfs');
      this.damon = { running: false, unavailable: null, reclaimedBytes };
    } catch (err) {
      this.warn(`damon stop: ${(err as Error).message}`);
    }
    this.damonStarted = false;
  }

  private step(name: string, f: () => void): void {
    try {
      f();
    } catch (err) {
      this.warn(`${name}: ${(err as Error).message}`);
    }
  }

  private warn(msg: string): void {
    this.warnings.push(msg);
    this.log.warn('mem.policy_step_failed', { state: this.state, msg });
  }
}
