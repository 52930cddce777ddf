import { statSync } from 'node:fs';
import { performance } from 'node:perf_hooks';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import type { Admission } from '../admission.ts';
import type { Sandbox, SandboxSpec, SlotRef, VmBackend, WakeInfo } from '../backends/backend.ts';
import type { BrokerMetrics } from '../metrics.ts';
import { HostChangeTracker, type HostChanges } from '../sync/host-changes.ts';
import { SerialQueue } from '../util/serial-queue.ts';
import { SnapshotSlots } from './snapshot-slots.ts';

export interface LifecycleOptions {
  /** Release a VM this long after its last call (ms). */
  idleMs: number;
}

export type ReleaseDecision = 'kill' | 'snapshot';

export interface ReleaseRecord {
  decision: ReleaseDecision;
  /** One sentence: what was found and why this was chosen. */
  reason: string;
  ms: number;
  bytesWritten: number;
}

export interface VmCallOutcome<T> {
  value: T;
  wake: WakeInfo;
  queuedMs: number;
}

/**
 * One session's VM over time: none until a call needs it (wake on call), live while
 * calls come, released after an idle window. Release kills the VM when nothing outside
 * /work and /tmp changed (the host owns the workspace and pushes it back on the next
 * wake), and otherwise snapshots it into one of two alternating slots first, so the next
 * wake restores exactly that state.
 *
 * VM calls and releases are serialised by a lock of their own, so file tools and
 * fast-path calls of the session never wait for a release to finish.
 */
export class SandboxLifecycle {
  private sandbox: Sandbox | undefined;
  /** A sandbox being released: its exit is expected, not a crash. */
  private retiring: Sandbox | undefined;
  private releaseMemory: (() => void) | undefined;
  private idleTimer: NodeJS.Timeout | undefined;
  private readonly lock = new SerialQueue();
  private readonly slots: SnapshotSlots;
  readonly hostChanges: HostChangeTracker;
  private closed = false;
  lastRelease: ReleaseRecord | undefined;

  constructor(
    private readonly spec: SandboxSpec,
    private readonly backend: VmBackend,
    private readonly admission: Admission,
    private readonly metrics: BrokerMetrics | undefined,
    private readonly log: Logger,
    private readonly opts: LifecycleOptions,
  ) {
    this.slots = new SnapshotSlots(spec.stateDir);
    this.hostChanges = new HostChangeTracker(spec.workspaceDir, log);
    this.hostChanges.watch();
  }

  get live(): boolean {
    return this.sandbox !== undefined;
  }

  homeChanges(): boolean | string[] {
    // A session with a slot has state in HOME even while no VM runs.
    return this.sandbox?.homeChanges() ?? (this.slots.current() ? true : false);
  }

  /** Runs `fn` against a live sandbox, waking one if needed, admitted by the host's limits. */
  vmCall<T>(fn: (sb: Sandbox, changes: HostChanges) => Promise<T>): Promise<VmCallOutcome<T>> {
    return this.lock.run(async () => {
      if (this.closed) throw new HutchError('not_found', `session ${this.spec.session} is closed`);
      this.cancelIdle();
      const wake = this.sandbox ? { wakeMs: 0, woke: false, how: 'live' } : await this.wake();
      const sb = this.sandbox as Sandbox;
      const t0 = performance.now();
      const done = await this.admission.vmCalls.acquire(this.admission.opts.queueTimeoutMs);
      const queuedMs = performance.now() - t0;
      try {
        const value = await fn(sb, this.hostChanges.take());
        return { value, wake, queuedMs };
      } catch (err) {
        if (err instanceof HutchError && err.code === 'guest_crashed') await this.drop('crashed during a call');
        throw err;
      } finally {
        done();
        this.scheduleIdle();
      }
    });
  }

  /** Starts a wake ahead of a call (the harness says a tool call is being generated). */
  prewarm(): void {
    if (this.sandbox || this.closed) return;
    void this.lock
      .run(async () => {
        if (!this.sandbox && !this.closed) {
          await this.wake();
          this.scheduleIdle();
        }
      })
      .catch((err: unknown) => this.log.warn('vm.prewarm_failed', { error: (err as Error).message }));
  }

  /** Releases now (idle window over, or the harness says the agent is idle/compacting). */
  release(why: string): Promise<ReleaseRecord | undefined> {
    return this.lock.run(() => this.releaseLocked(why));
  }

  async close(): Promise<void> {
    this.closed = true;
    this.cancelIdle();
    await this.lock.run(async () => {
      await this.drop('session closed');
    });
    await this.hostChanges.close();
  }

