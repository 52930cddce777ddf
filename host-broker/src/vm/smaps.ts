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

/** Resident, private and swapped KiB of a set of mappings. */
export interface MappingMemory {
  /** Mapped size (virtual). */
  sizeKiB: number;
  rssKiB: number;
  pssKiB: number;
  /** Private_Clean + Private_Dirty: pages no other process maps (USS). */
  privateKiB: number;
  /** Swapped out to the host's swap. */
  swapKiB: number;
  /** Anonymous pages (for a restored VM: guest RAM copied on write, and QEMU's own heap). */
  anonKiB: number;
}

/**
 * A QEMU process's memory split into the TCG translation buffer and the rest, from
 * /proc/PID/smaps (KiB). The split matters because the buffer exists only under TCG: on a
 * KVM host the same VM costs the rest alone.
 *
 * The buffer is found by what it is: QEMU (tcg/region.c, alloc_code_gen_buffer) mmaps it
 * as one private anonymous read-write-execute region of tb-size bytes (a guard page at
 * its end makes the VMA one page short), and nothing else in a QEMU process maps anonymous
 * memory executable. So every anonymous `rwxp` mapping counts as the buffer; on a host
 * where QEMU splits it into a writable and an executable view of a memfd (split-wx), there
 * is none and `tcg` is zero, which `tcg.sizeKiB` shows.
 */
export interface QemuMemory {
  total: MappingMemory;
  tcg: MappingMemory;
  /** total minus tcg. */
  excludingTcg: MappingMemory;
  /**
   * The mapping of `guestRamFile` (a restored VM's snapshot RAM, mapped copy-on-write): its
   * private pages are the guest's writes since the restore. Zero when not asked for.
   */
  guestRam: MappingMemory;
}

export async function qemuMemory(pid: number, guestRamFile?: string): Promise<QemuMemory> {
  return splitTcg(await readFile(`/proc/${pid}/smaps`, 'utf8'), guestRamFile);
}

const HEADER = /^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ (\d+)(?:\s+(.*))?$/;
const FIELD = /^(\w+):\s+(\d+) kB$/;

/** Parses smaps text (exported for tests of the parsing). */
export function splitTcg(smaps: string, guestRamFile?: string): QemuMemory {
  const zero = (): MappingMemory => ({ sizeKiB: 0, rssKiB: 0, pssKiB: 0, privateKiB: 0, swapKiB: 0, anonKiB: 0 });
  const total = zero();
  const tcg = zero();
  const guestRam = zero();
  let current: MappingMemory | undefined;
  let isTcg = false;
  let isRam = false;
  const add = (into: MappingMemory, from: MappingMemory) => {
    for (const k of Object.keys(into) as Array<keyof MappingMemory>) into[k] += from[k];
  };
  const flush = () => {
    if (!current) return;
    add(total, current);
    if (isTcg) add(tcg, current);
    if (isRam) add(guestRam, current);
  };
  for (const line of smaps.split('\n')) {
    const h = HEADER.exec(line);
    if (h) {
      flush();
      current = zero();
      // Anonymous: no path and inode 0 ([heap], [stack] and the like have a name, and are not rwx).
      isTcg = h[3] === 'rwxp' && h[4] === '0' && (h[5] ?? '').trim() === '';
      isRam = guestRamFile !== undefined && (h[5] ?? '').trim() === guestRamFile;
      continue;
    }
    const f = FIELD.exec(line);
    if (!f || !current) continue;
    const v = Number(f[2]);
    switch (f[1]) {
      case 'Size':
        current.sizeKiB = v;
        break;
      case 'Rss':
        current.rssKiB = v;
        break;
      case 'Pss':
        current.pssKiB = v;
        break;
      case 'Private_Clean':
      case 'Private_Dirty':
        current.privateKiB += v;
        break;
      case 'Swap':
        current.swapKiB = v;
        break;
      case 'Anonymous':
        current.anonKiB = v;
        break;
    }
  }
  flush();
  const excludingTcg = zero();
  for (const k of Object.keys(excludingTcg) as Array<keyof MappingMemory>) excludingTcg[k] = total[k] - tcg[k];
  return { total, tcg, excludingTcg, guestRam };
}
