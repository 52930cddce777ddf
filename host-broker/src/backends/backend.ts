import type { ExecResult } from '../../../guest-agent/src/protocol/methods.ts';
import type { MemoryPolicySteps } from '../../../guest-agent/src/protocol/methods-memory.ts';
import type { TelemetrySample } from '../../../guest-agent/src/protocol/methods-telemetry.ts';
import type { AgentClient, ExecRequest } from '../agent-client.ts';
import type { HostChanges } from '../sync/host-changes.ts';
import type { PullError } from '../sync/pull-journal.ts';
import { HutchError, toHutchError } from '../../../guest-agent/src/protocol/errors.ts';

/**
 * Where calls the router sends to "the VM" run. A backend makes sandboxes; a sandbox is
 * one session's isolated machine with the guest agent in it. The broker only ever talks
 * to the agent through AgentClient, so every backend runs the same agent code.
 */
export interface SandboxSpec {
  session: string;
  /** The principal that owns the session (admission takes principals in turn). */
  principal?: string;
  /** The host-owned workspace (source of truth). */
  workspaceDir: string;
  /** Per-session private state on the host (home directory, sockets, disks). */
  stateDir: string;
  cpus: number;
  memoryMiB: number;
  /** The session's template (templates/store.ts); absent: the default template. */
  template?: string;
  /** The session's workspace quota: sizes the guest's /work (tmpfs size= and nr_inodes=). */
  quota?: { bytes: number; files: number };
  /** Steps of the guest's own memory policy (a VM's agent applies them; policy/memory-policy.ts). */
  memoryPolicy?: MemoryPolicySteps;
}

export interface WakeInfo {
  /** Milliseconds from the request to a usable agent with the workspace current (0 when live). */
  wakeMs: number;
  woke: boolean;
  /** How it came up: 'local-process', 'pristine-restore', 'slot-restore', 'cold-boot', 'live'. */
  how: string;
  /** Bytes of workspace pushed while waking. */
  pushedBytes?: number;
  restoreMs?: number;
  /** The guest's clock minus the host's after the restore (checked on every restore). */
  clockErrorMs?: number;
  /** Ms from the wake's start to the end of each of its phases (restore, channel, push, resume, mark; exec is added by the lifecycle). */
  phases?: Record<string, number>;
  /** performance.now() at the wake's start: the origin of `phases`. */
  startedAt?: number;
}

/** A snapshot of one session's VM, written at release when it changed state outside /work and /tmp. */
export interface SlotRef {
  dir: string;
  /** Device + RAM state stream. */
  state: string;
  /** What the guest's /work held (JSON manifest), for an incremental push on restore. */
  manifest: string;
  /** The pristine snapshot the slot's RAM was based on; a slot of another pristine cannot restore. */
  pristineKey: string;
  /** The VM's swap disk at the snapshot (slots written before swap disks were saved have none). */
  swap?: string;
  /**
   * The guest's sync marker of the last pull before the snapshot (it lives in the snapshot's
   * RAM): the wake's push builds on it, so what the guest wrote after that pull is still
   * pulled after the next call.
   */
  syncMarker?: string;
}

export interface GuestState {
  /** Something outside /work and /tmp changed (the overlay upper is not empty). */
  dirty: boolean;
  /** Some of the changed paths, root-relative (e.g. home/tenant/.gitconfig). */
  dirtyPaths: string[];
  /** Tenant processes alive right now (background servers, REPLs). */
  processes: number;
}

export interface SandboxExecRequest extends Omit<ExecRequest, 'cwd'> {
  /** Workspace-relative working directory. */
  cwd?: string;
  /** RLIMIT_FSIZE for a backend that runs on the host workspace (the session's remaining quota). */
  fileSizeLimitBytes?: number;
}

/** Something of a call's workspace changes the sync could not bring to the host (typed, never dropped silently). */
export type SyncError = PullError;

export interface SyncedExecResult extends ExecResult {
  pushedBytes: number;
  pulledBytes: number;
  syncErrors?: SyncError[];
  /** Sync errors past the ones listed (MAX_REPORTED_PULL_ERRORS): counted only. */
  syncErrorsOmitted?: number;
}

/** What a call made against the agent returned, with the workspace traffic it caused. */
export interface Synced<T> {
  value: T;
  pushedBytes: number;
  pulledBytes: number;
  /** What the pull-back could not carry to the host. */
  syncErrors?: SyncError[];
  /** Sync errors past the ones listed: counted only. */
  syncErrorsOmitted?: number;
}

/**
 * The call ran in the guest, but bringing its changes back failed (the quota, a full disk,
 * the guest dying during the pull): the error is the pull's, and `value` is what the call
 * returned, so its output is not lost with it. The host workspace is as before the call.
 */
export class AfterRunError<T = unknown> extends HutchError {
  constructor(
    cause: unknown,
    readonly value: T,
  ) {
    const e = toHutchError(cause);
    super(e.code, e.message, e.context, { cause });
  }
}

