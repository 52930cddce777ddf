import { performance } from 'node:perf_hooks';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import type { ExecResult, SignalSchema } from '../../../guest-agent/src/protocol/methods.ts';
import type { z } from 'zod';
import type { CallUsage } from '../../../guest-agent/src/protocol/methods-telemetry.ts';
import { Workspace } from '../../../guest-agent/src/workspace/confine.ts';
import { FileTools } from '../../../guest-agent/src/workspace/file-tools.ts';
import { type CallResult, type NetworkCounters, type NetworkSpec, type Route, type SessionInfo, type SessionTelemetry, type ToolName } from '../api/harness-protocol.ts';
import type { Networks } from '../network/networks.ts';
import type { SandboxNetwork } from '../network/sandbox-network.ts';
import type { ProxyEvent } from '../network/proxy-connection.ts';
import { AfterRunError, type SandboxSpec, type SyncError, type VmBackend, type WakeInfo } from '../backends/backend.ts';
import type { Admission } from '../admission.ts';
import type { BrokerMetrics } from '../metrics.ts';
import { SandboxLifecycle } from '../lifecycle/sandbox-lifecycle.ts';
import { recoverPullJournal } from '../sync/pull-journal.ts';
import { gitConfigHazard, routeCall } from '../router/index.ts';
import { SerialQueue } from '../util/serial-queue.ts';
import type { FastPathRunner } from '../tools/fastpath-runner.ts';
import { parseToolArgs, runFileTool } from '../tools/file-calls.ts';
import { agentFileTools } from '../tools/agent-file-tools.ts';
import type { SandboxPolicy } from '../policy/sandbox-policy.ts';
import { memoryStepsFor } from '../policy/memory-policy.ts';
import { DEFAULT_QUOTA, WorkspaceQuota, type QuotaLimits } from './workspace-quota.ts';
import { WorkspaceGate } from './workspace-gate.ts';
import type { SlotDiskBudget } from '../lifecycle/slot-disk-budget.ts';
import type { ByteBudget } from '../util/byte-budget.ts';

export interface SessionMeta {
  id: string;
  cpus: number;
  memoryMiB: number;
  /** The template its VM boots (absent: the default template). */
  template?: string;
  createdAt: string;
  /** The workspace quota asked at create (never above the broker's). */
  quota?: QuotaLimits;
  /** The network asked at create or set since (absent: the broker's default). */
  network?: NetworkSpec;
  /** Ports reachable through the broker without a token ('all': every port). */
  publicPorts?: number[] | 'all';
}

export interface CallSinks {
  onStdout?: (chunk: Uint8Array) => void | Promise<void>;
  onStderr?: (chunk: Uint8Array) => void | Promise<void>;
  signal?: AbortSignal;
  /** Receives, once the command runs, the function that sends it a signal (the harness `signal` op). */
  onSignalable?: (send: (sig: SignalName) => Promise<boolean>) => void;
  /** bash: stdin streamed while the command runs (E2B's SendInput); only the VM (or local agent) takes a stream. */
  stdin?: AsyncIterable<Uint8Array>;
  /** Told the call's route once it has one, whether the call then succeeds or fails (the request's log line). */
  routed?: { route?: string };
}

export type SignalName = z.infer<typeof SignalSchema>;

export interface SessionDeps {
  backend: VmBackend;
  fastPath: FastPathRunner;
  admission: Admission;
  metrics?: BrokerMetrics;
  log: Logger;
  maxFileBytes?: number;
  /** Ceiling on a call's timeout (default MAX_CALL_TIMEOUT_MS). */
  maxCallTimeoutMs?: number;
  /** How long a command the router sent to the fast path may run (default FASTPATH_MAX_RUN_MS). */
  fastPathMaxMs?: number;
  /** Routing, wake and release policy (levels). */
  policy: SandboxPolicy;
  /** The broker's workspace quota per session (default DEFAULT_QUOTA); a create may ask less. */
  quota?: QuotaLimits;
  /** File bytes the in-process read and edit may hold at once, broker-wide and per principal. */
  fileBytes?: ByteBudget;
  /** The data dir's disk the snapshot slots may take. */
  slotDisk?: SlotDiskBudget;
  /** Sandboxes' networks (absent: none has any). */
  networks?: Networks;
}

