/**
 * Process-count and memory limits for fast-path runs, and how they are enforced here.
 * Detection order: cgroup v2 with the pids and memory controllers, then cgroup v1 pids +
 * memory hierarchies, then rlimits. The wall-clock timeout and the output cap are
 * runProcess's job and are not repeated here.
 */
import type { Logger } from '../../../guest-agent/src/log.ts';
import { probeCgroupLimiter, type CgroupLimiter } from './cgroup-limiter.ts';
import { RlimitLimiter } from './rlimit-limiter.ts';

export type LimitMechanism = 'cgroup-v2' | 'cgroup-v1' | 'rlimit';

export interface LimitSettings {
  /** Processes (and threads) the whole sandbox may hold at once, bwrap's own included. */
  maxProcesses: number;
  /** Memory of the whole sandbox (cgroups) or address space and data per process (rlimit). */
  memoryBytes: number;
}

/** What every run of one fast path together may hold (the pool cgroup above the runs' own). */
export interface LimitTotals {
  totalProcesses: number;
  totalMemoryBytes: number;
}

export interface LimitDescription extends LimitSettings, LimitTotals {
  mechanism: LimitMechanism;
  /** Whether the process limit really holds for the sandbox (see rlimit-limiter.ts). */
  processLimitEnforced: boolean;
  memoryScope: 'sandbox' | 'per-process address space';
  /** Whether the kernel holds all runs together to the totals (a pool cgroup); otherwise only the broker's admission does. */
  totalEnforced: boolean;
  /** Where per-run cgroups are made (this fast path's pool). */
  cgroupParents: string[];
  /** Why the mechanisms before this one were not used. */
  notes: string[];
}

export interface RunLimitReport extends LimitSettings {
  mechanism: LimitMechanism;
  /** The kernel's OOM killer killed something in the sandbox (cgroups only). */
  oomKilled: boolean;
  /** A fork or clone failed because the process limit was reached (cgroups only). */
  processLimitHit: boolean;
  /** Peak memory of the sandbox during the run, when the kernel reports it. */
  peakMemoryBytes: number | null;
}

/** One run's place under the limits. */
export interface RunSlot {
  /** Wraps the sandbox argv so the limits apply before its first fork. */
  wrap(argv: string[]): string[];
  /**
   * cgroup v1 only: the slot's `tasks` files. A forker that moves its own forking thread
   * there for the length of its fork() starts the sandbox inside the slot without the
   * `sh` step of wrap() (one exec less; see spawn-helper-main.ts). Undefined otherwise.
   */
  threadEntry?: string[] | undefined;
  /** Kills whatever is in the slot (the backstop behind bwrap's own teardown). */
  kill(): void;
  /** Sends a signal to every process in the slot (the harness `signal` op); false where the limiter cannot see them. */
  signal(sig: NodeJS.Signals): boolean;
  /** After the run: makes sure nothing is left, reads what the limits saw, frees the slot. */
  release(): Promise<RunLimitReport>;
}

export interface Limiter {
  describe(): LimitDescription;
  acquire(): Promise<RunSlot>;
  close(): Promise<void>;
}

export interface LimiterOptions extends LimitSettings, LimitTotals {
  /** Force a mechanism (tests, hosts where detection guesses wrong). */
  mechanism?: LimitMechanism | undefined;
  /** A delegated cgroup directory to create run cgroups in (v2), instead of the broker's own. */
  cgroupParent?: string | undefined;
  /** The shell that enters the limits before exec'ing bwrap. */
  shell: string;
  /** Pids the limiter must never kill even if found in a slot (the broker, its spawn helper). */
  isProtected?: ((pid: number) => boolean) | undefined;
  log: Logger;
}

export async function createLimiter(opts: LimiterOptions): Promise<Limiter> {
  const notes: string[] = [];
  for (const version of ['cgroup-v2', 'cgroup-v1'] as const) {
    if (opts.mechanism !== undefined && opts.mechanism !== version) continue;
    const probe = probeCgroupLimiter(version, opts);
    if ('limiter' in probe) {
      try {
        await probe.limiter.init(notes);
        return probe.limiter;
      } catch (err) {
        if (opts.mechanism === version) throw err;
        notes.push(`${version}: ${(err as Error).message}`);
        continue;
      }
    }
    notes.push(`${version}: ${probe.unavailable}`);
    if (opts.mechanism === version) throw probe.error;
  }
  opts.log.warn('fastpath.limits.rlimit', { notes });
  return new RlimitLimiter(opts, notes);
}

export type { CgroupLimiter };
