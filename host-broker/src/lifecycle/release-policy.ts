import type { SandboxPolicy } from '../policy/sandbox-policy.ts';

export type ReleaseDecision = 'kill' | 'snapshot' | 'reclaim';

/** What the broker knows about an idle VM when its window ends. */
export interface ReleaseInputs {
  /** Something outside /work and /tmp changed (overlay upper not empty). */
  dirty: boolean;
  dirtyPaths: string[];
  /** Tenant processes alive (servers, REPLs): a kill loses them, a snapshot or reclaim keeps them. */
  processes: number;
  /** The backend can write snapshot slots. */
  canSuspend: boolean;
  /** The guest can reclaim its memory (agent has mem.reclaim). */
  canReclaim: boolean;
  /** Guest RAM size: what a snapshot writes per idle period, at most. */
  memoryMiB: number;
  /** Host memory still free in the broker's budget, MiB. */
  budgetFreeMiB: number;
  /** Idle periods this session had so far, and how long they were on average (ms). */
  meanIdleMs: number | undefined;
  /** Sequential write bandwidth the host gives snapshots, MiB/s. */
  diskMiBps: number;
  /**
   * The VM does not outlive this release (the broker is shutting down): a reclaimed VM
   * would be stopped with its processes and its changes outside /work, so only a snapshot
   * keeps them.
   */
  final?: boolean;
}

export interface ReleaseChoice {
  decision: ReleaseDecision;
  /** One sentence: what was found and why this was chosen. */
  reason: string;
}

/** Memory a reclaimed guest still holds (zswap pool + what the kernel keeps), MiB: measured ~10-25% of its RAM. */
const RECLAIMED_RESIDENT_FRACTION = 0.2;
/** Snapshot writes may use at most this share of the disk's bandwidth over an idle period. */
const SNAPSHOT_BANDWIDTH_SHARE = 0.25;

/**
 * The idle policy's cost model. A clean guest without live processes holds nothing the
 * host does not already have: kill it. Changed files alone go into a snapshot slot (zero
 * idle memory). Live processes survive a snapshot (the whole RAM written per idle period)
 * or reclaim (the VM stays, its memory goes to zswap/swap: tens of MiB written, some
 * memory held): reclaim wins when snapshots would eat too much disk bandwidth for how
 * often this session goes idle and the memory budget can hold a reclaimed VM.
 */
export function chooseRelease(policy: SandboxPolicy, x: ReleaseInputs): ReleaseChoice {
  const what = describe(x);
  if (policy.idlePolicy === 'kill') return { decision: 'kill', reason: `policy kill (${what})` };
  if (x.final) return finalChoice(policy, x, what);
  if (policy.idlePolicy === 'snapshot') {
    if (x.canSuspend) return { decision: 'snapshot', reason: `policy snapshot (${what})` };
    return { decision: 'kill', reason: `policy snapshot, but this backend cannot snapshot (${what}); killed` };
  }
  if (policy.idlePolicy === 'reclaim') {
    if (x.canReclaim) return { decision: 'reclaim', reason: `policy reclaim (${what})` };
    return autoChoice(x, `policy reclaim, but the guest cannot reclaim; `);
  }
  return autoChoice(x, '');
}

function autoChoice(x: ReleaseInputs, prefix: string): ReleaseChoice {
  const what = describe(x);
  if (!x.dirty && x.processes === 0) return { decision: 'kill', reason: `${prefix}nothing outside /work and /tmp changed and no process is alive; the host workspace is the whole state` };
  const reclaimHeldMiB = Math.ceil(x.memoryMiB * RECLAIMED_RESIDENT_FRACTION);
  const reclaimFits = x.canReclaim && x.budgetFreeMiB >= reclaimHeldMiB;
  // Changed files alone: a snapshot keeps them at zero idle memory, and the next wake restores it.
  if (x.processes === 0 && x.canSuspend) return { decision: 'snapshot', reason: `${prefix}${what}; snapshot into a slot (zero idle memory)` };
  if (x.canSuspend) {
    // Live processes survive either way: a snapshot writes the whole RAM per idle period,
    // reclaim writes tens of MiB and holds some memory. Seconds of disk a snapshot costs vs
    // the share of an idle period we allow it.
    const snapshotS = x.memoryMiB / x.diskMiBps;
    const allowedS = ((x.meanIdleMs ?? Number.POSITIVE_INFINITY) / 1000) * SNAPSHOT_BANDWIDTH_SHARE;
    if (reclaimFits && snapshotS > allowedS) {
      return { decision: 'reclaim', reason: `${prefix}${what}; a snapshot would write ~${x.memoryMiB} MiB (${snapshotS.toFixed(1)} s of disk) every ~${((x.meanIdleMs ?? 0) / 1000).toFixed(0)} s idle period, so reclaim (~${reclaimHeldMiB} MiB held, ${x.budgetFreeMiB} MiB free in budget)` };
    }
    return { decision: 'snapshot', reason: `${prefix}${what}; snapshot (${x.memoryMiB} MiB RAM, ${snapshotS.toFixed(1)} s of disk${reclaimFits ? '' : x.canReclaim ? `; reclaim would hold ~${reclaimHeldMiB} MiB, over the ${x.budgetFreeMiB} MiB left in the budget` : ''})` };
  }
  if (reclaimFits) return { decision: 'reclaim', reason: `${prefix}${what}; this backend cannot snapshot, so the VM is kept and reclaimed` };
  return { decision: 'kill', reason: `${prefix}${what}; this backend can neither snapshot nor reclaim: killed, state outside the workspace is lost` };
}

/** The last release of a VM that is about to stop: snapshot whatever a kill would lose. */
function finalChoice(policy: SandboxPolicy, x: ReleaseInputs, what: string): ReleaseChoice {
  const keep = policy.idlePolicy === 'snapshot' || x.dirty || x.processes > 0;
  if (!keep) return { decision: 'kill', reason: `nothing outside /work and /tmp changed and no process is alive; the host workspace is the whole state` };
  if (x.canSuspend) return { decision: 'snapshot', reason: `${what}; the VM stops here, so a snapshot into a slot (a reclaimed VM would not survive)` };
  return { decision: 'kill', reason: `${what}; the VM stops here and this backend cannot snapshot: state outside the workspace is lost` };
}

function describe(x: ReleaseInputs): string {
  const parts: string[] = [];
  if (x.dirty) parts.push(`changed outside /work and /tmp (${x.dirtyPaths.slice(0, 3).join(', ')}${x.dirtyPaths.length > 3 ? ', ...' : ''})`);
  else parts.push('clean outside /work and /tmp');
  if (x.processes > 0) parts.push(`${x.processes} live process${x.processes === 1 ? '' : 'es'}`);
  return parts.join(', ');
}