/** How long an in-process read or edit waits for room in `fileBytes` before it fails busy. */
const FILE_BYTES_WAIT_MS = 30_000;

/** Default per-stream output kept in a bash result; everything is still streamed. */
export const DEFAULT_MAX_OUTPUT_BYTES = 1024 * 1024;
/**
 * The most of each of stdout and stderr a bash result may keep (a larger maxOutputBytes is
 * `bad_request`): a result is held whole in the broker and goes to the client as one frame.
 * With no ceiling, 1.2 GB of output asked whole took the broker to 1.8 GiB and held its loop
 * for seconds; streamed output (`stream: true`) has no such limit.
 */
export const MAX_OUTPUT_BYTES = 16 * 1024 * 1024;
/** The recorded sessions' default bash timeout. */
export const DEFAULT_BASH_TIMEOUT_MS = 600_000;
/**
 * How long a command runs on the fast path before it fails `timeout`, whatever the call's own
 * timeout: the fast path is for the quick read-only commands the router proves (`cat`, `grep
 * -rn`, `git diff`), and runs them on the broker's host, outside any VM. A walk a tenant can
 * make endless or quadratic (a FIFO to `cat`, `find .` down a 100,000-level chain) held it
 * for the call's whole timeout (10 minutes by default) and its caller for longer than a
 * client waits (typically 60 s). A command that needs longer is sent with `route: 'vm'`.
 */
export const FASTPATH_MAX_RUN_MS = 30_000;
/** The longest timeout a call may ask for (a call holds its session's queue and a VM slot meanwhile). */
export const MAX_CALL_TIMEOUT_MS = 3_600_000;
/** FileTools' default file limit, also the fast path's RLIMIT_FSIZE ceiling. */
const DEFAULT_MAX_FILE_BYTES = 64 * 1024 * 1024;

/**
 * One sandbox as the harness sees it: a host-owned workspace, calls executed in order,
 * each sent to the cheapest safe place. The VM (or local agent) is started on the first
 * call that needs it.
 */
export class Session {
  readonly files: FileTools;
  readonly quota: WorkspaceQuota;
  private readonly queue = new SerialQueue();
  readonly vm: SandboxLifecycle;
  private calls = 0;
  private closed = false;
  private readonly closing = new AbortController();
  private readonly log: Logger;
  private readonly gate = new WorkspaceGate();
  /** Whether anyone may reach `port` without a token. */
  isPublicPort(port: number): boolean {
    const p = this.meta.publicPorts;
    return p === 'all' || (p?.includes(port) ?? false);
  }

  /** Its egress policy and traffic; undefined on a broker that serves no network. */
  readonly network: SandboxNetwork | undefined;
  /** Refusals since the last telemetry sample (at most MAX_REFUSALS_KEPT). */
  private refusals: Array<ProxyEvent & { atMs: number }> = [];

