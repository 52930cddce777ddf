import { readFileSync } from 'node:fs';
import { uptime } from 'node:os';
import pidusage from 'pidusage';
import { memInfo, swapStats } from '../memory/stats.ts';
import type { MemoryPolicyOutcome } from '../protocol/methods-memory.ts';
import type { TelemetrySample } from '../protocol/methods-telemetry.ts';
import { readVmstat, vmstatDelta, type VmstatCounters } from './vmstat.ts';

/** At most this many processes per sample: a fork-happy tenant must not blow up the frame. */
const MAX_PROCESSES = 64;

/**
 * Samples the guest for the broker: memory, swap and zswap, vmstat counters with their
 * increase since the previous sample, memory pressure, and per-process CPU and RSS of the
 * tenant's processes (pidusage) plus the agent's own.
 */
export class TelemetrySampler {
  private last: VmstatCounters | undefined;

  constructor(
    private readonly workloadCgroup: string | undefined,
    /** The guest memory policy's last outcome (what idle reclaimed, the wake's prefetch), if one is set. */
    private readonly memoryPolicy: () => MemoryPolicyOutcome | null = () => null,
  ) {}

  async sample(opts: { processes?: boolean } = {}): Promise<TelemetrySample> {
    const mem = memInfo();
    const swap = swapStats();
    const vm = readVmstat();
    const delta = this.last ? vmstatDelta(this.last, vm) : vmstatDelta(vm, vm);
    this.last = vm;
    const psi = readPsi('/proc/pressure/memory');
    const policy = this.memoryPolicy();
    return {
      atMs: Date.now(),
      uptimeS: uptime(),
      memory: {
        totalBytes: mem.totalBytes,
        freeBytes: mem.freeBytes,
        availableBytes: mem.availableBytes,
        cacheBytes: mem.cacheBytes,
        anonBytes: mem.anonBytes,
        swapUsedBytes: swap.swapUsedBytes,
        zswapPoolBytes: swap.zswapPoolBytes,
        zswapStoredBytes: swap.zswapStoredBytes,
      },
      vmstat: vm,
      vmstatDelta: delta,
      ...(psi ? { psiMemory: psi } : {}),
      ...(policy ? { memoryPolicy: policy } : {}),
      processes: opts.processes === false ? [] : await this.processes(),
    };
  }

  private async processes(): Promise<TelemetrySample['processes']> {
    const tenant = this.workloadCgroup ? readPids(`${this.workloadCgroup}/cgroup.procs`).slice(0, MAX_PROCESSES - 1) : [];
    const pids = [process.pid, ...tenant];
    // Processes may exit between listing and sampling: sample one by one, skip the gone.
    const out: TelemetrySample['processes'] = [];
    for (const pid of pids) {
      try {
        const s = await pidusage(pid);
        // The agent runs through the agent layer's loader, so its comm is "ld-linux-x86-64";
        // process.title would fix comm but overwrite the command line that shows what runs.
        out.push({ pid, comm: pid === process.pid ? 'hutch-agent' : comm(pid), cpuPercent: Math.max(0, s.cpu), rssBytes: Math.max(0, Math.round(s.memory)), agent: pid === process.pid });
      } catch {
        // exited
      }
    }
    return out;
  }
}

function readPids(path: string): number[] {
  try {
    return readFileSync(path, 'utf8')
      .split('\n')
      .filter((l) => l.trim() !== '')
      .map(Number);
  } catch {
    return [];
  }
}

function comm(pid: number): string {
  try {
    return readFileSync(`/proc/${pid}/comm`, 'utf8').trim();
  } catch {
    return '?';
  }
}

/** `some avg10=0.00 avg60=0.00 avg300=0.00 total=0` and the same for `full`. */
export function readPsi(path: string): TelemetrySample['psiMemory'] | undefined {
  let text: string;
  try {
    text = readFileSync(path, 'utf8');
  } catch {
    return undefined;
  }
  const line = (kind: string) => {
    const m = new RegExp(`^${kind} avg10=([\\d.]+) .*total=(\\d+)`, 'm').exec(text);
    return { avg10: m ? Number(m[1]) : 0, total: m ? Number(m[2]) : 0 };
  };
  const some = line('some');
  const full = line('full');
  return { someAvg10: some.avg10, fullAvg10: full.avg10, someTotalUs: some.total, fullTotalUs: full.total };
}
