import { appendFileSync } from 'node:fs';
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
   * cgroup v2 directory tenant commands are moved into (pids.max, memory controls). The
   * move happens right after spawn; a command forking within its first instructions could
   * leave a child behind in the agent's cgroup, which its process group kill still reaches.
   */
  cgroup?: string | undefined;
}

/** Serves `exec` and `exec.signal` over a connection, streaming output as it comes. */
export class ExecService {
  private readonly running = new Map<number, RunningProcess>();
  private gate: Promise<void> = Promise.resolve();

  constructor(
    private readonly ws: Workspace,
    private readonly cfg: ExecConfig,
  ) {}

  /** Tenant commands start only after `p` settles (the clock being set after a restore). */
  holdUntil(p: Promise<void>): void {
    this.gate = Promise.all([this.gate, p]).then(() => undefined);
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
    let proc: RunningProcess;
    try {
      proc = runProcess({
        argv: p.argv ?? ['bash', '--norc', '--noprofile', '-c', p.command as string],
        cwd: cwd.abs,
        env: { ...this.cfg.baseEnv, ...p.env },
        uid: this.cfg.uid,
        gid: this.cfg.gid,
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
      throw err;
    }
    if (this.cfg.cgroup) {
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
    }
  };

  readonly signal: Handler<'exec.signal'> = async (p) => {
    const proc = this.running.get(p.call);
    if (!proc) throw new HutchError('not_found', `no running exec with call id ${p.call}`, { call: p.call });
    return { delivered: proc.kill(p.signal) };
  };
}