  constructor(
    readonly meta: SessionMeta,
    readonly workspaceDir: string,
    readonly stateDir: string,
    private readonly deps: SessionDeps,
    /** The principal that owns it: the broker's queues take principals in turn. */
    private readonly owner?: string,
  ) {
    const broker = deps.quota ?? DEFAULT_QUOTA;
    const vm = deps.backend.workCapacityBytes ? { bytes: deps.backend.workCapacityBytes(meta), memoryMiB: meta.memoryMiB } : undefined;
    this.quota = new WorkspaceQuota(workspaceDir, { bytes: Math.min(broker.bytes, meta.quota?.bytes ?? Infinity), files: Math.min(broker.files, meta.quota?.files ?? Infinity) }, vm);
    const budget = deps.fileBytes;
    this.files = new FileTools(new Workspace(workspaceDir), {
      ...(deps.maxFileBytes ? { maxFileBytes: deps.maxFileBytes } : {}),
      beforeGrow: (g) => this.quota.plan(g),
      ...(budget ? { holdBytes: (n: number) => budget.reserve(n, owner ?? '', FILE_BYTES_WAIT_MS) } : {}),
    });
    this.log = deps.log.child({ session: meta.id });
    // A pull the broker was killed in the middle of is finished (committed) or dropped (not) before anything reads the workspace.
    const recovered = recoverPullJournal(workspaceDir, stateDir);
    if (recovered.replayed || recovered.discarded) this.log.warn('sync.pull_recovered', { ...recovered, errors: recovered.errors.slice(0, 5) });
    this.network = this.makeNetwork();
    this.network?.on('refused', (e: ProxyEvent) => {
      if (this.refusals.length < MAX_REFUSALS_KEPT) this.refusals.push({ ...e, atMs: Date.now() });
    });
    this.vm = new SandboxLifecycle(this.spec(), deps.backend, deps.admission, deps.metrics, this.log, { policy: deps.policy, ...(deps.slotDisk ? { slotDisk: deps.slotDisk } : {}), writing: (fn) => this.writing(fn), ...(this.network ? { network: this.network } : {}) });
  }

  get id(): string {
    return this.meta.id;
  }

  /** The network its metadata asks for; one the broker no longer allows (an operator lowered --egress-max) falls back to none, said in the log. */
  private makeNetwork(): SandboxNetwork | undefined {
    const n = this.deps.networks;
    if (!n) return undefined;
    try {
      return n.forSession(this.meta.id, this.owner ?? 'default', this.meta.network);
    } catch (err) {
      this.log.warn('session.network_refused', { error: (err as Error).message, fallback: 'none' });
      return n.forSession(this.meta.id, this.owner ?? 'default', 'none');
    }
  }

  info(): SessionInfo {
    return {
      session: this.meta.id,
      cpus: this.meta.cpus,
      memoryMiB: this.meta.memoryMiB,
      template: this.meta.template ?? 'default',
      backend: this.deps.backend.name,
      live: this.vm.live,
      createdAt: this.meta.createdAt,
      calls: this.calls,
      ...(this.network ? { network: this.network.describe() } : {}),
      ...(this.meta.publicPorts === 'all' || this.meta.publicPorts?.length ? { publicPorts: this.meta.publicPorts } : {}),
    };
  }

  /** Runs one tool call after every earlier call of this session has finished. */
  call(tool: ToolName, rawArgs: unknown, sinks: CallSinks = {}): Promise<CallResult> {
    if (this.closed) return Promise.reject(new HutchError('not_found', `session ${this.id} is closed`, { session: this.id }));
    const received = performance.now();
    return this.queue.run(async () => {
      if (this.closed) throw new HutchError('not_found', `session ${this.id} is closed`, { session: this.id });
      this.calls++;
      // A close() cancels the call in flight: nothing a tenant runs holds a closing session.
      const signal = sinks.signal ? AbortSignal.any([sinks.signal, this.closing.signal]) : this.closing.signal;
      const routed: { route?: Route } = {};
      const netBefore = this.network?.snapshot();
      let r: Dispatched;
      try {
        // Cancelled while it queued (its client went away): it does not run.
        signal.throwIfAborted();
        r = await this.dispatch(tool, rawArgs, { ...sinks, signal }, routed);
      } catch (err) {
        if (sinks.routed && routed.route) sinks.routed.route = routed.route;
        const code = err instanceof HutchError ? err.code : 'internal';
        const totalMs = performance.now() - received;
        this.deps.metrics?.errors.inc({ code });
        this.deps.metrics?.recordCall({ tool, route: routed.route ?? 'none', ok: false, woke: false, totalMs, addedMs: totalMs, wakeMs: 0, queuedMs: 0, pushedBytes: 0, pulledBytes: 0 });
        throw err;
      }
      const totalMs = performance.now() - received;
      const result: CallResult = {
        tool,
        route: r.route,
        reason: r.reason,
        woke: r.wake?.woke ?? false,
        timing: {
          totalMs: round(totalMs),
          runMs: round(r.runMs),
          addedMs: round(totalMs - r.runMs),
          wakeMs: round(r.wake?.wakeMs ?? 0),
          queuedMs: round(r.queuedMs ?? 0),
          ...(r.wake?.phases ? { wakePhases: r.wake.phases } : {}),
        },
        result: r.result,
        ...(r.syncErrors?.length ? { syncErrors: r.syncErrors } : {}),
        ...(r.syncErrorsOmitted ? { syncErrorsOmitted: r.syncErrorsOmitted } : {}),
        ...networkDelta(netBefore, this.network?.snapshot()),
      };
      this.deps.metrics?.recordCall({
        tool,
        route: r.route,
        ok: true,
        woke: result.woke,
        ...(r.wake?.how ? { wakeHow: r.wake.how } : {}),
        ...(r.wake?.phases ? { wakePhases: r.wake.phases } : {}),
        totalMs,
        addedMs: totalMs - r.runMs,
        wakeMs: r.wake?.wakeMs ?? 0,
        queuedMs: r.queuedMs ?? 0,
        pushedBytes: r.pushedBytes ?? 0,
        pulledBytes: r.pulledBytes ?? 0,
        ...(r.usage ? { usage: r.usage } : {}),
      });
      if (sinks.routed) sinks.routed.route = r.route;
      this.log.debug('call.done', { tool, route: r.route, totalMs: result.timing.totalMs, addedMs: result.timing.addedMs, woke: result.woke, wakeMs: result.timing.wakeMs, how: r.wake?.how, pushedBytes: r.pushedBytes, pulledBytes: r.pulledBytes, ...(r.usage ? { majorFaults: r.usage.majorFaults, swapReadBytes: r.usage.swapReadBytes } : {}) });
      return result;
    });
  }

