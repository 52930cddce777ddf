import { statSync } from 'node:fs';
import { performance } from 'node:perf_hooks';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { TelemetrySample } from '../../../guest-agent/src/protocol/methods-telemetry.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import type { Admission } from '../admission.ts';
import type { Sandbox, SandboxSpec, SlotRef, StartOptions, VmBackend, WakeInfo } from '../backends/backend.ts';
import type { BrokerMetrics } from '../metrics.ts';
import type { SandboxPolicy } from '../policy/sandbox-policy.ts';
import { chooseRelease, type ReleaseDecision } from './release-policy.ts';
import { HostChangeTracker, type HostChanges } from '../sync/host-changes.ts';
import { SerialQueue } from '../util/serial-queue.ts';
import { SnapshotSlots } from './snapshot-slots.ts';
import type { SlotDiskBudget } from './slot-disk-budget.ts';
import type { SandboxNetwork } from '../network/sandbox-network.ts';
import type { Duplex } from 'node:stream';

export interface LifecycleOptions {
  policy: SandboxPolicy;
  /** Sequential write bandwidth snapshots get, MiB/s (the cost model's disk figure). */
  diskMiBps?: number;
  /** The data dir's disk slots may take (none: unbounded). */
  slotDisk?: SlotDiskBudget;
  /**
   * Runs a write into the host workspace made outside a call (a release's pull of what the
   * guest wrote since), as the session orders those against a fast-path git run.
   */
  writing?: <T>(fn: () => Promise<T>) => Promise<T>;
  /** The session's network: every VM it wakes serves its guest's connections under it. */
  network?: SandboxNetwork;
}

export type { ReleaseDecision } from './release-policy.ts';

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
 * /work and /tmp changed and no process is alive (the host owns the workspace and pushes
 * it back on the next wake); otherwise it snapshots it into one of two alternating slots
 * (the next wake restores exactly that state) or keeps it and reclaims its memory (the
 * next wake prefetches what the last call touched). release-policy.ts decides.
 *
 * VM calls and releases are serialised by a lock of their own, so file tools and
 * fast-path calls of the session never wait for a release to finish.
 */
