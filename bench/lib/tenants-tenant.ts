/**
 * One simulated tenant: away (log-normal, mean 2 min), then a task (a random recorded
 * session replayed with its think times in a fresh sandbox made from the session's
 * project), again and again until the step's deadline. Times are divided by the time
 * compression factor; the broker's own windows (idle release) are not, so compressed runs
 * are a smoke, not a density figure.
 */
import type { Hutch } from '../../host-broker/src/sdk/index.ts';
import { logNormal, pick, type Rng } from './tenants-rng.ts';
import { replayCall, type RecordedSession } from './sessions.ts';

export const AWAY_MEAN_S = 120;
/** Spread of the away time's underlying normal; the published method gives only the mean. */
export const AWAY_SIGMA = 1;

export interface CallSample {
  tenant: number;
  session: string;
  /** Call index within the session, 0-based. */
  index: number;
  tool: string;
  route: string | undefined;
  woke: boolean;
  ok: boolean;
  /** Client-observed time. */
  ms: number;
  bareMs: number;
  /** ms - bareMs: the latency hutch added, as the published method defines it. */
  addedMs: number;
  /** The broker's own figure: its time minus the command's run time where it ran. */
  brokerAddedMs: number | undefined;
  /** Seconds since the step started, when the call was issued. */
  at: number;
  error?: string;
}

export interface TenantPlan {
  id: number;
  hutch: Hutch;
  rng: Rng;
  sessions: RecordedSession[];
  /** A prepared (git-initialised) copy of each project, on the broker's host. */
  templates: Map<string, string>;
  bare: Map<string, number[]>;
  compression: number;
  /** performance.now() at step start and at its deadline. */
  startedAt: number;
  deadline: number;
  /** Boot the VM while away (level 1: a booted VM per tenant at all times). */
  prewarm: boolean;
  record(s: CallSample): void;
  /** Something went wrong outside a call (closing a sandbox): counted as an error of the step. */
  problem(what: string): void;
}

/** Sleeps ms or until the deadline, whichever is first; false when the deadline cut it. */
async function sleepBefore(ms: number, deadline: number): Promise<boolean> {
  const left = deadline - performance.now();
  if (left <= 0) return false;
  await new Promise((r) => setTimeout(r, Math.max(0, Math.min(ms, left))));
  return performance.now() < deadline;
}

export async function runTenant(p: TenantPlan): Promise<{ tasks: number; completedTasks: number }> {
  let tasks = 0;
  let completed = 0;
  let first = true;
  while (performance.now() < p.deadline) {
    const s = pick(p.rng, p.sessions);
    const template = p.templates.get(s.project);
    if (!template) throw new Error(`tenant ${p.id}: no prepared project ${s.project} for session ${s.id}`);
    // The sandbox is made at the start of the away time, so making it (copying the
    // project) is not part of any call's latency, and level 1 can boot its VM meanwhile.
    const sb = await p.hutch.create({ workspace: { dir: template } });
    try {
      if (p.prewarm) await sb.hint('tool_call_pending');
      // The first away is a random fraction of a full one, so tenants start spread out
      // instead of all at t=0 (closer to a steady state within a short step).
      const away = (logNormal(p.rng, AWAY_MEAN_S, AWAY_SIGMA) * 1000 * (first ? p.rng() : 1)) / p.compression;
      first = false;
      if (!(await sleepBefore(away, p.deadline))) break;
      tasks++;
      let done = true;
      for (const [index, c] of s.calls.entries()) {
        if (!(await sleepBefore((c.think_s * 1000) / p.compression, p.deadline))) {
          done = false;
          break;
        }
        const at = (performance.now() - p.startedAt) / 1000;
        const o = await replayCall(sb, c);
        const bareMs = p.bare.get(s.id)?.[index] ?? 0;
        p.record({
          tenant: p.id,
          session: s.id,
          index,
          tool: c.tool,
          route: o.route,
          woke: o.woke ?? false,
          ok: o.ok,
          ms: o.ms,
          bareMs,
          addedMs: o.ms - bareMs,
          brokerAddedMs: o.addedMs,
          at,
          ...(o.ok ? {} : { error: o.error ?? `exit ${o.exitCode}, expected ${c.expect?.exit_code ?? 0}` }),
        });
      }
      if (done) completed++;
    } finally {
      await sb.close().catch((err: unknown) => p.problem(`tenant ${p.id}: closing the sandbox of ${s.id} failed: ${(err as Error).message}`));
    }
  }
  return { tasks, completedTasks: completed };
}