  async telemetry(): Promise<SessionTelemetry> {
    const events = this.refusals.splice(0).map((e) => ({ kind: 'network.refused' as const, atMs: e.atMs, host: e.host, port: e.port, reason: e.reason ?? '', ...(e.rule ? { rule: e.rule } : {}) }));
    return {
      session: this.id,
      ...(await this.vm.telemetry()),
      ...(this.network ? { network: { ...this.network.snapshot(), open: this.network.openConnections } } : {}),
      ...(events.length ? { events } : {}),
    };
  }

  /** A harness hint: a tool call is coming (start waking), or the agent went quiet (release now). */
  hint(h: 'tool_call_pending' | 'compacting' | 'idle'): void {
    if (h === 'tool_call_pending') this.vm.prewarm();
    else void this.vm.release(`hint ${h}`).catch((err: unknown) => this.log.warn('vm.release_failed', { error: (err as Error).message }));
  }

  /**
   * Ends the session in bounded time: the call in flight is cancelled, and whatever still
   * holds on after a grace has its VM stopped under it. Its VM is discarded (the workspace
   * is handled by the manager).
   */
  async close(): Promise<void> {
    this.closed = true;
    this.closing.abort(new HutchError('cancelled', `session ${this.id} is closing`, { session: this.id }));
    await this.vm.close();
    await this.queue.idle();
  }

  /** Broker shutdown: release the VM properly (a dirty one into its snapshot slot), keep the session; bounded like close(). */
  async shutdown(): Promise<void> {
    this.closed = true;
    this.closing.abort(new HutchError('cancelled', 'the broker is shutting down'));
    await this.vm.shutdownRelease();
    await this.queue.idle();
  }