export class SandboxLifecycle {
  private sandbox: Sandbox | undefined;
  /** A sandbox being released: its exit is expected, not a crash. */
  private retiring: Sandbox | undefined;
  /** Set while a VM is being started: close() calls it so a wake stuck on a wedged guest ends now. */
  private cancelWake: (() => void) | undefined;
  private releaseMemory: (() => void) | undefined;
  private idleTimer: NodeJS.Timeout | undefined;
  private readonly lock = new SerialQueue();
  private readonly slots: SnapshotSlots;
  readonly hostChanges: HostChangeTracker;
  private closed = false;
  /** The live VM's memory was reclaimed at its last release: the next call is a wake from reclaim. */
  private reclaimed = false;
  private idleSince: number | undefined;
  private idleTotalMs = 0;
  private idlePeriods = 0;
  /** Connections a harness holds open to ports in the VM: the idle window does not run while any is open. */
  private portHolds = 0;
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
    // Slots a session kept across a broker restart hold disk from the start.
    opts.slotDisk?.set(spec.session, this.principal, this.slots.bytes());
    this.hostChanges = new HostChangeTracker(spec.workspaceDir, log);
  }

  private get principal(): string {
    return this.spec.principal ?? '';
  }

  get live(): boolean {
    return this.sandbox !== undefined;
  }

  /** The VM's state as the broker knows it, without asking the guest (what /metrics reports). */
  get vmState(): 'none' | 'live' | 'reclaimed' {
    return this.sandbox === undefined ? 'none' : this.reclaimed ? 'reclaimed' : 'live';
  }

  /** The live sandbox, if any (fault injection in bench/soak.ts; nothing else should reach past the lock). */
  liveSandbox(): Sandbox | undefined {
    return this.sandbox;
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
      this.noteActive();
      const wake = this.sandbox ? await this.resumeLive() : await this.wake();
      const sb = this.sandbox as Sandbox;
      const t0 = performance.now();
      const done = await this.admission.admitVmCall(this.spec.principal);
      const queuedMs = performance.now() - t0;
      try {
        const value = await fn(sb, this.hostChanges.take());
        // The last phase of a wake: the call itself handed to the guest (after admission and any host changes).
        if (wake.woke && wake.phases && wake.startedAt !== undefined && sb.callSentAt !== undefined && sb.callSentAt >= wake.startedAt) wake.phases['exec'] = Math.round(sb.callSentAt - wake.startedAt);
        return { value, wake, queuedMs };
      } catch (err) {
        if (err instanceof HutchError && (err.code === 'guest_crashed' || err.code === 'guest_unresponsive')) await this.drop(err.code === 'guest_crashed' ? 'crashed during a call' : 'stopped answering');
        throw err;
      } finally {
        done();
        this.scheduleIdle();
      }
    });
  }

  /**
   * A connection to `port` on the VM's loopback (a harness reaching a server a tenant
   * started), waking the VM if it is released. The VM is held live while the connection
   * is open, without holding the session's VM lock: calls go on beside it.
   */
  async openPort(port: number): Promise<{ socket: Duplex; done: Promise<unknown>; wake: WakeInfo }> {
    const { sb, wake } = await this.lock.run(async () => {
      if (this.closed) throw new HutchError('not_found', `session ${this.spec.session} is closed`);
      this.cancelIdle();
      this.noteActive();
      const w = this.sandbox ? await this.resumeLive() : await this.wake();
      this.portHolds++;
      return { sb: this.sandbox as Sandbox, wake: w };
    });
    let released = false;
    const release = () => {
      if (released) return;
      released = true;
      this.portHolds--;
      if (this.portHolds === 0 && this.sandbox === sb) this.scheduleIdle();
    };
    try {
      const { socket, done } = sb.agent.dial(port);
      socket.once('close', release);
      done.finally(release).catch(() => undefined);
      return { socket, done, wake };
    } catch (err) {
      release();
      throw err;
    }
  }

  /** What the VM is doing now; a reclaimed VM is not sampled (that would fault its memory back in). */
  async telemetry(): Promise<{ vm: 'none' | 'live' | 'reclaimed'; sample?: TelemetrySample; error?: string }> {
    const sb = this.sandbox;
    if (!sb) return { vm: 'none' };
    if (this.reclaimed || !sb.telemetry) return { vm: this.reclaimed ? 'reclaimed' : 'live' };
    try {
      const sample = await sb.telemetry();
      this.metrics?.recordGuestSample(sample);
      return { vm: 'live', sample };
    } catch (err) {
      return { vm: 'live', error: (err as Error).message };
    }
  }

  /** Starts a wake ahead of a call (the harness says a tool call is being generated). */
  prewarm(): void {
    if ((this.sandbox && !this.reclaimed) || this.closed) return;
    void this.lock
      .run(async () => {
        if (this.closed) return;
        if (!this.sandbox) await this.wake();
        // A reclaimed VM is alive: reading its last call's pages back is its wake.
        else if (this.reclaimed) await this.resumeLive();
        else return;
        this.scheduleIdle();
      })
      .catch((err: unknown) => this.log.warn('vm.prewarm_failed', { error: (err as Error).message }));
  }

  /** Releases now (idle window over, or the harness says the agent is idle/compacting). */
  release(why: string): Promise<ReleaseRecord | undefined> {
    return this.lock.run(() => this.releaseLocked(why, false));
  }

  /**
   * Ends the session's VM in bounded time: a call still holding the lock after `graceMs`
   * (its guest wedged, or a long command the caller already cancelled) has its VM stopped
   * under it, which fails the call at once and frees the lock.
   */
  async close(graceMs = CLOSE_GRACE_MS): Promise<void> {
    this.closed = true;
    this.cancelIdle();
    // A wake in progress holds the lock and has no sandbox yet to stop: end it (its VM is
    // abandoned) instead of waiting out its deadline for a guest that may never answer.
    this.cancelWake?.();
    const dropped = this.lock.run(async () => {
      await this.drop('session closed');
    });
    if (!(await settlesWithin(dropped, graceMs))) {
      const sb = this.sandbox;
      this.log.warn('vm.close_forced', { graceMs, live: sb !== undefined });
      if (sb) {
        this.retiring = sb;
        await sb.close().catch(() => undefined);
      }
      await settlesWithin(dropped, graceMs);
    }
    await this.hostChanges.close();
    this.opts.slotDisk?.forget(this.spec.session);
  }

  /** Releases for a broker shutdown, in bounded time (a release that hangs is abandoned and the VM stopped). */
  async shutdownRelease(graceMs = SHUTDOWN_RELEASE_MS): Promise<void> {
    // The VM stops after this release: one reclaimed earlier (or that the policy would
    // reclaim now) is snapshotted, or its processes and home would die with it.
    const released = this.lock.run(() => this.releaseLocked('broker shutdown', true)).catch((err: unknown) => this.log.warn('vm.release_failed', { error: (err as Error).message }));
    if (!(await settlesWithin(released, graceMs))) this.log.warn('vm.shutdown_release_abandoned', { graceMs });
    await this.close();
  }

  /** A live VM: nothing to do, unless it was reclaimed, then prefetch what its last call touched. */
  private async resumeLive(): Promise<WakeInfo> {
    if (!this.reclaimed) return { wakeMs: 0, woke: false, how: 'live' };
    this.reclaimed = false;
    const sb = this.sandbox as Sandbox;
    const prefetch = this.spec.memoryPolicy?.prefetch ?? this.opts.policy.prefetch;
    const t0 = performance.now();
    try {
      // The guest's own policy: it prefetches alongside the call, never before it.
      await sb.wakeFromReclaim?.();
    } catch (err) {
      // A failed wake of the policy only costs speed: the call faults its pages in instead.
      this.log.warn('vm.memory_policy_failed', { error: (err as Error).message });
    }
    return { wakeMs: performance.now() - t0, woke: true, how: prefetch ? 'reclaimed-prefetch' : 'reclaimed' };
  }

  private async wake(): Promise<WakeInfo> {
    const t0 = performance.now();
    const doneWake = await this.admission.wakes.acquire(this.admission.opts.queueTimeoutMs, this.spec.principal);
    let releaseMem: (() => void) | undefined;
    try {
      releaseMem = await this.admission.reserveMemory(this.spec.memoryMiB, this.spec.session, this.spec.principal);
      // The wake's push scans the host workspace as it is from here on: host changes seen
      // until now are in it, and any seen later are the next call's to push (taking them
      // after the push would drop a change that landed while it ran).
      this.hostChanges.take();
      // Watched only while a VM lives: the watches are host-wide resources, and a wake scans anyway.
      this.hostChanges.watch();
      const started = await this.startFromBestSlot();
      this.sandbox = started.sandbox;
      if (this.opts.network) started.sandbox.agent.network = this.opts.network;
      this.releaseMemory = releaseMem;
      this.metrics?.liveVms.inc();
      const sb = started.sandbox;
      void sb.exited.then((why) => {
        if (this.sandbox !== sb || this.retiring === sb) return;
        this.log.warn('vm.exited', { reason: why?.message });
        void this.lock.run(() => this.drop('exited on its own'));
      });
      return { ...started.wake, wakeMs: performance.now() - t0 };
    } catch (err) {
      releaseMem?.();
      if (!this.sandbox) void this.hostChanges.unwatch().catch(() => undefined);
      throw err;
    } finally {
      doneWake();
    }
  }

  private async startFromBestSlot(): Promise<{ sandbox: Sandbox; wake: WakeInfo }> {
    const candidates: SlotRef[] = [this.slots.current(), this.slots.previous()].filter((s) => s !== undefined);
    for (const slot of candidates) {
      try {
        return await this.startWithin({ from: slot });
      } catch (err) {
        if (this.closed) throw err;
        this.log.error('vm.slot_restore_failed', { slot: slot?.dir, error: (err as Error).message });
      }
    }
    if (this.closed) throw new HutchError('cancelled', `session ${this.spec.session} closed while its VM was waking`, { session: this.spec.session });
    if (candidates.length) this.log.error('vm.slot_state_lost', { session: this.spec.session, note: 'no snapshot slot restored; starting from the pristine snapshot (changes outside /work and /tmp are lost)' });
    return this.startWithin({ coldBoot: this.opts.policy.wake === 'cold-boot' });
  }

  /**
   * A wake with a deadline of its own, over and above the deadlines of its steps: whatever
   * a backend waits on, the call gets an answer. A start that finishes after its deadline is
   * stopped at once, and the backend is told to drop what it had begun (the VM's process).
   */
  private async startWithin(opts: StartOptions): Promise<{ sandbox: Sandbox; wake: WakeInfo }> {
    const limit = opts.coldBoot ? COLD_BOOT_DEADLINE_MS : WAKE_DEADLINE_MS;
    const started = this.backend.start(this.spec, opts);
    let timer: NodeJS.Timeout | undefined;
    const expired = new Promise<undefined>((resolve) => {
      timer = setTimeout(() => resolve(undefined), limit);
      timer.unref();
    });
    const cancelled = new Promise<'cancelled'>((resolve) => (this.cancelWake = () => resolve('cancelled')));
    if (this.closed) this.cancelWake?.();
    const r = await Promise.race([started.then((v) => ({ v })), expired, cancelled]).finally(() => {
      clearTimeout(timer);
      this.cancelWake = undefined;
    });
    if (r && r !== 'cancelled') return r.v;
    started.then((late) => late.sandbox.close(), () => undefined).catch(() => undefined);
    await this.backend.abandon?.(this.spec).catch(() => undefined);
    if (r === 'cancelled') {
      this.log.warn('vm.wake_cancelled', { session: this.spec.session });
      throw new HutchError('cancelled', `session ${this.spec.session} closed while its VM was waking; the VM was stopped, the host workspace is unchanged`, { session: this.spec.session });
    }
    this.log.error('vm.wake_deadline', { session: this.spec.session, limitMs: limit, from: opts.from ? 'slot' : opts.coldBoot ? 'cold boot' : 'pristine' });
    throw new HutchError('guest_unresponsive', `waking the VM of session ${this.spec.session} took longer than ${limit} ms; it was stopped, the host workspace is unchanged`, { session: this.spec.session, limitMs: limit });
  }

  private async releaseLocked(why: string, final: boolean): Promise<ReleaseRecord | undefined> {
    const sb = this.sandbox;
    if (!sb || (this.reclaimed && !final)) return undefined;
    const t0 = performance.now();
    let record: ReleaseRecord;
    let keep = false;
    try {
      const st = this.opts.writing ? await this.opts.writing(() => sb.state()) : await sb.state();
      const choice = chooseRelease(this.opts.policy, {
        dirty: st.dirty,
        dirtyPaths: st.dirtyPaths,
        processes: st.processes,
        canSuspend: this.backend.canSuspend && sb.suspend !== undefined,
        canReclaim: sb.reclaim !== undefined,
        memoryMiB: this.spec.memoryMiB,
        budgetFreeMiB: this.admission.freeMiB,
        meanIdleMs: this.idlePeriods ? this.idleTotalMs / this.idlePeriods : undefined,
        diskMiBps: this.opts.diskMiBps ?? DEFAULT_DISK_MIBPS,
        final,
      });
      let reason = `${why}: ${choice.reason}`;
      let decision = choice.decision;
      let grant = decision === 'snapshot' ? this.slotRoom(final) : undefined;
      if (grant && 'refused' in grant) {
        // No disk for a slot: keep the VM reclaimed (its memory is already reserved), which
        // loses nothing; a VM that stops anyway has nowhere to keep its state.
        this.log.warn('vm.slot_refused', { session: this.spec.session, principal: this.spec.principal, final, why: grant.refused });
        decision = !final && sb.reclaim ? 'reclaim' : 'kill';
        reason += `; no slot: ${grant.refused}, so ${decision === 'reclaim' ? 'the VM is kept and reclaimed' : 'it is stopped and its state outside the workspace is lost'}`;
        grant = undefined;
      }
      if (decision === 'snapshot' && sb.suspend) {
        this.retiring = sb;
        const suspend = sb.suspend.bind(sb);
        try {
          const slot = await this.slots.write(async (dir) => (await suspend(dir)).slot);
          record = { decision: 'snapshot', reason: `${reason}; kept in slot ${slot.dir.slice(-1)}`, ms: performance.now() - t0, bytesWritten: dirSize(slot) };
        } finally {
          grant?.settle(this.slots.bytes());
        }
      } else if (decision === 'reclaim' && sb.reclaim) {
        const r = await sb.reclaim();
        keep = true;
        record = { decision: 'reclaim', reason: `${reason}; ${(r.reclaimedBytes / 1048576).toFixed(1)} MiB reclaimed`, ms: performance.now() - t0, bytesWritten: r.reclaimedBytes };
      } else {
        this.retiring = sb;
        await sb.close();
        record = { decision: 'kill', reason, ms: performance.now() - t0, bytesWritten: 0 };
      }
    } catch (err) {
      // A release that fails (disk full while writing a slot) must not keep the VM alive
      // forever nor damage the previous slot: the slot writer already cleaned its temp dir.
      this.retiring = sb;
      await sb.close().catch(() => undefined);
      keep = false;
      record = { decision: 'kill', reason: `${why}: release failed (${(err as Error).message}); VM killed, the last good slot is kept`, ms: performance.now() - t0, bytesWritten: 0 };
      this.log.error('vm.release_failed', { error: (err as Error).message });
    }
    if (keep) this.reclaimed = true;
    else this.forget();
    this.lastRelease = record;
    this.metrics?.releases.inc({ decision: record.decision });
    this.metrics?.releaseSeconds.observe({ decision: record.decision }, record.ms / 1000);
    if (record.bytesWritten) this.metrics?.releaseBytes.inc({ decision: record.decision }, record.bytesWritten);
    this.log.info('vm.released', { ...record, ms: Math.round(record.ms) });
    return record;
  }

  /** Room on the data dir's disk for the slot a release is about to write (a grant, or why not). */
  private slotRoom(final: boolean): ReturnType<SlotDiskBudget['reserve']> | undefined {
    const budget = this.opts.slotDisk;
    const max = this.backend.slotBytesMax?.({ memoryMiB: this.spec.memoryMiB });
    if (!budget || max === undefined) return undefined;
    return budget.reserve(this.spec.session, this.principal, max, this.slots.replacedBytes(), final);
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
    void this.hostChanges.unwatch().catch(() => undefined);
    this.reclaimed = false;
    this.releaseMemory?.();
    this.releaseMemory = undefined;
    this.metrics?.liveVms.dec();
    this.cancelIdle();
  }

  private scheduleIdle(): void {
    this.cancelIdle();
    this.idleSince = performance.now();
    const idleMs = this.opts.policy.idleMs;
    if (!this.sandbox || this.closed || idleMs === null || this.portHolds > 0) return;
    this.idleTimer = setTimeout(() => void this.release('idle').catch((err: unknown) => this.log.error('vm.release_error', { error: (err as Error).message })), idleMs);
    this.idleTimer.unref();
  }

  /** Idle periods feed the cost model: how much snapshot traffic per period is affordable. */
  private noteActive(): void {
    if (this.idleSince === undefined) return;
    this.idleTotalMs += performance.now() - this.idleSince;
    this.idlePeriods++;
    this.idleSince = undefined;
  }

  private cancelIdle(): void {
    if (this.idleTimer) clearTimeout(this.idleTimer);
    this.idleTimer = undefined;
  }
}

