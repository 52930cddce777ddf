import { existsSync, mkdirSync, readFileSync, rmSync, statSync, utimesSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import { Workspace } from '../../../guest-agent/src/workspace/confine.ts';
import { WorkspaceSync } from '../../../guest-agent/src/workspace/sync.ts';
import type { TelemetrySample } from '../../../guest-agent/src/protocol/methods-telemetry.ts';
import type { ResultOf } from '../../../guest-agent/src/protocol/methods.ts';
import { hostTscKhz } from '../../../kernel-configs/boot-params.ts';
import type { AgentClient } from '../agent-client.ts';
import type { HostChanges } from '../sync/host-changes.ts';
import { readManifest, writeManifest } from '../sync/manifest.ts';
import { fsyncPath } from '../lifecycle/snapshot-slots.ts';
import { WorkspaceMirror } from '../sync/workspace-mirror.ts';
import type { PullError } from '../sync/pull-journal.ts';
import { chooseAccel } from '../vm/accel.ts';
import { connectAgent, detachAgent, resumeGuest } from '../vm/agent-channel.ts';
import { KVM_DEADLINES, TCG_DEADLINES, type DeadlinePolicy } from '../deadlines.ts';
import { ensureGuestImage, type KernelChoice, type ResolvedGuestImage } from '../vm/guest-image.ts';
import { cleanupOrphans } from '../vm/orphans.ts';
import { QemuDriver, qemuPids } from '../vm/qemu-driver.ts';
import { SnapshotStore } from '../vm/snapshot-store.ts';
import { StandbyPool } from '../vm/standby-pool.ts';
import { saveSwapDisk } from '../vm/swap-disk.ts';
import { warmStandby } from '../vm/standby-warmup.ts';
import { TemplateImages, type TemplateImage } from '../templates/images.ts';
import type { Accel, Vm } from '../vm/vmm.ts';
import { AfterRunError, type GuestState, type ReclaimInfo, type Sandbox, type SandboxExecRequest, type SandboxSpec, type SlotRef, type StandbyRoom, type StartOptions, type Synced, type SyncedExecResult, type VmBackend, type WakeInfo } from './backend.ts';

export interface QemuBackendOptions {
  dataDir: string;
  cacheDir: string;
  log: Logger;
  kernel?: KernelChoice;
  accel?: Accel;
  swapMiB?: number;
  /** Largest file pulled back from a guest. */
  maxFileBytes?: number;
  tcgTbMiB?: number;
  /** See QemuBackend.deadAfterMs. */
  guestDeadAfterMs?: number;
  /** Use the cached guest image only (`hutch serve --no-build`). */
  noBuild?: boolean;
  /**
   * Standby VMs kept restored and warmed for the most recently woken template and size
   * (`hutch serve --standby N`, default 1 there): a wake that takes one skips the restore,
   * the channel and the guest's first run of the wake's code. 0 (the default here): none.
   */
  standby?: number;
  /** A standby not taken within this many ms is stopped (default 10 minutes). */
  standbyIdleMs?: number;
}

/** What a broker without KVM loses, and how to find out why it has none. */
export function tcgWarning(why: string): string {
  return (
    `no KVM (${why}): VMs run under QEMU's TCG, which emulates every guest instruction, so booting, waking and running commands in a VM ` +
    'take seconds where KVM takes milliseconds, and a host holds far fewer busy tenants. To check KVM: `ls -l /dev/kvm` (it must exist and be ' +
    'readable and writable by this user), `grep -cwE "vmx|svm" /proc/cpuinfo` (0: virtualization is off in the firmware, or the hypervisor ' +
    'below this machine does not pass it through: enable nested virtualization there), `lsmod | grep kvm` (kvm_intel or kvm_amd loaded).'
  );
}

/** A VM restored from a pristine snapshot and warmed, waiting for a session (vm/standby-pool.ts). */
interface StandbyVm {
  vm: Vm;
  agent: AgentClient;
  readyAt: number;
  /** Gives its room in the broker's memory budget back (taken by a wake, or stopped). */
  releaseRoom: (() => void) | undefined;
}

/** Nice value of a standby VM while it is prepared and waits: it yields to VMs serving calls. */
const STANDBY_NICENESS = 10;

/** HOME of the tenant user inside the guest, as a path under the overlay's upper layer. */
const GUEST_HOME = 'home/tenant/';

/**
 * The `qemu` backend: each session's VM is restored copy-on-write from the pristine
 * snapshot (or from its own snapshot slot when it had changed state outside the
 * workspace), the host workspace is pushed in, and after every call the guest's changes
 * are pulled back to the host, which stays the source of truth.
 */
export class QemuBackend implements VmBackend {
  readonly name = 'qemu';
  readonly isolation = 'a microVM per session (QEMU microvm, its own kernel), restored from a snapshot';
  readonly canSuspend = true;
  readonly guestNetwork = true;
  readonly accel: Accel;
  private readonly runRoot: string;
  private readonly sandboxes = new Set<QemuSandbox>();
  /** VMs of wakes in progress, by session: abandon() stops them whatever their run dir. */
  private readonly waking = new Map<string, Vm>();
  /** Sessions whose wake was abandoned (closed, past its deadline): a failed standby is not retried for them. */
  private readonly abandoned = new Set<string>();
  readonly standby: StandbyPool<StandbyVm>;
  /** What a standby key stands for: the template and size to restore. */
  private readonly standbyKeys = new Map<string, { template: string | undefined; size: { memoryMiB: number; cpus: number; swapMiB: number } }>();
  private standbyCount = 0;
  /** Standby VMs still being prepared: a shutdown stops them rather than waiting for their warm-up. */
  private readonly preparing = new Set<Vm>();
  /** The broker's memory budget, once attached: standbys hold room in it and give it up to wakes. */
  private budget: StandbyRoom | undefined;

  private constructor(
    private readonly opts: QemuBackendOptions,
    accel: Accel,
    readonly accelReason: string,
    readonly image: ResolvedGuestImage,
    readonly driver: QemuDriver,
    readonly snapshots: SnapshotStore,
  ) {
    this.accel = accel;
    this.runRoot = join(opts.dataDir, 'vms');
    this.standby = new StandbyPool<StandbyVm>({
      size: opts.standby ?? 0,
      idleMs: opts.standbyIdleMs ?? 600_000,
      // A fill under way is usually the quicker way to a warm VM; past this, restore anew.
      joinMs: 1_000 * this.deadlines.scale,
      log: opts.log,
      fill: (key) => this.fillStandby(key),
      dispose: async (s) => {
        s.releaseRoom?.();
        s.agent.close();
        await s.vm.destroy();
      },
      alive: (s) => s.vm.running && s.agent.connection.isOpen,
      canFill: () => this.roomForStandby(),
    });
  }

  static async create(opts: QemuBackendOptions): Promise<QemuBackend> {
    const image = await ensureGuestImage({ ...(opts.kernel ? { kernel: opts.kernel } : {}), ...(opts.noBuild ? { noBuild: true } : {}), log: (m, part) => opts.log.info('guest.build', { ...(part ? { part } : {}), detail: m }) });
    const accel = await chooseAccel(image.kernel, { cacheDir: opts.cacheDir, log: opts.log, ...(opts.accel ? { force: opts.accel } : {}) });
    if (accel.accel === 'tcg' && !opts.accel) opts.log.warn('accel.tcg', { why: accel.reason, text: tcgWarning(accel.reason) });
    // Under TCG the guest's TSC is the host's: telling the kernel its frequency skips the
    // calibration that is slow and flaky in an emulator.
    const tscKhz = accel.accel === 'tcg' ? (await hostTscKhz()).khz : undefined;
    const driver = new QemuDriver({ accel: accel.accel, log: opts.log, ...(tscKhz ? { tscKhz } : {}), ...(opts.tcgTbMiB ? { tcgTbMiB: opts.tcgTbMiB } : {}) });
    const b = new QemuBackend(opts, accel.accel, accel.reason, image, driver, new SnapshotStore(opts.cacheDir, driver, opts.log));
    const orphans = cleanupOrphans(b.runRoot, opts.log);
    if (orphans.killed) opts.log.warn('vm.orphans', orphans);
    mkdirSync(b.runRoot, { recursive: true });
    opts.log.info('backend.qemu', { accel: accel.accel, why: accel.reason, image: image.describe });
    return b;
  }

  /** Makes sure the pristine snapshot for this size exists (boots and snapshots once). */
  async prepare(size: { memoryMiB: number; cpus: number }): Promise<void> {
    await this.snapshots.pristine(this.image, { ...size, swapMiB: this.swapMiB() });
  }

  attachMemoryBudget(budget: StandbyRoom): void {
    this.budget = budget;
  }

  /** The guest image's files are all still there (an operator may wipe the cache under a running broker). */
  notReady(): string | undefined {
    const parts: Array<[string, string | undefined]> = [['kernel', this.image.kernel], ['initrd', this.image.initrd], ['agent layer', this.image.agentLayer], ['root filesystem', this.image.rootfs]];
    const missing = parts.filter(([, f]) => f !== undefined && !existsSync(f)).map(([name]) => name);
    return missing.length ? `the guest image's ${missing.join(', ')} is missing from the cache: run hutch prepare` : undefined;
  }

  standbyStats(): { ready: number; filling: number } {
    const s = this.standby.stats();
    return { ready: s.ready, filling: s.filling };
  }

  async pristineKey(spec: SandboxSpec): Promise<string> {
    const t = this.template(spec.template);
    return t.snapshots.key(t.image, this.size(spec));
  }

  async start(spec: SandboxSpec, opts: StartOptions = {}): Promise<{ sandbox: Sandbox; wake: WakeInfo }> {
    this.abandoned.delete(spec.session);
    try {
      return await this.startOnce(spec, opts, true);
    } catch (err) {
      // A standby that died just before it was taken (its exit not yet seen) must not cost
      // the call: the wake starts over from the pristine snapshot, once.
      if (!(err instanceof StandbyLost) || this.abandoned.has(spec.session)) throw err instanceof StandbyLost ? err.cause : err;
      this.opts.log.warn('vm.standby_lost', { session: spec.session, error: (err.cause as Error).message });
      return this.startOnce(spec, opts, false);
    }
  }

  private async startOnce(spec: SandboxSpec, opts: StartOptions, useStandby: boolean): Promise<{ sandbox: Sandbox; wake: WakeInfo }> {
    const t0 = performance.now();
    this.markImageInUse();
    const { from } = opts;
    const size = this.size(spec);
    const t = this.template(spec.template);
    const pristine = await t.snapshots.pristine(t.image, size);
    if (from && from.pristineKey !== pristine.meta.key) {
      throw new HutchError('unavailable', `snapshot slot ${from.dir} was taken from another pristine snapshot (${from.pristineKey}); it cannot be restored`, { slot: from.dir });
    }
    const vmSpec = { id: spec.session, dir: join(this.runRoot, spec.session), image: t.image, ...size };
    const phases: Record<string, number> = {};
    const phase = (name: string) => void (phases[name] = Math.round(performance.now() - t0));
    let standby: StandbyVm | undefined;
    if (!from && !opts.coldBoot && useStandby) {
      this.standbyKeys.set(pristine.meta.key, { template: spec.template, size });
      standby = await this.standby.take(pristine.meta.key);
      // The wake reserved its own room before it started: the standby's is given back.
      standby?.releaseRoom?.();
    }
    let vm: Vm;
    try {
      if (standby) {
        vm = standby.vm;
        const refused = vm.setNiceness(0);
        // Not fatal (the VM works, at a lower priority than its neighbours), but never silent.
        if (refused) this.opts.log.warn('vm.standby_niceness', { session: spec.session, vm: vm.spec.id, error: refused, hint: 'a broker without CAP_SYS_NICE cannot give a standby VM its normal priority back; run hutch serve --standby 0' });
        phase('standby');
      } else {
        vm = opts.coldBoot && !from ? await this.driver.boot(vmSpec) : await this.driver.restore(vmSpec, { memory: pristine.memory, state: from ? from.state : pristine.state, ...(from?.swap ? { swap: from.swap } : {}) });
        phase('restore');
      }
    } catch (err) {
      this.standby.replenish();
      throw err;
    }
    const restoreMs = standby ? 0 : performance.now() - t0;
    this.waking.set(spec.session, vm);
    let agent: AgentClient | undefined = standby?.agent;
    try {
      // A cold-booted guest's agent waits for the broker's hello; its clock and RNG are fresh.
      agent ??= await connectAgent(vm, {
        timeoutMs: (opts.coldBoot ? 300_000 : 15_000) * this.deadlines.scale,
        log: this.opts.log,
        deadlines: this.deadlines,
        ...(this.deadAfterMs !== undefined ? { deadAfterMs: this.deadAfterMs } : {}),
      });
      if (!standby) phase('channel');
      // Entropy and the clock go first; the push runs while the guest sets its clock.
      // ...and /work is sized from the session's quota before the push fills it.
      const work = spec.quota ? { ...spec.quota, bytes: Math.min(spec.quota.bytes, this.workCapacityBytes(spec)) } : undefined;
      const resumed = opts.coldBoot ? undefined : resumeGuest(agent, work).finally(() => phase('resume'));
      resumed?.catch(() => undefined);
      const hostWs = new Workspace(spec.workspaceDir);
      const mirror = new WorkspaceMirror(hostWs, new WorkspaceSync(hostWs), { stateDir: spec.stateDir });
      // From a slot the guest already holds the workspace as it was: push only the difference.
      if (from) mirror.guestView = await readManifest(from.manifest);
      // The marker rides on the push's last batch; after a pristine restore the agent records
      // what it applies into its empty /work rather than scanning it afterwards, and from a
      // slot it builds on the slot's last pull marker (what the guest wrote after that pull
      // is still pulled after the call).
      const pushed = await mirror.push(agent, undefined, { fresh: !from, mark: true, ...(from?.syncMarker ? { since: from.syncMarker } : {}) });
      phase('push');
      const first = resumed ? await resumed : undefined;
      if (first?.workError) this.opts.log.error('vm.work_size_failed', { session: spec.session, error: first.workError });
      const clock = first ? await settleClock(agent, first, spec.session, this.opts.log) : undefined;
      const mark = pushed.marker ?? (await agent.call('sync.mark', {}));
      phase('mark');
      agent.workspaceEntries = mark.entries;
      const sandbox = new QemuSandbox(spec, vm, agent, mirror, mark.marker, this.opts.maxFileBytes ?? 256 * 1024 * 1024, pristine.meta.key, this.opts.log, () => this.sandboxes.delete(sandbox));
      this.sandboxes.add(sandbox);
      // Not awaited: sent before the first call, so the agent has its policy when that call
      // starts, and applies it only then (off the wake's path).
      sandbox.activate().catch((err: unknown) => this.opts.log.warn('vm.memory_policy_failed', { session: spec.session, error: (err as Error).message }));
      const wakeMs = performance.now() - t0;
      const how = from ? 'slot-restore' : opts.coldBoot ? 'cold-boot' : standby ? 'standby' : 'pristine-restore';
      this.opts.log.info('vm.woke', { session: spec.session, how, ...(standby ? { standby: vm.spec.id, standbyAgeMs: Math.round(Date.now() - standby.readyAt) } : {}), wakeMs: Math.round(wakeMs), phases, pushedFiles: pushed.files, pushedBytes: pushed.bytes, ...(pushed.tooLong ? { pathsTooLong: pushed.tooLong } : {}), markedBy: pushed.marker?.markedBy ?? 'sync.mark', ...(clock ? { clockErrorMs: clock.errorMs } : {}) });
      return { sandbox, wake: { wakeMs, woke: true, how, pushedBytes: pushed.bytes, restoreMs, phases, startedAt: t0, ...(clock ? { clockErrorMs: clock.errorMs } : {}) } };
    } catch (err) {
      agent?.close();
      const died = !vm.running;
      await vm.destroy();
      // A VM that dies while waking (killed, out of memory) fails the call as a crash, not as a closed channel.
      if (died && err instanceof HutchError && err.code === 'connection_closed') {
        const crashed = new HutchError('guest_crashed', `the VM of session ${spec.session} died while waking; the host workspace is unchanged`, { session: spec.session });
        throw standby ? new StandbyLost(crashed) : crashed;
      }
      if (standby && err instanceof HutchError && (err.code === 'guest_crashed' || err.code === 'guest_unresponsive' || err.code === 'connection_closed')) throw new StandbyLost(err);
      throw err;
    } finally {
      this.waking.delete(spec.session);
      // After the wake, not beside it: a standby for the next one.
      this.standby.replenish();
    }
  }

  /** Restores a VM from the key's pristine snapshot and warms it (vm/standby-warmup.ts), at low CPU priority. */
  private async fillStandby(key: string): Promise<StandbyVm> {
    const k = this.standbyKeys.get(key);
    if (!k) throw new HutchError('internal', `no template is known for standby key ${key}`);
    const t = this.template(k.template);
    const pristine = await t.snapshots.pristine(t.image, k.size);
    // The template was rebuilt since: its old snapshot is not what the next wake restores.
    if (pristine.meta.key !== key) throw new HutchError('unavailable', `standby key ${key} is stale (the pristine snapshot is now ${pristine.meta.key})`);
    const id = `standby-${++this.standbyCount}`;
    const t0 = performance.now();
    // A standby holds room in the broker's memory budget like a live VM, and gives it up the
    // moment a wake needs it: stopped if ready, its preparation ended if not.
    const self: { vm?: Vm; item?: StandbyVm; yielded: boolean } = { yielded: false };
    const releaseRoom = this.budget?.reserveYielding(k.size.memoryMiB, () => {
      self.yielded = true;
      if (self.item) this.standby.discard(self.item, 'a wake needed its room in the memory budget');
      else void self.vm?.destroy();
    });
    if (this.budget && !releaseRoom) throw new HutchError('busy', `no room in the memory budget for a standby VM of ${k.size.memoryMiB} MiB`);
    let vm: Vm;
    try {
      vm = await this.driver.restore({ id, dir: join(this.runRoot, id), image: t.image, ...k.size, niceness: STANDBY_NICENESS }, { memory: pristine.memory, state: pristine.state });
    } catch (err) {
      releaseRoom?.();
      throw err;
    }
    self.vm = vm;
    let agent: AgentClient | undefined;
    this.preparing.add(vm);
    try {
      if (self.yielded) throw new HutchError('busy', 'standby stopped: a wake needed its room in the memory budget');
      agent = await connectAgent(vm, {
        timeoutMs: 15_000 * this.deadlines.scale,
        log: this.opts.log,
        deadlines: this.deadlines,
        ...(this.deadAfterMs !== undefined ? { deadAfterMs: this.deadAfterMs } : {}),
      });
      const warm = await warmStandby(agent, join(this.runRoot, `${id}.warm`), 60_000 * this.deadlines.scale);
      if (self.yielded) throw new HutchError('busy', 'standby stopped: a wake needed its room in the memory budget');
      this.opts.log.info('standby.ready', { vm: id, key, ms: Math.round(performance.now() - t0), warmMs: Math.round(warm.ms) });
      self.item = { vm, agent, readyAt: Date.now(), releaseRoom };
      return self.item;
    } catch (err) {
      releaseRoom?.();
      agent?.close();
      await vm.destroy();
      if (self.yielded) throw new HutchError('busy', 'standby stopped: a wake needed its room in the memory budget', { cause: (err as Error).message });
      throw err;
    } finally {
      this.preparing.delete(vm);
    }
  }

  /**
   * A standby may start while the host keeps room for a guest's full memory and 1 GiB
   * besides, and the broker's memory budget has room for it with no wake waiting.
   */
  private roomForStandby(): boolean {
    const largest = Math.max(0, ...[...this.standbyKeys.values()].map((k) => k.size.memoryMiB));
    return availableMiB() >= largest + 1024 && (this.budget?.roomToYield(largest) ?? true);
  }

  async abandon(spec: SandboxSpec): Promise<void> {
    this.abandoned.add(spec.session);
    await this.waking.get(spec.session)?.destroy().catch(() => undefined);
    const dir = join(this.runRoot, spec.session);
    for (const pid of qemuPids(dir)) {
      try {
        process.kill(pid, 'SIGKILL');
      } catch {
        // gone
      }
    }
    // A killed QEMU takes a moment to let go of its guest's memory (longer on a loaded
    // host): the close that abandoned it returns once it is gone, not while it is still
    // exiting (a test saw it there right after close, once, under CI load).
    for (let i = 0; i < ABANDON_WAIT_STEPS && qemuPids(dir).length > 0; i++) await new Promise((r) => setTimeout(r, 20));
    rmSync(dir, { recursive: true, force: true });
  }

  async shutdown(): Promise<void> {
    // The pool closes first (no new fill starts), then a standby being warmed is stopped
    // now (its fill fails) rather than waited for.
    const pool = this.standby.close();
    await Promise.all([...this.preparing].map((vm) => vm.destroy()));
    await pool;
    await Promise.all([...this.sandboxes].map((s) => s.close()));
    cleanupOrphans(this.runRoot, this.opts.log);
  }

  /**
   * How long a guest may stay silent while calls wait before it counts as unresponsive
   * (`HUTCH_GUEST_DEAD_AFTER_MS`; default: the deadline policy's, 20 s x its scale).
   */
  private get deadAfterMs(): number | undefined {
    const v = this.opts.guestDeadAfterMs ?? Number(process.env['HUTCH_GUEST_DEAD_AFTER_MS'] ?? NaN);
    return Number.isFinite(v) && v > 0 ? v : undefined;
  }

  private templateImages: TemplateImages | undefined;

  /** A session's template: its image and its own pristine snapshots (templates/images.ts); not_found when unknown. */
  template(name?: string): TemplateImage {
    this.templateImages ??= new TemplateImages({ name: 'default', image: this.image, snapshots: this.snapshots }, this.opts.dataDir, this.driver, this.opts.log);
    return this.templateImages.get(name);
  }

  /** Checks at create that a template exists (the same lookup a wake does). */
  checkTemplate(name: string): void {
    this.template(name);
  }

  private imageTouchedAt = 0;

  /** Keeps the image's cache entry fresh so a build of another image never prunes it under us (rootfs/prune.ts). */
  private markImageInUse(): void {
    if (Date.now() - this.imageTouchedAt < 60_000) return;
    this.imageTouchedAt = Date.now();
    const now = new Date();
    try {
      utimesSync(dirname(this.image.rootfs), now, now);
    } catch {
      // a read-only cache: prune cannot remove it either
    }
  }

  /** Guest RPC deadlines: an emulated guest gets several times a KVM guest's. */
  get deadlines(): DeadlinePolicy {
    return this.accel === 'kvm' ? KVM_DEADLINES : TCG_DEADLINES;
  }

  /**
   * /work is a tmpfs, so what it holds lives in the guest's RAM and swap. Filled past them
   * (an 800 MB workspace pushed into a 256 MiB guest with 512 MiB of swap) the guest thrashed
   * for minutes until the OOM killer took the agent. Half the RAM is left to the kernel, the
   * agent and the tenant's processes; a workspace above the rest is refused before a wake.
   */
  workCapacityBytes(size: { memoryMiB: number }): number {
    return (Math.floor(size.memoryMiB / 2) + this.swapMiB()) * 1024 * 1024;
  }

  slotBytesMax(size: { memoryMiB: number }): number {
    // The RAM stream (zero pages skipped, a few bytes per page of headers), the swap disk's
    // blocks, and the manifest of /work (about 100 bytes per entry of the entry quota).
    return (size.memoryMiB + this.swapMiB() + SLOT_OVERHEAD_MIB) * 1024 * 1024;
  }

  private size(spec: SandboxSpec): { memoryMiB: number; cpus: number; swapMiB: number } {
    return { memoryMiB: spec.memoryMiB, cpus: spec.cpus, swapMiB: this.swapMiB() };
  }

  private swapMiB(): number {
    return this.opts.swapMiB ?? 512;
  }
}

/** A slot's bytes beyond RAM and swap: device state, page headers, the workspace manifest. */
const SLOT_OVERHEAD_MIB = 64;

/** 20 ms steps an abandon waits for a SIGKILLed QEMU to exit (5 s in all). */
const ABANDON_WAIT_STEPS = 250;

class QemuSandbox implements Sandbox {
  readonly exited: Promise<Error | undefined>;
  private home: string[] = [];
  callSentAt: number | undefined;

  constructor(
    readonly spec: SandboxSpec,
    readonly vm: Vm,
    readonly agent: AgentClient,
    private readonly mirror: WorkspaceMirror,
    private marker: string,
    private readonly maxFileBytes: number,
    private readonly pristineKey: string,
    private readonly log: Logger,
    private readonly onClose: () => void,
  ) {
    this.exited = vm.exited.then((e) => new HutchError('guest_crashed', `VM exited (${e.code ?? e.signal})`));
  }

  async exec(req: SandboxExecRequest, hostChanges: HostChanges): Promise<SyncedExecResult> {
    const r = await this.synced((agent) => agent.exec(req).result, hostChanges);
    return { ...r.value, pushedBytes: r.pushedBytes, pulledBytes: r.pulledBytes, ...(r.syncErrors?.length ? { syncErrors: r.syncErrors } : {}), ...(r.syncErrorsOmitted ? { syncErrorsOmitted: r.syncErrorsOmitted } : {}) };
  }

  async synced<T>(fn: (agent: AgentClient) => Promise<T>, hostChanges: HostChanges): Promise<Synced<T>> {
    let pushedBytes = 0;
    if (hostChanges.kind !== 'none') {
      const pushed = await this.guard(() => this.mirror.push(this.agent, hostChanges.kind === 'paths' ? hostChanges.paths : undefined, { mark: true, markOnlyIfSent: true, since: this.marker }));
      pushedBytes = pushed.bytes;
      if (pushed.sent > 0) {
        // What we just pushed must not come back as a guest change (and what the guest
        // changed since the last pull must: the marker builds on this.marker, not a scan).
        const mark = pushed.marker ?? (await this.guard(() => this.agent.call('sync.mark', {})));
        this.marker = mark.marker;
        this.agent.workspaceEntries = mark.entries;
      }
    }
    let value: T;
    this.callSentAt = performance.now();
    try {
      value = await this.guard(() => fn(this.agent));
    } catch (err) {
      // Pull even when the call failed: it may have written files before failing. (A dead
      // guest has nothing to pull; the call's error is the one the caller must see.)
      if (this.vm.running) await this.pullBack().catch(() => undefined);
      throw err;
    }
    let pulled: Awaited<ReturnType<QemuSandbox['pullBack']>>;
    try {
      pulled = await this.pullBack();
    } catch (err) {
      throw new AfterRunError(err, value);
    }
    return { value, pushedBytes, pulledBytes: pulled.bytes, ...(pulled.errors.length ? { syncErrors: pulled.errors } : {}), ...(pulled.errorsOmitted ? { syncErrorsOmitted: pulled.errorsOmitted } : {}) };
  }

  /** Pulls what the guest changed in /work since the marker: the bytes pulled, what could not be, and the guest's state after. */
  private async pullBack(): Promise<{ bytes: number; errors: PullError[]; errorsOmitted: number; state: ResultOf<'agent.state'> }> {
    const pulled = await this.guard(() => this.mirror.pull(this.agent, this.marker, this.maxFileBytes, { state: { maxPaths: 200 }, quota: this.spec.quota }));
    this.marker = pulled.marker;
    if (pulled.stats.errors.length) this.log.warn('sync.pull_errors', { session: this.spec.session, count: pulled.stats.errors.length + pulled.stats.errorsOmitted, first: pulled.stats.errors.slice(0, 5) });
    // The agent answers agent.state in the pull's own round trip (an older agent does not: ask).
    const st = pulled.state ?? (await this.guard(() => this.agent.call('agent.state', { maxPaths: 200 })));
    this.home = st.dirtyPaths.filter((p) => p.startsWith(GUEST_HOME)).map((p) => p.slice(GUEST_HOME.length));
    return { bytes: pulled.stats.bytes, errors: pulled.stats.errors, errorsOmitted: pulled.stats.errorsOmitted, state: st };
  }

  async reclaim(): Promise<ReclaimInfo> {
    // The guest runs its own memory policy: told it is idle, it reclaims (hot set last),
    // stops DAMON and reports its free pages to the host (safe for the shared pristine file
    // only under the shared-RAM guard, see vm/shared-ram-guard.ts).
    const o = await this.guard(() => this.agent.call('mem.policy', { state: 'idle', ...(this.spec.memoryPolicy ? { steps: this.spec.memoryPolicy } : {}) }));
    if (o.warnings.length) this.log.warn('vm.memory_policy', { session: this.spec.session, state: 'idle', warnings: o.warnings });
    const r = o.reclaim;
    return {
      ms: r?.ms ?? 0,
      reclaimedBytes: r?.reclaimedBytes ?? 0,
      detail: { residentBytes: r?.residentBytes, partial: r?.partial, zswapPoolBytes: r?.after.zswapPoolBytes, swapUsedBytes: r?.after.swapUsedBytes, hotSetBytes: r?.hotSetBytes, damon: o.damon, activationPages: o.activation.pages },
    };
  }

  async wakeFromReclaim(): Promise<void> {
    // Active again: the agent prefetches the last call's set once the next call has started.
    await this.activate();
  }

  /** Tells the agent the session is active (and with which memory policy steps). */
  async activate(): Promise<void> {
    const o = await this.guard(() => this.agent.call('mem.policy', { state: 'active', ...(this.spec.memoryPolicy ? { steps: this.spec.memoryPolicy } : {}) }));
    if (o.warnings.length) this.log.warn('vm.memory_policy', { session: this.spec.session, state: 'active', warnings: o.warnings });
  }

  telemetry(): Promise<TelemetrySample> {
    return this.guard(() => this.agent.call('telemetry.sample', {}));
  }

  async state(): Promise<GuestState> {
    // Before the release decision, whatever the guest wrote to /work since the last call's
    // pull (a background job finishing while the agent thinks) goes to the host: a VM found
    // clean is then killed without losing it. A pull the host could not take (its disk is
    // full) leaves the changes in the guest, which then counts as state to keep.
    let st: ResultOf<'agent.state'>;
    try {
      st = (await this.pullBack()).state;
    } catch (err) {
      if (err instanceof HutchError && (err.code === 'guest_crashed' || err.code === 'guest_unresponsive')) throw err;
      this.log.warn('vm.release_pull_failed', { session: this.spec.session, error: (err as Error).message });
      const rest = await this.guard(() => this.agent.call('agent.state', { maxPaths: 50 }));
      return { dirty: true, dirtyPaths: [`work/ (not pulled: ${(err as Error).message})`, ...rest.dirtyPaths], processes: rest.processes };
    }
    // Workspace entries the host could not take (a FIFO, a file over the limit) live only in
    // the guest: killing it would lose them, so they count as state to keep, like a ~/.gitconfig.
    const unpulled = [...this.mirror.unpulled].slice(0, 50).map((p) => `work/${p}`);
    if (this.mirror.unpulledOverflow) unpulled.push('work/ (and more entries the host could not take)');
    return { dirty: st.dirty || unpulled.length > 0, dirtyPaths: [...st.dirtyPaths.slice(0, 50), ...unpulled], processes: st.processes };
  }

  homeChanges(): string[] {
    return this.home;
  }

  async suspend(dir: string): Promise<{ bytes: number; ms: number; slot: SlotRef }> {
    const t0 = performance.now();
    mkdirSync(dir, { recursive: true });
    const state = join(dir, 'state.bin');
    const manifest = join(dir, 'manifest.json');
    // The agent ends its session and waits on a fresh open of its port: the slot then
    // restores the same way whoever connects to it (connection.ts explains the epochs).
    await detachAgent(this.agent);
    const snap = await this.vm.snapshot(state);
    // The RAM stream does not carry the swap disk: what the guest swapped out goes with the slot.
    const swap = await saveSwapDisk(this.vm.spec.dir, dir);
    await writeManifest(manifest, this.mirror.guestView ?? new Map());
    // Durable before the slot becomes current: a crash must never leave a torn "last good" slot.
    for (const f of [state, manifest, ...(swap ? [swap.path] : [])]) fsyncPath(f);
    await this.vm.destroy();
    this.onClose();
    const bytes = snap.stateBytes + statSync(manifest).size + (swap?.bytes ?? 0);
    return { bytes, ms: performance.now() - t0, slot: { dir, state, manifest, pristineKey: this.pristineKey, syncMarker: this.marker, ...(swap ? { swap: swap.path } : {}) } };
  }

  async close(): Promise<void> {
    this.agent.connection.destroy(new HutchError('guest_crashed', `the VM of session ${this.spec.session} was stopped`, { session: this.spec.session }));
    await this.vm.destroy();
    this.onClose();
  }

  /**
   * A VM that died under a call, or stopped answering, becomes a typed error the session
   * can act on. An unresponsive guest is torn down here and now: nothing may wait on it
   * again, and the next call wakes a fresh VM from the host workspace.
   */
  private async guard<T>(fn: () => Promise<T>): Promise<T> {
    try {
      return await fn();
    } catch (err) {
      if (err instanceof HutchError && err.code === 'guest_unresponsive') {
        this.log.error('vm.unresponsive', { session: this.spec.session, error: err.message, ...err.context });
        await this.close().catch(() => undefined);
        throw new HutchError('guest_unresponsive', `${err.message}; the VM of session ${this.spec.session} was torn down, the host workspace keeps what earlier calls left and the next call starts a fresh VM`, { session: this.spec.session, ...err.context });
      }
      if (!this.vm.running || (err instanceof HutchError && (err.code === 'connection_closed' || err.code === 'guest_crashed'))) {
        throw new HutchError('guest_crashed', `the VM of session ${this.spec.session} died during the call; the host workspace keeps its state from before the call`, { session: this.spec.session });
      }
      throw err;
    }
  }
}

/** A wake on a standby VM failed because that VM died or went silent: the wake may start over without it. */
class StandbyLost extends Error {
  constructor(override readonly cause: HutchError) {
    super(cause.message);
  }
}

/** MemAvailable of the host, MiB. */
function availableMiB(): number {
  const m = /^MemAvailable:\s+(\d+) kB/m.exec(readFileSync('/proc/meminfo', 'utf8'));
  return m ? Number(m[1]) / 1024 : 0;
}

/** The guest clock after a restore may be off by the RPC's travel time, not by more. */
const CLOCK_TOLERANCE_MS = 1_000;

/** Checks what the guest reported of its clock after a restore; a wrong clock is logged loudly, not hidden. */
/**
 * Checks what the guest reported of its clock after a restore. The first set lands behind
 * by however long the request took to reach the agent's handler (seconds right after a
 * restore on a loaded TCG host, where the guest's first instructions are translated as they
 * run): then the clock is set once more, now that the guest answers quickly. A clock still
 * wrong after that is logged loudly, not hidden.
 */
async function settleClock(agent: AgentClient, first: ResultOf<'agent.resume'>, session: string, log: Logger): Promise<{ errorMs: number; resets: number }> {
  let r = first;
  let errorMs = Math.round(r.guestNowMs - Date.now());
  let resets = 0;
  if (r.clockSet && Math.abs(errorMs) > CLOCK_TOLERANCE_MS) {
    r = await resumeGuest(agent);
    errorMs = Math.round(r.guestNowMs - Date.now());
    resets = 1;
  }
  if (r.clockError || !r.reseeded || Math.abs(errorMs) > CLOCK_TOLERANCE_MS) {
    log.error('vm.resume_incomplete', { session, clockSet: r.clockSet, reseeded: r.reseeded, clockError: r.clockError, clockDeltaMs: Math.round(r.clockDeltaMs), guestMinusHostMs: errorMs, resets });
  }
  return { errorMs, resets };
}
