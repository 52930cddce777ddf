import { performance } from 'node:perf_hooks';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import type { ExecResult } from '../../../guest-agent/src/protocol/methods.ts';
import type { CallUsage } from '../../../guest-agent/src/protocol/methods-telemetry.ts';
import { Workspace } from '../../../guest-agent/src/workspace/confine.ts';
import { FileTools } from '../../../guest-agent/src/workspace/file-tools.ts';
import { type CallResult, type Route, type SessionInfo, type SessionTelemetry, type ToolName } from '../api/harness-protocol.ts';
import type { SandboxSpec, VmBackend, WakeInfo } from '../backends/backend.ts';
import type { Admission } from '../admission.ts';
import type { BrokerMetrics } from '../metrics.ts';
import { SandboxLifecycle } from '../lifecycle/sandbox-lifecycle.ts';
import { recoverPullJournal } from '../sync/pull-journal.ts';
import { routeCommand } from '../router/index.ts';
import { SerialQueue } from '../util/serial-queue.ts';
import type { FastPathRunner } from '../tools/fastpath-runner.ts';
import { parseToolArgs, runFileTool } from '../tools/file-calls.ts';
import { agentFileTools } from '../tools/agent-file-tools.ts';
import type { SandboxPolicy } from '../policy/sandbox-policy.ts';

export interface SessionMeta {
  id: string;
  cpus: number;
  memoryMiB: number;
  createdAt: string;
}

export interface CallSinks {
  onStdout?: (chunk: Uint8Array) => void | Promise<void>;
  onStderr?: (chunk: Uint8Array) => void | Promise<void>;
  signal?: AbortSignal;
}

export interface SessionDeps {
  backend: VmBackend;
  fastPath: FastPathRunner;
  admission: Admission;
  metrics?: BrokerMetrics;
  log: Logger;
  maxFileBytes?: number;
  /** Routing, wake and release policy (levels). */
  policy: SandboxPolicy;
}

/** Default per-stream output kept in a bash result; everything is still streamed. */
export const DEFAULT_MAX_OUTPUT_BYTES = 1024 * 1024;
/** The recorded sessions' default bash timeout. */
export const DEFAULT_BASH_TIMEOUT_MS = 600_000;

/**
 * One sandbox as the harness sees it: a host-owned workspace, calls executed in order,
 * each sent to the cheapest safe place. The VM (or local agent) is started on the first
 * call that needs it.
 */
export class Session {
  readonly files: FileTools;
  private readonly queue = new SerialQueue();
  readonly vm: SandboxLifecycle;
  private calls = 0;
  private closed = false;
  private readonly log: Logger;

  constructor(
    readonly meta: SessionMeta,
    readonly workspaceDir: string,
    readonly stateDir: string,
    private readonly deps: SessionDeps,
  ) {
    this.files = new FileTools(new Workspace(workspaceDir), deps.maxFileBytes ? { maxFileBytes: deps.maxFileBytes } : {});
    this.log = deps.log.child({ session: meta.id });
    // A pull the broker was killed in the middle of is finished (committed) or dropped (not) before anything reads the workspace.
    const recovered = recoverPullJournal(workspaceDir, stateDir);
    if (recovered.replayed || recovered.discarded) this.log.warn('sync.pull_recovered', { ...recovered, errors: recovered.errors.slice(0, 5) });
    this.vm = new SandboxLifecycle(this.spec(), deps.backend, deps.admission, deps.metrics, this.log, { policy: deps.policy });
  }

  get id(): string {
    return this.meta.id;
  }

  info(): SessionInfo {
    return {
      session: this.meta.id,
      cpus: this.meta.cpus,
      memoryMiB: this.meta.memoryMiB,
      backend: this.deps.backend.name,
      live: this.vm.live,
      createdAt: this.meta.createdAt,
      calls: this.calls,
    };
  }