/** A wake's own deadline: restores take seconds (minutes on a loaded TCG host), cold boots longer. */
const WAKE_DEADLINE_MS = 300_000;
const COLD_BOOT_DEADLINE_MS = 900_000;
/** How long close() lets a call in flight finish before stopping its VM under it. */
const CLOSE_GRACE_MS = 5_000;
/** How long a shutdown release (a snapshot into a slot) may take before the VM is just stopped. */
const SHUTDOWN_RELEASE_MS = 60_000;

function settlesWithin(p: Promise<unknown>, ms: number): Promise<boolean> {
  return new Promise((resolve) => {
    const t = setTimeout(() => resolve(false), ms);
    t.unref();
    p.then(
      () => {
        clearTimeout(t);
        resolve(true);
      },
      () => {
        clearTimeout(t);
        resolve(true);
      },
    );
  });
}

/** A SATA SSD's sequential write speed as measured here (~293 MB/s). */
const DEFAULT_DISK_MIBPS = 280;

function dirSize(slot: SlotRef): number {
  try {
    // The swap disk is sparse: what it holds is its allocated blocks.
    return statSync(slot.state).size + statSync(slot.manifest).size + (slot.swap ? statSync(slot.swap).blocks * 512 : 0);
  } catch {
    return 0;
  }
}
