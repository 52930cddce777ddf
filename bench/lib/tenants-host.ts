/**
 * What a density step costs the host, sampled from /proc while it runs: used memory
 * (MemTotal - MemAvailable, host-wide, so other work on a shared machine shows up too),
 * the PSS/RSS of this process's own QEMU children (ours only), CPU of the whole host and
 * of this process tree, and the kernel's OOM-kill counter.
 */
import { readdirSync, readFileSync } from 'node:fs';
import { availableParallelism } from 'node:os';
import { processMemory } from '../../host-broker/src/vm/smaps.ts';

/** USER_HZ: the unit of utime/stime in /proc; 100 on every Linux x86_64 kernel. */
const CLK_TCK = 100;

export function hostUsedMiB(): number {
  const text = readFileSync('/proc/meminfo', 'utf8');
  const kb = (k: string) => Number(new RegExp(`^${k}:\\s+(\\d+) kB`, 'm').exec(text)?.[1] ?? NaN);
  return (kb('MemTotal') - kb('MemAvailable')) / 1024;
}

function hostCpuTicks(): { busy: number; total: number } {
  const line = readFileSync('/proc/stat', 'utf8').split('\n')[0] ?? '';
  const v = line.trim().split(/\s+/).slice(1).map(Number);
  const total = v.slice(0, 8).reduce((a, b) => a + b, 0);
  const idle = (v[3] ?? 0) + (v[4] ?? 0);
  return { busy: total - idle, total };
}

/**
 * CPU seconds of this process plus every child it has reaped (QEMU, bwrap, helpers):
 * exact once the step's broker has stopped and reaped its VMs.
 */
export function treeCpuSeconds(): number {
  const stat = readFileSync('/proc/self/stat', 'utf8');
  const f = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  // After the comm field: state is f[0], so utime..cstime (fields 14-17) are f[11..14].
  return [11, 12, 13, 14].reduce((a, i) => a + Number(f[i] ?? 0), 0) / CLK_TCK;
}

export function oomKills(): number {
  const m = /^oom_kill (\d+)$/m.exec(readFileSync('/proc/vmstat', 'utf8'));
  return m ? Number(m[1]) : 0;
}

/**
 * Live QEMU processes below this process (the broker runs in-process). Descendants, not
 * only children: a restored VM's QEMU may run under a wrapper (setpriv, bwrap).
 */
function ourQemuPids(): number[] {
  const procs = new Map<number, { ppid: number; comm: string }>();
  for (const name of readdirSync('/proc')) {
    if (!/^\d+$/.test(name)) continue;
    try {
      const stat = readFileSync(`/proc/${name}/stat`, 'utf8');
      const comm = stat.slice(stat.indexOf('(') + 1, stat.lastIndexOf(')'));
      procs.set(Number(name), { ppid: Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]), comm });
    } catch {
      // the process exited between readdir and read
    }
  }
  const ours = (pid: number): boolean => {
    for (let p = procs.get(pid)?.ppid, hops = 0; p !== undefined && p > 1 && hops < 16; p = procs.get(p)?.ppid, hops++) if (p === process.pid) return true;
    return false;
  };
  return [...procs].filter(([pid, p]) => p.comm.startsWith('qemu') && ours(pid)).map(([pid]) => pid);
}

export interface HostCost {
  /** Peak of host used memory above the pre-step baseline, MiB (host-wide). */
  peakHostMiB: number;
  baselineHostMiB: number;
  /** Peak of the summed PSS / RSS of our QEMU processes, MiB. */
  peakQemuPssMiB: number;
  peakQemuRssMiB: number;
  peakLiveQemu: number;
  /** Busy share of all host cores over the step, % (everything on the host). */
  hostCpuPct: number;
  /** This process tree's CPU (broker, clients, QEMU, fast path) over the step, % of all cores. */
  treeCpuPct: number;
  oomKills: number;
  samples: number;
}

/** Samples until stopped; call stop() after the broker has stopped, so QEMU CPU is reaped and counted. */
export class HostSampler {
  private readonly baseline = hostUsedMiB();
  private readonly cpu0 = hostCpuTicks();
  private readonly tree0 = treeCpuSeconds();
  private readonly oom0 = oomKills();
  private readonly t0 = performance.now();
  private peakUsed = this.baseline;
  private peakPss = 0;
  private peakRss = 0;
  private peakLive = 0;
  private samples = 0;
  private busy = false;
  private readonly timer: NodeJS.Timeout;

  constructor(intervalMs = 1000) {
    this.timer = setInterval(() => void this.sample(), intervalMs);
    this.timer.unref();
  }

  private async sample(): Promise<void> {
    if (this.busy) return;
    this.busy = true;
    try {
      this.peakUsed = Math.max(this.peakUsed, hostUsedMiB());
      const pids = ourQemuPids();
      let pss = 0;
      let rss = 0;
      for (const pid of pids) {
        const m = await processMemory(pid).catch(() => undefined);
        pss += m?.pssKiB ?? 0;
        rss += m?.rssKiB ?? 0;
      }
      this.peakPss = Math.max(this.peakPss, pss / 1024);
      this.peakRss = Math.max(this.peakRss, rss / 1024);
      this.peakLive = Math.max(this.peakLive, pids.length);
      this.samples++;
    } finally {
      this.busy = false;
    }
  }

  stop(): HostCost {
    clearInterval(this.timer);
    const cpu = hostCpuTicks();
    const wallS = (performance.now() - this.t0) / 1000;
    const cores = availableParallelism();
    return {
      peakHostMiB: this.peakUsed - this.baseline,
      baselineHostMiB: this.baseline,
      peakQemuPssMiB: this.peakPss,
      peakQemuRssMiB: this.peakRss,
      peakLiveQemu: this.peakLive,
      hostCpuPct: (100 * (cpu.busy - this.cpu0.busy)) / Math.max(1, cpu.total - this.cpu0.total),
      treeCpuPct: (100 * (treeCpuSeconds() - this.tree0)) / Math.max(1e-9, wallS * cores),
      oomKills: oomKills() - this.oom0,
      samples: this.samples,
    };
  }
}