  private async dispatch(tool: ToolName, rawArgs: unknown, sinks: CallSinks, routed: { route?: Route }): Promise<Dispatched> {
    if (tool === 'bash') return this.bash(parseToolArgs('bash', rawArgs), sinks, routed);
    routed.route = this.deps.policy.routing ? 'inprocess' : 'vm';
    if (!this.deps.policy.routing) {
      // No routing (published levels 1-3): the file tool runs in the VM, its writes pulled back.
      const t0 = performance.now();
      await this.quota.beforeVm();
      const before = await this.quota.current();
      const out = await this.vm.vmCall((sb, changes) => sb.synced((agent) => runFileTool(agentFileTools(agent), tool, rawArgs), changes));
      await this.quota.afterRun(before, 'vm', true);
      return {
        route: 'vm',
        reason: 'routing off: every call runs in the VM',
        runMs: performance.now() - t0 - out.wake.wakeMs - out.queuedMs,
        wake: out.wake,
        queuedMs: out.queuedMs,
        pushedBytes: out.value.pushedBytes + (out.wake.pushedBytes ?? 0),
        pulledBytes: out.value.pulledBytes,
        syncErrors: out.value.syncErrors,
        syncErrorsOmitted: out.value.syncErrorsOmitted,
        result: out.value.value.result,
      };
    }
    // Writes are planned against the quota (FileTools beforeGrow), which needs the usage now.
    if (tool === 'write' || tool === 'edit') await this.quota.current();
    const r = await runFileTool(this.files, tool, rawArgs).catch((err: unknown) => {
      if (!(err instanceof HutchError && err.code === 'quota_exceeded')) this.quota.stale(); // a planned write may not have landed
      throw err;
    });
    if (r.wrote !== undefined) this.vm.hostChanges.mark(r.wrote);
    return { route: 'inprocess', reason: 'file tools run in the broker on the host workspace', runMs: 0, result: r.result };
  }
  /**
   * A workspace write from outside the call queue (an upload's commit, an E2B file call, a
   * release pull): it waits while a fast-path git runs (workspace-gate.ts says why).
   */
  writing<T>(fn: () => Promise<T>): Promise<T> {
    return this.gate.run('write', fn);
  }

  private async bash(a: ReturnType<typeof parseToolArgs<'bash'>>, sinks: CallSinks, routed: { route?: Route }): Promise<Dispatched> {
    // Held from the git check until a fast-path git run ends: nothing rewrites what was checked.
    let gitHold: (() => void) | undefined;
    try {
      // A caller can force only the safer route: `fastpath` still goes through the router (router/index.ts routeCall).
      const decision = sinks.stdin
        ? { route: 'vm' as const, reason: 'stdin is streamed: only the VM takes a stream' }
        : this.deps.policy.routing
        ? await routeCall({
            command: a.command,
            env: a.env,
            forced: a.route,
            homeChanged: this.vm.homeChanges(),
            gitHazard: async (reach) => {
              gitHold = await this.gate.enter('git');
              return gitConfigHazard(this.workspaceDir, reach);
            },
          })
        : { route: 'vm' as const, reason: 'routing off: every call runs in the VM' };
      if (decision.route !== 'fastpath') gitHold?.();
      return await this.runBash(a, sinks, routed, decision);
    } finally {
      gitHold?.();
    }
  }

