import { closeSync, openSync, readFileSync, readSync } from 'node:fs';

/**
 * A process's memory as the kernel's page tables see it: its mappings (/proc/PID/maps)
 * and, per virtual page, whether it is present in RAM (with its page frame number),
 * swapped out, or neither (/proc/PID/pagemap, one 64-bit entry per page; PFNs need
 * CAP_SYS_ADMIN, which the agent has in the guest).
 */

export const PAGE = 4096;
/** User space ends at 2^47 on x86-64 (4-level paging): addresses fit a double exactly. */
const USER_END = 2 ** 47;
/** Entries read per pread: 512 KiB of pagemap covers 256 MiB of address space. */
const CHUNK_PAGES = 64 * 1024;

export interface Mapping {
  /** First page number (address / 4096) and one past the last. */
  startPage: number;
  endPage: number;
  perms: string;
  path: string;
}

export function listMappings(pid: number): Mapping[] {
  const out: Mapping[] = [];
  for (const line of readFileSync(`/proc/${pid}/maps`, 'utf8').split('\n')) {
    const m = /^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \S+\s*(.*)$/.exec(line);
    if (!m) continue;
    const start = Number.parseInt(m[1] as string, 16);
    const end = Number.parseInt(m[2] as string, 16);
    const perms = m[3] as string;
    // No access at all: guard pages and address space reservations (V8 reserves GiBs) that
    // nothing can have touched. [vsyscall] sits above user space.
    if (perms.startsWith('---') || end > USER_END) continue;
    out.push({ startPage: start / PAGE, endPage: end / PAGE, perms, path: m[4] ?? '' });
  }
  return out;
}

/** What one page-table walk found, per page of the range it covered. */
export interface PageVisitor {
  present?(page: number, pfn: number): void;
  swapped?(page: number): void;
}

/**
 * Walks the pagemap of `pid` over its mappings, calling the visitor for present and
 * swapped pages. Yields to the event loop between chunks so a big process does not stall
 * the agent's other connections.
 */
export async function walkPagemap(pid: number, mappings: Mapping[], visit: PageVisitor): Promise<void> {
  const fd = openSync(`/proc/${pid}/pagemap`, 'r');
  const buf = Buffer.allocUnsafe(CHUNK_PAGES * 8);
  try {
    for (const m of mappings) {
      for (let p = m.startPage; p < m.endPage; p += CHUNK_PAGES) {
        const n = Math.min(CHUNK_PAGES, m.endPage - p);
        const got = readSync(fd, buf, 0, n * 8, p * 8) / 8;
        for (let i = 0; i < got; i++) {
          const hi = buf.readUInt32LE(i * 8 + 4);
          if (hi & 0x80000000) visit.present?.(p + i, (hi & 0x7fffff) * 2 ** 32 + buf.readUInt32LE(i * 8));
          else if (hi & 0x40000000) visit.swapped?.(p + i);
        }
        await new Promise<void>((r) => setImmediate(r));
      }
    }
  } finally {
    closeSync(fd);
  }
}
