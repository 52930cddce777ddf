import { appendFileSync, existsSync } from 'node:fs';
import type { Handler, RequestContext } from '../protocol/connection.ts';
import { HutchError } from '../protocol/errors.ts';
import type { ExecParams, ResultOf } from '../protocol/methods.ts';
import type { Workspace } from '../workspace/confine.ts';
import { runProcess, type RunningProcess } from './run-process.ts';

export interface ExecConfig {
  /** Environment every command starts from; the request's env is laid over it. */
  baseEnv: Record<string, string>;
  /** Identity tenant commands run as (the unprivileged tenant user in the guest). */
  uid?: number | undefined;
  gid?: number | undefined;
  defaultTimeoutMs: number;
  defaultMaxOutputBytes: number;
  /** Extra kill step on timeout/cancel (the guest kills the workload cgroup). */
  onKill?: (() => void) | undefined;
  /** Kill background processes a command leaves behind (host-side agents). */
  killGroupOnExit?: boolean | undefined;
  /**
   * cgroup v2 directory tenant commands run in (pids.max, memory controls). In the guest
   * image they start there (hutch-spawn joins it before exec); without the helper they are
   * moved right after spawn, and a child forked before the move stays behind.
   */
  cgroup?: string | undefined;
}

/** Told when tenant commands start and end (the memory manager records what each call touched). */
export interface ExecObserver {
  /** Awaited before the command starts. */
  beforeExec(): Promise<void>;
  /** After the command ended; not awaited (the result goes out first). */
  afterExec(): void;
}

/** The helper baked into the guest image (guest-agent/native/hutch-spawn.c); absent on a plain host. */
const SPAWN_HELPER = process.env['HUTCH_SPAWN_HELPER'] ?? '/opt/hutch/hutch-spawn';
let spawnHelperFound: boolean | undefined;

function cgroupSpawnHelper(): string | undefined {
  spawnHelperFound ??= existsSync(SPAWN_HELPER);
  return spawnHelperFound ? SPAWN_HELPER : undefined;
}

/** Serves `exec` and `exec.signal` over a connection, streaming output as it comes. */
export class ExecService {
  private readonly running = new Map<number, RunningProcess>();
  private readonly observers = new Set<ExecObserver>();
  private gate: Promise<void> = Promise.resolve();

  constructor(
    private readonly ws: Workspace,
    private readonly cfg: ExecConfig,
  ) {}

  /** Tenant commands start only after `p` settles (the clock being set after a restore). */
  holdUntil(p: Promise<void>): void {
    this.gate = Promise.all([this.gate, p]).then(() => undefined);
  }

  observe(o: ExecObserver): void {
    this.observers.add(o);
  }

  get activeCount(): number {
    return this.running.size;
  }

  readonly exec: Handler<'exec'> = async (p: ExecParams, ctx: RequestContext) => {
    const cwd = this.ws.resolve(p.cwd ?? '.');
    if (!cwd.stat?.isDirectory()) throw new HutchError('not_a_directory', `cwd ${p.cwd} is not a directory`, { cwd: p.cwd });
    const stdout = ctx.outbound(p.stdout);
    const stderr = ctx.outbound(p.stderr);
    const stdin = p.stdin !== undefined ? ctx.inbound(p.stdin) : undefined;
    await this.gate;
    const observers = [...this.observers];
    for (const o of observers) await o.beforeExec();
    let proc: RunningProcess;
    const argv = p.argv ?? ['bash', '--norc', '--noprofile', '-c', p.command as string];
    // Started inside the cgroup by the helper (which also drops to the tenant's ids), or
    // moved there right after spawn, which races with what the command forks first.
    const spawnHelper = this.cfg.cgroup ? cgroupSpawnHelper() : undefined;
    try {
      proc = runProcess({
        argv: spawnHelper && this.cfg.cgroup ? [spawnHelper, `${this.cfg.cgroup}/cgroup.procs`, String(this.cfg.uid ?? 0), String(this.cfg.gid ?? 0), '--', ...argv] : argv,
        cwd: cwd.abs,
        env: { ...this.cfg.baseEnv, ...p.env },
        uid: spawnHelper ? undefined : this.cfg.uid,
        gid: spawnHelper ? undefined : this.cfg.gid,
        stdin,
        onStdout: (c) => stdout.write(c),
        onStderr: (c) => stderr.write(c),
        maxOutputBytes: p.maxOutputBytes ?? this.cfg.defaultMaxOutputBytes,
        timeoutMs: p.timeoutMs ?? this.cfg.defaultTimeoutMs,
        signal: ctx.signal,
        onKill: this.cfg.onKill,
        killGroupOnExit: this.cfg.killGroupOnExit,
      });
    } catch (err) {
      stdout.end();
      stderr.end();
      for (const o of observers) o.afterExec();
      throw err;
    }
    if (this.cfg.cgroup && !spawnHelper) {
      try {
        appendFileSync(`${this.cfg.cgroup}/cgroup.procs`, `${proc.pid}\n`);
      } catch {
        // the process may already be gone; a missing cgroup was reported at start
      }
    }
    this.running.set(ctx.id, proc);
    try {
      const r = await proc.result;
      stdin?.stop();
      stdout.end();
      stderr.end();
      await Promise.all([stdout.flushed(), stderr.flushed()]);
      return r satisfies ResultOf<'exec'>;
    } finally {
      this.running.delete(ctx.id);
      for (const o of observers) o.afterExec();
    }
  };

  readonly signal: Handler<'exec.signal'> = async (p) => {
    const proc = this.running.get(p.call);
    if (!proc) throw new HutchError('not_found', `no running exec with call id ${p.call}`, { call: p.call });
    return { delivered: proc.kill(p.signal) };
  };
}