  private async runBash(a: ReturnType<typeof parseToolArgs<'bash'>>, sinks: CallSinks, routed: { route?: Route }, decision: { route: Route; reason: string; writes?: string[] }): Promise<Dispatched> {
    routed.route = decision.route;
    const timeoutMs = a.timeout ?? (a.timeout_s !== undefined ? Math.round(a.timeout_s * 1000) : DEFAULT_BASH_TIMEOUT_MS);
    const ceiling = this.deps.maxCallTimeoutMs ?? MAX_CALL_TIMEOUT_MS;
    if (timeoutMs > ceiling) {
      throw new HutchError('bad_request', `a call's timeout may be at most ${ceiling} ms (asked ${timeoutMs} ms)`, { timeoutMs, limit: ceiling });
    }
    const maxOutputBytes = a.maxOutputBytes ?? DEFAULT_MAX_OUTPUT_BYTES;
    if (maxOutputBytes > MAX_OUTPUT_BYTES) {
      throw new HutchError('bad_request', `a call's result may keep at most ${MAX_OUTPUT_BYTES} bytes of each output stream (asked maxOutputBytes ${maxOutputBytes}); stream the output to see more of it`, { maxOutputBytes, limit: MAX_OUTPUT_BYTES });
    }
    const out = new OutputCollector(maxOutputBytes, sinks.onStdout);
    const err = new OutputCollector(maxOutputBytes, sinks.onStderr);
    const stdin = typeof a.stdin === 'string' ? Buffer.from(a.stdin) : a.stdin;
    const result = (x: ExecResult) => ({
      exitCode: x.exitCode,
      signal: x.signal,
      timedOut: x.timedOut,
      stdout: out.text(),
      stderr: err.text(),
      stdoutBytes: x.stdout.bytes,
      stderrBytes: x.stderr.bytes,
      truncated: out.truncated || err.truncated,
    });
    const common = {
      command: a.command,
      env: a.env ?? {},
      timeoutMs,
      maxOutputBytes: Number.MAX_SAFE_INTEGER, // collectors cap what is kept; everything streams
      onStdout: (c: Uint8Array) => out.push(c),
      onStderr: (c: Uint8Array) => err.push(c),
      ...(stdin ? { stdin } : {}),
      ...(sinks.signal ? { signal: sinks.signal } : {}),
      ...(sinks.onSignalable ? { onSignalable: sinks.onSignalable } : {}),
    };
    let r: ExecResult;
    let wake: WakeInfo | undefined;
    let queuedMs = 0;
    let pushedBytes = 0;
    let pulledBytes = 0;
    let syncErrors: SyncError[] | undefined;
    let syncErrorsOmitted: number | undefined;
    // A command on the host workspace (the fast path, unsafe-local) is bounded while it
    // writes: no file past the quota's remaining bytes (RLIMIT_FSIZE), the usage watched
    // during a long run (many files), measured after. A VM's /work is sized from the quota.
    const onHost = decision.route === 'fastpath' || this.deps.backend.writesHostWorkspace === true;
    // A fast-path call the router proved read-only is not measured after (a walk of a big tree
    // after every `cat` would be most of its cost); RLIMIT_FSIZE and the watch still bound it.
    const mayWrite = decision.route !== 'fastpath' || decision.writes === undefined || decision.writes.length > 0;
    if (decision.route === 'vm') await this.quota.beforeVm();
    const before = await this.quota.current();
    const over = new AbortController();
    const unwatch = onHost ? this.quota.watch((e) => over.abort(e)) : () => undefined;
    const bounded = { ...common, signal: AbortSignal.any([over.signal, ...(common.signal ? [common.signal] : [])]), ...(onHost ? { fileSizeLimitBytes: this.quota.fileSizeLimit(this.deps.maxFileBytes ?? DEFAULT_MAX_FILE_BYTES) } : {}) };
    try {
      if (decision.route === 'fastpath') {
        const ceiling = this.deps.fastPathMaxMs ?? FASTPATH_MAX_RUN_MS;
        const capped = timeoutMs > ceiling;
        // A run slot and its memory from the broker's one budget, fairly between principals, or `busy`.
        const admitted = await this.deps.admission.admitFastPath(this.id, this.owner);
        queuedMs = admitted.queuedMs;
        try {
          r = await this.deps.fastPath.run({ ...bounded, workspace: this.workspaceDir, ...(capped ? { timeoutMs: ceiling } : {}) });
        } finally {
          admitted.release();
          // A writing command may have written anywhere in the workspace: the next VM call
          // scans it. One the router proved read-only (cat, grep, ls) changed nothing, and its
          // next VM call pushes without a scan of the tree.
          if (mayWrite) this.vm.hostChanges.markAll();
        }
        if (capped && r.timedOut) {
          throw new HutchError(
            'timeout',
            `the command ran past the fast path's ${ceiling} ms and was stopped (the fast path runs quick read-only commands on the host); to run it for up to its own timeout, call it with route: 'vm'`,
            { route: 'fastpath', limitMs: ceiling, timeoutMs, result: result(r) },
          );
        }
      } else {
        // The guest's package managers use the host's registries (a mirror the host is set up with); the call's own env wins.
        const vmReq = this.deps.networks ? { ...bounded, env: { ...this.deps.networks.guestEnv, ...bounded.env } } : bounded;
        const out = await this.vm.vmCall((sb, changes) => sb.exec(sinks.stdin ? { ...vmReq, stdin: sinks.stdin } : vmReq, changes));
        r = out.value;
        wake = out.wake;
        queuedMs = out.queuedMs;
        pushedBytes = out.value.pushedBytes + (out.wake.pushedBytes ?? 0);
        pulledBytes = out.value.pulledBytes;
        syncErrors = out.value.syncErrors;
        syncErrorsOmitted = out.value.syncErrorsOmitted;
      }
    } catch (e) {
      if (over.signal.aborted) throw over.signal.reason;
      // The command ran but its changes could not come back: the error says why, and the
      // command's result goes with it (a caller that does not stream would lose it otherwise).
      throw e instanceof AfterRunError ? withResult(e, result(e.value as ExecResult)) : e;
    } finally {
      unwatch();
      if (mayWrite) this.quota.stale();
    }
    if (over.signal.aborted) throw over.signal.reason;
    if (mayWrite) await this.quota.afterRun(before, decision.route, decision.route === 'vm' && !onHost).catch((e: unknown) => Promise.reject(withResult(e, result(r))));
    return {
      route: decision.route,
      reason: decision.reason,
      runMs: r.durationMs,
      wake,
      queuedMs,
      pushedBytes,
      pulledBytes,
      usage: r.usage,
      syncErrors,
      syncErrorsOmitted,
      result: result(r),
    };
  }

