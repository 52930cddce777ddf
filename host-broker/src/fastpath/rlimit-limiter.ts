/**
 * The fallback when no cgroup controllers can be used: rlimits set by the `sh` step that
 * execs bwrap. They are weaker, and this says so in describe():
 *
 * - RLIMIT_NPROC is not enforced for processes whose real user is the host's root, and
 *   bwrap run by a root broker maps the sandbox uid (1000 inside) to host uid 0. Measured
 *   here: with `ulimit -p 5`, 12 background processes started inside the sandbox; the same
 *   sandbox started by a non-root host uid was held to the limit. So with a root broker the
 *   process limit does not hold.
 * - RLIMIT_AS and RLIMIT_DATA bound each process's address space and heap, not the
 *   sandbox's total memory, and nothing holds all runs together: the broker's admission
 *   (how many run at once, each counted at memoryBytes) is the only total here.
 */
import type { LimitDescription, Limiter, LimiterOptions, RunLimitReport, RunSlot } from './limits.ts';

export class RlimitLimiter implements Limiter {
  private readonly nprocHolds: boolean;

  constructor(
    private readonly opts: LimiterOptions,
    private readonly notes: string[],
  ) {
    this.nprocHolds = typeof process.getuid === 'function' && process.getuid() !== 0;
  }

  describe(): LimitDescription {
    const notes = [...this.notes];
    if (!this.nprocHolds) notes.push('rlimit: RLIMIT_NPROC is not enforced: the sandbox uid maps to host root, which the kernel exempts');
    return {
      mechanism: 'rlimit',
      maxProcesses: this.opts.maxProcesses,
      memoryBytes: this.opts.memoryBytes,
      totalProcesses: this.opts.totalProcesses,
      totalMemoryBytes: this.opts.totalMemoryBytes,
      processLimitEnforced: this.nprocHolds,
      memoryScope: 'per-process address space',
      totalEnforced: false,
      cgroupParents: [],
      notes,
    };
  }

  async acquire(): Promise<RunSlot> {
    const { maxProcesses, memoryBytes } = this.opts;
    const report: RunLimitReport = { mechanism: 'rlimit', maxProcesses, memoryBytes, oomKilled: false, processLimitHit: false, peakMemoryBytes: null };
    return {
      wrap: (argv) => [this.opts.shell, '-c', `ulimit -p ${maxProcesses} && ulimit -v ${Math.ceil(memoryBytes / 1024)} && ulimit -d ${Math.ceil(memoryBytes / 1024)} && exec "$@"`, 'hutch-enter', ...argv],
      kill: () => undefined, // nothing beyond bwrap's own teardown (pid namespace, --die-with-parent)
      signal: () => false, // without a cgroup the sandbox's processes cannot be found from here
      release: async () => report,
    };
  }

  async close(): Promise<void> {}
}
