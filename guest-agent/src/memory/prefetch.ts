import { existsSync } from 'node:fs';
import { performance } from 'node:perf_hooks';
import { HutchError } from '../protocol/errors.ts';
import { runProcess } from '../process/run-process.ts';
import { PAGE } from './pagemap.ts';
import { processRef, keyOf, toRanges, type ProcessSet } from './activation-set.ts';

/**
 * Prefetch on wake: MADV_WILLNEED of a recorded activation set in each process, through
 * process_madvise(2) in the native helper (guest-agent/native/hutch-madvise.c). The
 * kernel starts reading every swapped page of those ranges into the swap cache (zswap
 * entries are decompressed right away, disk pages are read in parallel), so the call that
 * follows takes minor faults instead of one serial disk read per page.
 */

export function helperPath(): string | null {
  const p = process.env['HUTCH_MADVISE_HELPER'] ?? '/opt/hutch/hutch-madvise';
  return existsSync(p) ? p : null;
}

export interface PrefetchOutcome {
  pages: number;
  bytes: number;
  ranges: number;
  processes: number;
  skippedProcesses: number;
  advisedBytes: number;
  failedRanges: number;
  ms: number;
}

interface HelperLine {
  pid: number;
  ranges: number;
  bytes: number;
  advised: number;
  failed: number;
  errno: number;
}

export async function prefetch(sets: Iterable<ProcessSet>, advice: 'willneed' | 'pageout' | 'cold' = 'willneed'): Promise<PrefetchOutcome> {
  const helper = helperPath();
  if (!helper) throw new HutchError('unavailable', 'the hutch-madvise helper is not installed (/opt/hutch/hutch-madvise, or $HUTCH_MADVISE_HELPER)');
  const t0 = performance.now();
  const lines: string[] = [];
  let processes = 0;
  let skipped = 0;
  let pages = 0;
  for (const s of sets) {
    // Only the very process that was recorded: a reused pid is someone else.
    const now = processRef(s.pid);
    if (!now || keyOf(now) !== keyOf(s)) {
      skipped++;
      continue;
    }
    if (s.pages.length === 0) continue;
    processes++;
    pages += s.pages.length;
    for (const [a, b] of toRanges(s.pages)) lines.push(`${s.pid} ${a.toString(16)} ${(b - a).toString(16)}`);
  }
  let out = '';
  let err = '';
  if (lines.length > 0) {
    const r = await runProcess({
      argv: [helper, advice],
      cwd: '/',
      env: {},
      stdin: Buffer.from(lines.join('\n') + '\n'),
      onStdout: (c) => void (out += c.toString()),
      onStderr: (c) => void (err += c.toString()),
      timeoutMs: 120_000,
    }).result;
    if (r.exitCode !== 0) throw new HutchError('internal', `hutch-madvise ${advice} failed (exit ${r.exitCode ?? r.signal}): ${err.trim()}`, { ranges: lines.length });
  }
  let advisedBytes = 0;
  let failedRanges = 0;
  for (const l of out.split('\n')) {
    if (!l.trim()) continue;
    const h = JSON.parse(l) as HelperLine;
    advisedBytes += h.advised;
    failedRanges += h.failed;
  }
  return { pages, bytes: pages * PAGE, ranges: lines.length, processes, skippedProcesses: skipped, advisedBytes, failedRanges, ms: performance.now() - t0 };
}
