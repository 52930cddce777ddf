import { existsSync, mkdirSync, readdirSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { buildAgent } from '../../../guest-agent/build.ts';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import { AgentClient } from '../agent-client.ts';
import { startDaemon, type Daemon } from '../util/daemon.ts';
import { waitForSocket } from '../util/wait-for-socket.ts';
import type { GuestState, Sandbox, SandboxExecRequest, SandboxSpec, Synced, SyncedExecResult, VmBackend, WakeInfo } from './backend.ts';

/**
 * The `local` backend: the real guest agent as a host process, inside bubblewrap with
 * /usr read-only, the session's workspace bound at /work and its own home, in private
 * pid/net/ipc/uts namespaces. It exists so everything runs end to end without a VM
 * (development, CI machines without QEMU).
 *
 * NOT isolation-equivalent to a microVM: tenant code shares the host kernel, runs as root
 * in the sandbox without seccomp, and sees parts of the host's /etc. Use `qemu` for
 * untrusted tenants.
 */
const HOST_ETC_FILES = ['passwd', 'group', 'nsswitch.conf', 'ld.so.cache', 'localtime', 'alternatives', 'gitconfig', 'mime.types'];

export class LocalBackend implements VmBackend {
  readonly name = 'local';
  readonly isolation = 'bubblewrap namespaces around a host process (NOT equivalent to a VM: shared kernel, no seccomp)';
  readonly canSuspend = false;
  private readonly sandboxes = new Set<LocalSandbox>();
  private bundle: Promise<string> | undefined;

  constructor(private readonly log: Logger) {}

  async start(spec: SandboxSpec): Promise<{ sandbox: Sandbox; wake: WakeInfo }> {
    const t0 = performance.now();
    // Rebuilt once per broker so the agent always matches this checkout (esbuild: ~0.2 s).
    this.bundle ??= buildAgent().then((b) => b.path);
    const bundle = await this.bundle;
    const runDir = join(spec.stateDir, 'run');
    const home = join(spec.stateDir, 'home');
    rmSync(runDir, { recursive: true, force: true });
    mkdirSync(runDir, { recursive: true });
    mkdirSync(home, { recursive: true });
    const argv = [
      'bwrap',
      '--die-with-parent',
      '--unshare-pid', '--unshare-ipc', '--unshare-uts', '--unshare-net', '--unshare-cgroup-try',
      '--cap-drop', 'ALL',
      '--ro-bind', '/usr', '/usr',
      '--symlink', 'usr/bin', '/bin', '--symlink', 'usr/sbin', '/sbin', '--symlink', 'usr/lib', '/lib', '--symlink', 'usr/lib64', '/lib64',
      ...HOST_ETC_FILES.filter((f) => existsSync(`/etc/${f}`)).flatMap((f) => ['--ro-bind', `/etc/${f}`, `/etc/${f}`]),
      '--proc', '/proc', '--dev', '/dev', '--tmpfs', '/tmp',
      '--bind', spec.workspaceDir, '/work',
      '--bind', home, '/home/tenant',
      '--ro-bind', bundle, '/opt/hutch/hutch-agent.mjs',
      '--bind', runDir, '/run/hutch',
      '--chdir', '/work',
      '--clearenv', '--setenv', 'PATH', '/usr/bin:/bin', '--setenv', 'HOME', '/home/tenant',
      process.execPath.startsWith('/usr/') ? process.execPath : '/usr/bin/node',
      '/opt/hutch/hutch-agent.mjs',
      '--listen', 'unix:/run/hutch/agent.sock', '--root', '/work', '--home', '/home/tenant', '--kill-on-exit', '--log-level', 'warn',
    ];
    const log = this.log.child({ session: spec.session, backend: 'local' });
    const daemon = startDaemon({ argv, log, interesting: /error|fatal/i });
    const sock = join(runDir, 'agent.sock');
    try {
      await waitForSocket(sock, { proc: daemon.proc, timeoutMs: 20_000 });
      const agent = await AgentClient.connectUnix(sock, { log });
      const sandbox = new LocalSandbox(spec, agent, daemon, home, () => this.sandboxes.delete(sandbox));
      this.sandboxes.add(sandbox);
      return { sandbox, wake: { wakeMs: performance.now() - t0, woke: true, how: 'local-process' } };
    } catch (err) {
      await daemon.stop(500);
      throw new HutchError('unavailable', `local agent did not start: ${(err as Error).message}; output: ${daemon.tail().join(' | ')}`, { session: spec.session });
    }
  }

  async shutdown(): Promise<void> {
    await Promise.all([...this.sandboxes].map((s) => s.close()));
  }
}

class LocalSandbox implements Sandbox {
  readonly exited: Promise<Error | undefined>;

  constructor(
    readonly spec: SandboxSpec,
    readonly agent: AgentClient,
    private readonly daemon: Daemon,
    private readonly home: string,
    private readonly onClose: () => void,
  ) {
    this.exited = daemon.exited.then(({ code, signal }) => new Error(`local agent exited (${code ?? signal})`));
  }

  async exec(req: SandboxExecRequest): Promise<SyncedExecResult> {
    const r = await this.synced((agent) => agent.exec(req).result);
    return { ...r.value, pushedBytes: 0, pulledBytes: 0 };
  }

  async synced<T>(fn: (agent: AgentClient) => Promise<T>): Promise<Synced<T>> {
    // The workspace is bind-mounted: nothing to push or pull.
    return { value: await fn(this.agent), pushedBytes: 0, pulledBytes: 0 };
  }

  /** Home lives on the host and survives the process: killing loses nothing. */
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
    this.agent.close();
    await this.daemon.stop(1000);
    this.onClose();
  }
}
