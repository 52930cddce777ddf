import { noopLogger, type Logger } from '../log.ts';
import type { ExecService } from '../process/exec-handler.ts';
import type { Handlers } from '../protocol/connection.ts';
import { HutchError } from '../protocol/errors.ts';
import type { MemoryPolicyOutcome } from '../protocol/methods-memory.ts';
import { MemoryController } from './controller.ts';
import { MemoryPolicy } from './policy.ts';
import { applyDamon, damonAvailable, damonState, systemRamSpan } from './damon.ts';
import { probeDamonRegions } from './damon-probe.ts';
import { readKnobOr } from './knobs.ts';
import { mglruState, setMglru } from './mglru.ts';
import { pageIdleAvailable } from './page-idle.ts';
import { reportingState, setReportingOrder } from './page-reporting.ts';
import { helperPath } from './prefetch.ts';
import { memInfo, swapStats } from './stats.ts';
import { applyZswap, zswapAvailable, zswapState } from './zswap.ts';
import { workloadProcesses } from './activation-set.ts';

export interface MemoryContext {
  /** cgroup v2 directory tenant commands run in (memory.reclaim target). */
  workloadCgroup?: string | undefined;
  /** The agent's exec service: calls starting and ending delimit activation sets. */
  execs?: ExecService | undefined;
  log?: Logger | undefined;
}

/** One controller and policy per exec service (per agent), shared by all its connections. */
const controllers = new WeakMap<object, { mem: MemoryController; policy: MemoryPolicy }>();
const noExecs = {};

function controllerFor(ctx: MemoryContext): { mem: MemoryController; policy: MemoryPolicy } {
  const owner = ctx.execs ?? noExecs;
  let c = controllers.get(owner);
  if (!c) {
    const log = ctx.log?.child({ component: 'memory' }) ?? noopLogger;
    const mem = new MemoryController(ctx.workloadCgroup, log);
    const policy = new MemoryPolicy(mem, ctx.execs, log);
    ctx.execs?.observe(mem);
    ctx.execs?.observe(policy);
    c = { mem, policy };
    controllers.set(owner, c);
  }
  return c;
}

/** The memory policy's outcome for telemetry: null until the broker set a policy. */
export function memoryPolicyOutcome(ctx: MemoryContext): MemoryPolicyOutcome | null {
  const c = controllers.get(ctx.execs ?? noExecs);
  const o = c?.policy.outcome();
  return o && o.state !== 'none' ? o : null;
}

function orNull<T>(f: () => T): T | null {
  try {
    return f();
  } catch (err) {
    if (err instanceof HutchError && err.code === 'unavailable') return null;
    throw err;
  }
}

function requireRoot(): void {
  if (process.getuid?.() !== 0) throw new HutchError('permission_denied', 'memory controls need the agent to run as root in a guest it owns');
}

/** Handlers of the mem.* methods (protocol: guest-agent/src/protocol/methods-memory.ts). */
export function memoryHandlers(ctx: MemoryContext): Handlers {
  const { mem, policy } = controllerFor(ctx);
  const cg = ctx.workloadCgroup;
  return {
    'mem.policy': async (p) => {
      requireRoot();
      return policy.set(p);
    },
    'mem.reclaim': async (p) => {
      requireRoot();
      return mem.reclaim(p);
    },
    'mem.zswap': async (p) => {
      if (Object.keys(p).length > 0) requireRoot();
      return Object.keys(p).length > 0 ? applyZswap(p, cg) : zswapState(cg);
    },
    'mem.mglru': async (p) => {
      requireRoot();
      return setMglru(p.enabled);
    },
    'mem.damon': async (p) => {
      requireRoot();
      return applyDamon(p.profile, p.dirtyFlush, p.backend);
    },
    'mem.damonRegions': async (p) => {
      requireRoot();
      const span = systemRamSpan();
      if (!span) throw new HutchError('internal', 'no "System RAM" range in /proc/iomem');
      const regions = await probeDamonRegions(span, p.ms);
      let idleBytes = 0;
      let totalBytes = 0;
      for (const r of regions) {
        totalBytes += r.end - r.start;
        if (r.nrAccesses === 0) idleBytes += r.end - r.start;
      }
      return { regions: regions.slice(0, 2000), idleBytes, totalBytes };
    },
    'mem.reporting': async (p) => {
      requireRoot();
      return setReportingOrder(p.order);
    },
    'mem.activation': async (p) => {
      mem.configure({ track: p.track, method: p.method });
      await mem.settled();
      return mem.activation(p.maxRanges ?? 0);
    },
    'mem.prefetch': async () => {
      requireRoot();
      return mem.prefetch();
    },
    'mem.status': async () => ({
      mem: memInfo(),
      swap: swapStats(),
      workload: {
        cgroup: cg ?? null,
        currentBytes: cg ? numOrNull(readKnobOr(`${cg}/memory.current`)) : null,
        swapBytes: cg ? numOrNull(readKnobOr(`${cg}/memory.swap.current`)) : null,
        zswapBytes: cg ? numOrNull(readKnobOr(`${cg}/memory.zswap.current`)) : null,
        processes: cg ? workloadProcesses(cg).length : 0,
      },
      zswap: zswapAvailable() ? zswapState(cg) : null,
      mglru: orNull(mglruState),
      damon: damonAvailable() && process.getuid?.() === 0 ? damonState() : null,
      reporting: reportingState(),
      idlePageTracking: pageIdleAvailable(),
      prefetchHelper: helperPath(),
    }),
  };
}

function numOrNull(s: string | null): number | null {
  return s === null || !/^\d+$/.test(s) ? null : Number(s);
}
