import { readFile } from 'node:fs/promises';
import type { VmStats } from './vmm.ts';

/** Memory of a process from /proc/PID/smaps_rollup (KiB): what a VM costs the host. */
export async function processMemory(pid: number): Promise<VmStats> {
  const text = await readFile(`/proc/${pid}/smaps_rollup`, 'utf8');
  const kb = (key: string) => Number(new RegExp(`^${key}:\\s+(\\d+) kB`, 'm').exec(text)?.[1] ?? 0);
  return {
    rssKiB: kb('Rss'),
    pssKiB: kb('Pss'),
    privateKiB: kb('Private_Clean') + kb('Private_Dirty'),
    sharedKiB: kb('Shared_Clean') + kb('Shared_Dirty'),
    swapKiB: kb('Swap'),
  };
}