  private async wake(): Promise<WakeInfo> {
    const t0 = performance.now();
    const doneWake = await this.admission.wakes.acquire(this.admission.opts.queueTimeoutMs);
    let releaseMem: (() => void) | undefined;
    try {
      releaseMem = await this.admission.reserveMemory(this.spec.memoryMiB, this.spec.session);
      const started = await this.startFromBestSlot();
      this.sandbox = started.sandbox;
      this.releaseMemory = releaseMem;
      this.metrics?.liveVms.inc();
      const sb = started.sandbox;
      void sb.exited.then((why) => {
        if (this.sandbox !== sb || this.retiring === sb) return;
        this.log.warn('vm.exited', { reason: why?.message });
        void this.lock.run(() => this.drop('exited on its own'));
      });
      // The tracker's changes are covered by the full diff a wake pushes.
      this.hostChanges.take();
      return { ...started.wake, wakeMs: performance.now() - t0 };
    } catch (err) {
      releaseMem?.();
      throw err;
    } finally {
      doneWake();
    }
  }

  private async startFromBestSlot(): Promise<{ sandbox: Sandbox; wake: WakeInfo }> {
    const candidates: Array<SlotRef | undefined> = [this.slots.current(), this.slots.previous()].filter((s) => s !== undefined);
    for (const slot of candidates) {
      try {
        return await this.backend.start(this.spec, slot);
      } catch (err) {
        this.log.error('vm.slot_restore_failed', { slot: slot?.dir, error: (err as Error).message });
      }
    }
    if (candidates.length) this.log.error('vm.slot_state_lost', { session: this.spec.session, note: 'no snapshot slot restored; starting from the pristine snapshot (changes outside /work and /tmp are lost)' });
    return this.backend.start(this.spec);
  }

  private async releaseLocked(why: string): Promise<ReleaseRecord | undefined> {
    const sb = this.sandbox;
    if (!sb) return undefined;
    this.retiring = sb;
    const t0 = performance.now();
    let record: ReleaseRecord;
    try {
      const st = await sb.state();
      if (st.dirty && this.backend.canSuspend && sb.suspend) {
        const suspend = sb.suspend.bind(sb);
        const slot = await this.slots.write(async (dir) => (await suspend(dir)).slot);
        record = {
          decision: 'snapshot',
          reason: `${why}: changed outside /work and /tmp (${st.dirtyPaths.slice(0, 3).join(', ')}${st.dirtyPaths.length > 3 ? ', ...' : ''}), kept in slot ${slot.dir.slice(-1)}`,
          ms: performance.now() - t0,
          bytesWritten: dirSize(slot),
        };
      } else {
        await sb.close();
        record = { decision: 'kill', reason: `${why}: nothing changed outside /work and /tmp; the host workspace is the whole state`, ms: performance.now() - t0, bytesWritten: 0 };
      }
    } catch (err) {
      // A release that fails (disk full while writing a slot) must not keep the VM alive
      // forever nor damage the previous slot: the slot writer already cleaned its temp dir.
      await sb.close().catch(() => undefined);
      record = { decision: 'kill', reason: `${why}: snapshot failed (${(err as Error).message}); VM killed, the last good slot is kept`, ms: performance.now() - t0, bytesWritten: 0 };
      this.log.error('vm.release_failed', { error: (err as Error).message });
    }
    this.forget();
    this.lastRelease = record;
    this.metrics?.releases.inc({ decision: record.decision });
    this.metrics?.releaseSeconds.observe({ decision: record.decision }, record.ms / 1000);
    if (record.bytesWritten) this.metrics?.releaseBytes.inc({ decision: record.decision }, record.bytesWritten);
    this.log.info('vm.released', { ...record, ms: Math.round(record.ms) });
    return record;
  }

  private async drop(why: string): Promise<void> {
    const sb = this.sandbox;
    if (!sb) return;
    this.retiring = sb;
    this.forget();
    await sb.close().catch(() => undefined);
    this.log.info('vm.dropped', { why });
  }

  private forget(): void {
    if (!this.sandbox) return;
    this.sandbox = undefined;
    this.releaseMemory?.();
    this.releaseMemory = undefined;
    this.metrics?.liveVms.dec();
    this.cancelIdle();
  }

  private scheduleIdle(): void {
    this.cancelIdle();
    if (!this.sandbox || this.closed) return;
    this.idleTimer = setTimeout(() => void this.release('idle').catch((err: unknown) => this.log.error('vm.release_error', { error: (err as Error).message })), this.opts.idleMs);
    this.idleTimer.unref();
  }

  private cancelIdle(): void {
    if (this.idleTimer) clearTimeout(this.idleTimer);
    this.idleTimer = undefined;
  }
}

function dirSize(slot: SlotRef): number {
  try {
    return statSync(slot.state).size + statSync(slot.manifest).size;
  } catch {
    return 0;
  }
}