  private spec(): SandboxSpec {
    return { session: this.id, ...(this.owner !== undefined ? { principal: this.owner } : {}), workspaceDir: this.workspaceDir, stateDir: this.stateDir, cpus: this.meta.cpus, memoryMiB: this.meta.memoryMiB, ...(this.meta.template ? { template: this.meta.template } : {}), quota: this.quota.limits, memoryPolicy: memoryStepsFor(this.deps.policy) };
  }
}

interface Dispatched {
  route: Route;
  reason: string;
  runMs: number;
  result: unknown;
  wake?: WakeInfo | undefined;
  queuedMs?: number;
  pushedBytes?: number;
  pulledBytes?: number;
  usage?: CallUsage | undefined;
  syncErrors?: SyncError[] | undefined;
  syncErrorsOmitted?: number | undefined;
}

/** An error raised after a command ran (its changes refused by the quota, say), with the command's result in `context.result`. */
function withResult(e: unknown, result: Record<string, unknown>): unknown {
  if (!(e instanceof HutchError)) return e;
  return new HutchError(e.code, `${e.message} (the command itself ran: its exit code and output are in the error's context.result)`, { ...e.context, result }, { cause: e });
}

/** Keeps the first `cap` bytes of a stream for the result while forwarding every chunk. */
class OutputCollector {
  private parts: Uint8Array[] = [];
  private kept = 0;
  truncated = false;

  constructor(
    private readonly cap: number,
    private readonly forward: ((c: Uint8Array) => void | Promise<void>) | undefined,
  ) {}

  push(c: Uint8Array): void | Promise<void> {
    if (this.kept < this.cap) {
      const piece = this.kept + c.length > this.cap ? c.subarray(0, this.cap - this.kept) : c;
      this.parts.push(piece);
      this.kept += piece.length;
      if (piece.length < c.length) this.truncated = true;
    } else this.truncated = true;
    return this.forward?.(c);
  }

  text(): string {
    return Buffer.concat(this.parts).toString('utf8');
  }
}

/** Refusals a session keeps for its next telemetry sample: a tenant retrying in a loop must not grow it. */
const MAX_REFUSALS_KEPT = 20;

/** A call's share of the session's traffic (absent when there was none). */
function networkDelta(before: NetworkCounters | undefined, after: NetworkCounters | undefined): { network?: NetworkCounters } {
  if (!before || !after) return {};
  const d = { bytesIn: after.bytesIn - before.bytesIn, bytesOut: after.bytesOut - before.bytesOut, connections: after.connections - before.connections, refused: after.refused - before.refused };
  return d.bytesIn || d.bytesOut || d.connections || d.refused ? { network: d } : {};
}

function round(n: number): number {
  return Math.round(n * 1000) / 1000;
}