  /** Runs one tool call after every earlier call of this session has finished. */
  call(tool: ToolName, rawArgs: unknown, sinks: CallSinks = {}): Promise<CallResult> {
    if (this.closed) return Promise.reject(new HutchError('not_found', `session ${this.id} is closed`, { session: this.id }));
    const received = performance.now();
    return this.queue.run(async () => {
      if (this.closed) throw new HutchError('not_found', `session ${this.id} is closed`, { session: this.id });
      this.calls++;
      let r: Dispatched;
      try {
        r = await this.dispatch(tool, rawArgs, sinks);
      } catch (err) {
        const code = err instanceof HutchError ? err.code : 'internal';
        this.deps.metrics?.errors.inc({ code });
        this.deps.metrics?.recordCall({ tool, route: 'inprocess', ok: false, woke: false, totalMs: 0, addedMs: 0, wakeMs: 0, queuedMs: 0, pushedBytes: 0, pulledBytes: 0 });
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
        },
        result: r.result,
      };
      this.deps.metrics?.recordCall({
        tool,
        route: r.route,
        ok: true,
        woke: result.woke,
        ...(r.wake?.how ? { wakeHow: r.wake.how } : {}),
        totalMs,
        addedMs: totalMs - r.runMs,
        wakeMs: r.wake?.wakeMs ?? 0,
        queuedMs: r.queuedMs ?? 0,
        pushedBytes: r.pushedBytes ?? 0,
        pulledBytes: r.pulledBytes ?? 0,
        ...(r.usage ? { usage: r.usage } : {}),
      });
      this.log.info('call.done', { tool, route: r.route, totalMs: result.timing.totalMs, addedMs: result.timing.addedMs, woke: result.woke, wakeMs: result.timing.wakeMs, how: r.wake?.how, pushedBytes: r.pushedBytes, pulledBytes: r.pulledBytes, ...(r.usage ? { majorFaults: r.usage.majorFaults, swapReadBytes: r.usage.swapReadBytes } : {}) });
      return result;
    });
  }

  async telemetry(): Promise<SessionTelemetry> {
    return { session: this.id, ...(await this.vm.telemetry()) };
  }

  /** A harness hint: a tool call is coming (start waking), or the agent went quiet (release now). */
  hint(h: 'tool_call_pending' | 'compacting' | 'idle'): void {
    if (h === 'tool_call_pending') this.vm.prewarm();
    else void this.vm.release(`hint ${h}`).catch((err: unknown) => this.log.warn('vm.release_failed', { error: (err as Error).message }));
  }

  /** Ends the session: its VM is discarded (the workspace is handled by the manager). */
  async close(): Promise<void> {
    this.closed = true;
    await this.queue.idle();
    await this.vm.close();
  }

  /** Broker shutdown: release the VM properly (a dirty one into its snapshot slot), keep the session. */
  async shutdown(): Promise<void> {
    this.closed = true;
    await this.queue.idle();
    await this.vm.release('broker shutdown').catch((err: unknown) => this.log.warn('vm.release_failed', { error: (err as Error).message }));
    await this.vm.close();
  }

  private async dispatch(tool: ToolName, rawArgs: unknown, sinks: CallSinks): Promise<Dispatched> {
    if (tool === 'bash') return this.bash(parseToolArgs('bash', rawArgs), sinks);
    if (!this.deps.policy.routing) {
      // No routing (published levels 1-3): the file tool runs in the VM, its writes pulled back.
      const t0 = performance.now();
      const out = await this.vm.vmCall((sb, changes) => sb.synced((agent) => runFileTool(agentFileTools(agent), tool, rawArgs), changes));
      return {
        route: 'vm',
        reason: 'routing off: every call runs in the VM',
        runMs: performance.now() - t0 - out.wake.wakeMs - out.queuedMs,
        wake: out.wake,
        queuedMs: out.queuedMs,
        pushedBytes: out.value.pushedBytes + (out.wake.pushedBytes ?? 0),
        pulledBytes: out.value.pulledBytes,
        result: out.value.value.result,
      };
    }
    const r = await runFileTool(this.files, tool, rawArgs);
    if (r.wrote !== undefined) this.vm.hostChanges.mark(r.wrote);
    return { route: 'inprocess', reason: 'file tools run in the broker on the host workspace', runMs: 0, result: r.result };
  }
  private async bash(a: ReturnType<typeof parseToolArgs<'bash'>>, sinks: CallSinks): Promise<Dispatched> {
    const decision = a.route
      ? { route: a.route, reason: `route forced to ${a.route} by the caller` }
      : this.deps.policy.routing
        ? routeCommand(a.command, { homeChanged: this.vm.homeChanges() })
        : { route: 'vm' as const, reason: 'routing off: every call runs in the VM' };
    const timeoutMs = a.timeout ?? (a.timeout_s !== undefined ? Math.round(a.timeout_s * 1000) : DEFAULT_BASH_TIMEOUT_MS);
    const maxOutputBytes = a.maxOutputBytes ?? DEFAULT_MAX_OUTPUT_BYTES;
    const out = new OutputCollector(maxOutputBytes, sinks.onStdout);
    const err = new OutputCollector(maxOutputBytes, sinks.onStderr);
    const stdin = typeof a.stdin === 'string' ? Buffer.from(a.stdin) : a.stdin;
    const common = {
      command: a.command,
      env: a.env ?? {},
      timeoutMs,
      maxOutputBytes: Number.MAX_SAFE_INTEGER, // collectors cap what is kept; everything streams
      onStdout: (c: Uint8Array) => out.push(c),
      onStderr: (c: Uint8Array) => err.push(c),
      ...(stdin ? { stdin } : {}),
      ...(sinks.signal ? { signal: sinks.signal } : {}),
    };
    let r: ExecResult;
    let wake: WakeInfo | undefined;
    let queuedMs = 0;
    let pushedBytes = 0;
    let pulledBytes = 0;
    if (decision.route === 'fastpath') {
      try {
        r = await this.deps.fastPath.run({ ...common, workspace: this.workspaceDir });
      } finally {
        // The sandbox may have written anywhere in the workspace; the next VM call re-checks it.
        this.vm.hostChanges.markAll();
      }
    } else {
      const out = await this.vm.vmCall((sb, changes) => sb.exec(common, changes));
      r = out.value;
      wake = out.wake;
      queuedMs = out.queuedMs;
      pushedBytes = out.value.pushedBytes + (out.wake.pushedBytes ?? 0);
      pulledBytes = out.value.pulledBytes;
    }
    return {
      route: decision.route,
      reason: decision.reason,
      runMs: r.durationMs,
      wake,
      queuedMs,
      pushedBytes,
      pulledBytes,
      usage: r.usage,
      result: {
        exitCode: r.exitCode,
        signal: r.signal,
        timedOut: r.timedOut,
        stdout: out.text(),
        stderr: err.text(),
        stdoutBytes: r.stdout.bytes,
        stderrBytes: r.stderr.bytes,
        truncated: out.truncated || err.truncated,
      },
    };
  }

  private spec(): SandboxSpec {
    return { session: this.id, workspaceDir: this.workspaceDir, stateDir: this.stateDir, cpus: this.meta.cpus, memoryMiB: this.meta.memoryMiB };
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

function round(n: number): number {
  return Math.round(n * 1000) / 1000;
}
