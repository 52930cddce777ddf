import type { Handler } from '../protocol/connection.ts';
import type { CallUsage } from '../protocol/methods-telemetry.ts';
import { readVmstat, vmstatDelta } from './vmstat.ts';

const PAGE = 4096;

/**
 * Wraps the exec handler so every result says what the call cost in memory terms: the
 * major faults and swap-ins the guest saw while it ran. Guest-wide counters: one call
 * runs at a time per session, so they are the call's, give or take the agent's own.
 */
export function withCallUsage(exec: Handler<'exec'>): Handler<'exec'> {
  return async (p, ctx) => {
    const before = readVmstat();
    const r = await exec(p, ctx);
    const d = vmstatDelta(before, readVmstat());
    const usage: CallUsage = {
      majorFaults: d.pgmajfault,
      swapReadBytes: d.pswpin * PAGE,
      zswapIns: d.zswpin,
      refaults: d.workingset_refault_anon + d.workingset_refault_file,
    };
    return { ...r, usage };
  };
}