export interface StartOptions {
  /** Restore this slot (the session's last dirty state) instead of the pristine snapshot. */
  from?: SlotRef | undefined;
  /** Boot the kernel cold instead of restoring a snapshot (the published levels 1 and 2). */
  coldBoot?: boolean;
}

export interface ReclaimInfo {
  ms: number;
  /** Bytes the guest moved out of RAM (into zswap or swap). */
  reclaimedBytes: number;
  detail?: Record<string, unknown>;
}

export interface Sandbox {
  readonly spec: SandboxSpec;
  readonly agent: AgentClient;
  /** performance.now() when the last call was handed to the guest (after host changes were pushed). */
  readonly callSentAt?: number | undefined;
  /** Makes the guest's workspace current (pushing host changes), runs, pulls changes back. */
  exec(req: SandboxExecRequest, hostChanges: HostChanges): Promise<SyncedExecResult>;
  /**
   * The same around any agent call: push host changes, run `fn` against the agent, pull
   * the guest's changes back (file tools when routing is off).
   */
  synced<T>(fn: (agent: AgentClient) => Promise<T>, hostChanges: HostChanges): Promise<Synced<T>>;
  /** What the guest changed outside the workspace, for the release decision. */
  state(): Promise<GuestState>;
  /** Tells the guest it is idle: it reclaims its memory into zswap/swap (its own policy), the VM is kept; absent when the guest cannot. */
  reclaim?(): Promise<ReclaimInfo>;
  /** Samples the guest (memory, swap, zswap, vmstat, PSI, processes); absent where the agent is not alone on its machine. */
  telemetry?(): Promise<TelemetrySample>;
  /**
   * Tells the guest it is active again: it undoes its idle settings and (its prefetch step)
   * reads the last call's activation set back in alongside the next call, not before it.
   */
  wakeFromReclaim?(): Promise<void>;
  /** Writes a snapshot of the VM into `dir` (RAM + devices + workspace manifest), then stops it. */
  suspend?(dir: string): Promise<{ bytes: number; ms: number; slot: SlotRef }>;
  /**
   * What tenant commands changed in HOME, for the router (git reads ~/.gitconfig):
   * true when unknown-but-changed, a list of HOME-relative paths, or false.
   */
  homeChanges(): boolean | string[];
  /** Resolves when the sandbox dies on its own (crash, kill); with the reason. */
  readonly exited: Promise<Error | undefined>;
  /** Stops the sandbox, discarding its state. */
  close(): Promise<void>;
}

/** The broker's memory budget as a backend sees it (admission.ts): standby VMs hold room in it that a wake takes when it needs it. */
export interface StandbyRoom {
  roomToYield(mib: number): boolean;
  reserveYielding(mib: number, yieldRoom: () => void): (() => void) | undefined;
}

export interface VmBackend {
  readonly name: string;
  /** One line on what isolation this backend gives, shown to users. */
  readonly isolation: string;
  /** Accelerator, for VM backends ('kvm' | 'tcg'). */
  readonly accel?: string;
  /** Its calls write the host workspace directly (no guest /work sized from the quota): bounded like the fast path. */
  readonly writesHostWorkspace?: boolean;
  /** Can sandboxes be suspended into snapshot slots? */
  readonly canSuspend: boolean;
  /**
   * Its guests' agents serve the sandbox network (a proxy port for tenant tools, `net.dial`
   * into the guest): the broker then gives each session an egress policy and its ports.
   */
  readonly guestNetwork?: boolean;
  /**
   * The most a VM of this size holds in /work, bytes (a tmpfs: it lives in guest RAM and
   * swap). Absent: the quota alone bounds it.
   */
  workCapacityBytes?(size: { memoryMiB: number }): number;
  /** The most disk one snapshot slot of a VM this size can take (its RAM, its swap disk, the manifest). */
  slotBytesMax?(size: { memoryMiB: number }): number;
  /** Throws not_found unless the template exists (backends without templates leave this out). */
  checkTemplate?(name: string): void;
  /** The current pristine snapshot's key (slots based on another one are stale). */
  pristineKey?(spec: SandboxSpec): Promise<string>;
  /** Standby VMs (restored and warmed ahead of wakes): ready to take, and being prepared. */
  standbyStats?(): { ready: number; filling: number };
  /** Why it cannot serve a wake now (its guest image gone from the cache, say), for /readyz; undefined when it can. */
  notReady?(): string | undefined;
  /** Standby VMs count against the broker's memory budget from now on (the broker calls it once it has one). */
  attachMemoryBudget?(budget: StandbyRoom): void;
  /** Starts a sandbox: from a slot when given (the session's last dirty state), else fresh. */
  start(spec: SandboxSpec, opts?: StartOptions): Promise<{ sandbox: Sandbox; wake: WakeInfo }>;
  /** Stops every sandbox and removes what the backend left on disk. */
  shutdown(): Promise<void>;
  /** Drops whatever a start of this session that will not be waited for had begun (its VM process, its run dir). */
  abandon?(spec: SandboxSpec): Promise<void>;
}
