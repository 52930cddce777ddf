/**
 * The search for the largest passing N at one level: double from the start until a step
 * fails, then bisect between the last pass and the first fail. Bounded by a wall-clock
 * budget (a step only starts if it fits) and a tenant cap. When even the smallest N
 * fails, there is no passing N to find; the ladder is still walked (until errors, the cap
 * or the budget) so the plot shows how latency grows with tenants.
 */
import { LevelUnavailable, type StepResult } from './tenants-step.ts';
import type { CallSample } from './tenants-tenant.ts';

export interface SearchPlan {
  level: string;
  start: number;
  max: number;
  /** performance.now() by which the last step must have finished. */
  budgetEnd: number;
  /** Expected wall time of one step (its duration plus broker start/stop). */
  stepEstimateMs: number;
  /** Stop bisecting when the bracket is this tight relative to the last pass (0.125 = 12.5%). */
  resolution: number;
  /**
   * Which pass rule drives the search: 'published' (p99 added over bare host < 1.5 s) or
   * 'broker' (p99 of the broker's own added time < 1.5 s). Both are reported either way,
   * each as the largest N among the steps run that passed it.
   */
  rule: 'published' | 'broker';
  run(tenants: number): Promise<{ result: StepResult; samples: CallSample[] }>;
  progress(m: string): void;
}

export interface LevelResult {
  level: string;
  /** Largest N that passed the published rule (0: none did). */
  max_tenants: number;
  /** Largest N that passed the broker-added rule (0: none did; absent in results older than the rule). */
  max_tenants_broker_rule?: number;
  /** The rule that drove the search. */
  rule?: 'published' | 'broker';
  unavailable?: string;
  /** Why the search stopped where it did. */
  stopped: string;
  steps: StepResult[];
}

/** `afterStep` sees the level so far after every step (results are written as they come, not only at the end). */
export async function searchLevel(p: SearchPlan, afterStep: (level: LevelResult, tenants: number, s: CallSample[]) => void): Promise<LevelResult> {
  const steps: StepResult[] = [];
  const maxPassing = (ok: (s: StepResult) => boolean) => steps.filter(ok).reduce((m, s) => Math.max(m, s.tenants), 0);
  const result = (stopped: string): LevelResult => ({
    level: p.level,
    max_tenants: maxPassing((s) => s.pass),
    max_tenants_broker_rule: maxPassing((s) => s.pass_broker_rule),
    rule: p.rule,
    stopped,
    steps,
  });
  let lo = 0;
  let hi = Infinity;
  let n = Math.max(1, p.start);
  let stopped = '';
  for (;;) {
    if (n > p.max) {
      stopped = `reached the tenant cap (${p.max})`;
      break;
    }
    if (performance.now() + p.stepEstimateMs > p.budgetEnd) {
      stopped = `out of wall-clock budget before N=${n}`;
      break;
    }
    let step: { result: StepResult; samples: CallSample[] };
    try {
      step = await p.run(n);
    } catch (err) {
      if (err instanceof LevelUnavailable) return { ...result('level unavailable'), max_tenants: 0, max_tenants_broker_rule: 0, unavailable: err.message };
      // One broken step (say, the guest image rebuilt under us) should not lose the steps before it.
      stopped = `the step at N=${n} could not run: ${(err as Error).message}`;
      p.progress(stopped);
      break;
    }
    steps.push(step.result);
    const passed = p.rule === 'broker' ? step.result.pass_broker_rule : step.result.pass;
    if (passed) lo = Math.max(lo, n);
    afterStep(result(`in progress (last step N=${n})`), n, step.samples);
    if (!passed) hi = Math.min(hi, n);

    if (hi === Infinity) {
      if (n >= p.max) {
        stopped = `every step passed up to the tenant cap (${p.max})`;
        break;
      }
      n = Math.min(p.max, n * 2);
    } else if (lo === 0) {
      // Nothing passes; keep walking the ladder for the curve, unless the runtime broke.
      if (step.result.errors > 0 || step.result.oom_kills > 0) {
        stopped = `no N passed; stopped the curve at N=${n} (${(p.rule === 'broker' ? step.result.broker_rule_fail_reasons : step.result.fail_reasons).join('; ')})`;
        break;
      }
      if (n >= p.max) {
        stopped = `no N passed; curve walked up to the tenant cap (${p.max})`;
        break;
      }
      n = Math.min(p.max, n * 2);
    } else {
      const mid = Math.floor((lo + hi) / 2);
      if (mid <= lo || hi - lo <= Math.max(1, Math.round(lo * p.resolution))) {
        stopped = `bracketed: ${lo} passes, ${hi} fails`;
        break;
      }
      n = mid;
    }
  }
  if (lo === 0 && !stopped.startsWith('no N passed')) stopped = `no N passed; ${stopped}`;
  return result(stopped);
}
