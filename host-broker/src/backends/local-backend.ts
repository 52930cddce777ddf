import { readdirSync } from 'node:fs';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import type { AgentClient } from '../agent-client.ts';
import type { FastPath } from '../fastpath/index.ts';
import { privateDir } from '../sessions/session-manager.ts';
import type { GuestState, Sandbox, SandboxExecRequest, SandboxSpec, Synced, SyncedExecResult, VmBackend, WakeInfo } from './backend.ts';

/**
 * The `unsafe-local` backend: VM-routed calls run on the host kernel, each in the fast
 * path's sandbox (see fastpath/bwrap-argv.ts): a user namespace with an unprivileged uid
 * and no capabilities, the seccomp allowlist, fresh pid/net/ipc/uts/cgroup namespaces and
 * a private /proc (the broker's processes and environment are invisible), /proc/sys and
 * friends read-only, the call's own cgroup with its process and memory limits, and every
 * process gone when the call ends (the pid namespace dies with its init; the cgroup is
 * killed), including ones started with `setsid`. The session's home (/home/tenant) is a
 * host directory that persists between calls, as a VM's would while it lives.
 *
 * Still NOT isolation-equivalent to a microVM: tenants share the host kernel (one kernel
 * bug away from the host), there is no network, and nothing runs between calls. It exists
 * for development and CI hosts without QEMU, and is never chosen implicitly.
 */
export class UnsafeLocalBackend implements VmBackend {
  readonly name = 'unsafe-local';
  readonly writesHostWorkspace = true;
  readonly isolation = 'host kernel: bubblewrap user namespace + seccomp + cgroup per call (NOT a VM boundary)';
  readonly canSuspend = false;
  private readonly sandboxes = new Set<UnsafeLocalSandbox>();

  constructor(
    private readonly fastPath: FastPath,
    private readonly log: Logger,
  ) {}

  async start(spec: SandboxSpec): Promise<{ sandbox: Sandbox; wake: WakeInfo }> {
    const t0 = performance.now();
    const home = join(spec.stateDir, 'home');
    privateDir(home);
    const sandbox = new UnsafeLocalSandbox(spec, this.fastPath, home, this.log.child({ session: spec.session, backend: this.name }), () => this.sandboxes.delete(sandbox));
    this.sandboxes.add(sandbox);
    return { sandbox, wake: { wakeMs: performance.now() - t0, woke: true, how: 'local-sandbox' } };
  }

  async shutdown(): Promise<void> {
    await Promise.all([...this.sandboxes].map((s) => s.close()));
  }
}

class UnsafeLocalSandbox implements Sandbox {
  readonly exited: Promise<Error | undefined>;
  private closeNow: (e: Error | undefined) => void = () => undefined;
  private readonly running = new Set<AbortController>();

  constructor(
    readonly spec: SandboxSpec,
    private readonly fastPath: FastPath,
    private readonly home: string,
    private readonly log: Logger,
    private readonly onClose: () => void,
  ) {
    // Nothing runs between calls, so the sandbox never dies on its own.
    this.exited = new Promise((r) => (this.closeNow = r));
  }

  /** No agent process: every call is a fresh sandbox. */
  get agent(): AgentClient {
    throw new HutchError('unavailable', 'the unsafe-local backend has no guest agent');
  }

  async exec(req: SandboxExecRequest): Promise<SyncedExecResult> {
    const ac = new AbortController();
    const onAbort = () => ac.abort(req.signal?.reason);
    req.signal?.addEventListener('abort', onAbort, { once: true });
    this.running.add(ac);
    try {
      const r = await this.fastPath.run({
        command: req.command ?? shellJoin(req.argv ?? []),
        workspace: this.spec.workspaceDir,
        cwd: req.cwd,
        env: req.env,
        home: this.home,
        stdin: req.stdin === undefined ? undefined : await collect(req.stdin),
        timeoutMs: req.timeoutMs,
        maxOutputBytes: req.maxOutputBytes,
        fileSizeLimitBytes: req.fileSizeLimitBytes,
        onStdout: req.onStdout,
        onStderr: req.onStderr,
        signal: ac.signal,
        ...(req.onSignalable ? { onSignalable: req.onSignalable } : {}),
      });
      if (r.limits.oomKilled || r.limits.processLimitHit) this.log.info('unsafe_local.limit_hit', { oomKilled: r.limits.oomKilled, processLimitHit: r.limits.processLimitHit });
      return {
        exitCode: r.exitCode,
        signal: r.signal,
        timedOut: r.timedOut,
        cancelled: r.cancelled,
        durationMs: r.durationMs,
        stdout: r.stdout,
        stderr: r.stderr,
        pushedBytes: 0,
        pulledBytes: 0,
      };
    } finally {
      req.signal?.removeEventListener('abort', onAbort);
      this.running.delete(ac);
    }
  }

  async synced<T>(): Promise<Synced<T>> {
    // File tools through an agent are the routing-off levels (1-3), which exist to compare VMs.
    throw new HutchError('unavailable', 'the unsafe-local backend runs commands only; policies without routing (levels 1-3) need the qemu backend');
  }

  /** Home lives on the host and nothing runs between calls: releasing loses nothing. */
  async state(): Promise<GuestState> {
    return { dirty: false, dirtyPaths: [], processes: 0 };
  }

  homeChanges(): string[] {
    try {
      return readdirSync(this.home, { recursive: true }).map(String);
    } catch {
      return [];
    }
  }

  async close(): Promise<void> {
    for (const ac of this.running) ac.abort(new HutchError('cancelled', 'sandbox closed'));
    this.closeNow(undefined);
    this.onClose();
  }
}

async function collect(input: Uint8Array | AsyncIterable<Uint8Array>): Promise<Uint8Array> {
  if (input instanceof Uint8Array) return input;
  const parts: Uint8Array[] = [];
  for await (const p of input) parts.push(p);
  return Buffer.concat(parts);
}

/** argv as one bash command line (the fast path runs `bash -c`). */
function shellJoin(argv: string[]): string {
  if (argv.length === 0) throw new HutchError('bad_request', 'exec needs a command or argv');
  return argv.map((a) => `'${a.replace(/'/g, `'\\''`)}'`).join(' ');
}
