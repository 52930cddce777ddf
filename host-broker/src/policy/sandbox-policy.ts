import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { MemoryPolicySteps } from '../../../guest-agent/src/protocol/methods-memory.ts';

/**
 * How the broker treats a session's VM: where calls go, how a VM comes up, when and how
 * it is released. The defaults are hutch's ("level 4" plus the cost model); the published
 * levels exist so the density bench can compare against them in the same run.
 */
export interface SandboxPolicy {
  /**
   * Route file tools and read/edit-only shell away from the VM (in-process and the
   * bubblewrap fast path). Off: every call runs in the VM, file tools through the agent.
   */
  routing: boolean;
  /** How a VM comes up: copy-on-write restore of the pristine snapshot, or a cold boot. */
  wake: 'restore' | 'cold-boot';
  /** Release a VM this long after its last call (ms); null keeps it until the session closes. */
  idleMs: number | null;
  /**
   * What release does. 'auto': the cost model picks (kill when nothing outside /work and
   * /tmp changed, snapshot when it did, reclaim when live processes must survive and the
   * guest can reclaim). The others force one choice, for experiments.
   */
  idlePolicy: 'auto' | 'kill' | 'snapshot' | 'reclaim';
  /** On a wake from reclaim, prefetch the last call's activation set (alongside the call). */
  prefetch: boolean;
  /** Steps of the guest's own memory policy switched on or off (default all on but dropCaches; memory-policy.ts). */
  memoryPolicy?: Partial<MemoryPolicySteps>;
}

export const DEFAULT_POLICY: SandboxPolicy = { routing: true, wake: 'restore', idleMs: 5000, idlePolicy: 'auto', prefetch: true };

/** The published density levels, plus our extras. */
export const LEVELS = {
  /** A booted VM per tenant, never released. */
  '1': { routing: false, wake: 'cold-boot', idleMs: null, idlePolicy: 'kill', prefetch: false },
  /** Killed after 30 s idle, cold boot on the next call. */
  '2': { routing: false, wake: 'cold-boot', idleMs: 30_000, idlePolicy: 'kill', prefetch: false },
  /** Pristine-snapshot restore, 5 s release window, no routing. */
  '3': { routing: false, wake: 'restore', idleMs: 5000, idlePolicy: 'auto', prefetch: false },
  /** 3 + routing: hutch's default. */
  '4': DEFAULT_POLICY,
  /** 4, but idle VMs are kept and reclaimed into zswap/swap instead of killed. */
  reclaim: { routing: true, wake: 'restore', idleMs: 5000, idlePolicy: 'reclaim', prefetch: false },
  /** reclaim + prefetch of the recorded activation set on wake. */
  prefetch: { routing: true, wake: 'restore', idleMs: 5000, idlePolicy: 'reclaim', prefetch: true },
} as const satisfies Record<string, SandboxPolicy>;

export type LevelName = keyof typeof LEVELS;
export const LEVEL_NAMES = Object.keys(LEVELS) as LevelName[];

export function policyForLevel(level: string): SandboxPolicy {
  if (!Object.prototype.hasOwnProperty.call(LEVELS, level)) {
    throw new HutchError('bad_request', `unknown level ${JSON.stringify(level)}; expected one of ${LEVEL_NAMES.join(', ')}`);
  }
  return { ...LEVELS[level as LevelName] };
}
