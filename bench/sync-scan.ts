/**
 * The guest agent's change scan: what every VM call pays after the command to find what it
 * changed in /work (sync.changes with nothing changed), run natively on trees of growing
 * size: a KVM guest runs it at about this speed, an emulated (TCG) one far slower.
 *   scan_p50_ms            per tree size, the scan as shipped (directories listed on the agent's thread)
 *   baseline_scan_p50_ms   the same scan listing through libuv's thread pool (the previous code)
 *   speedup                baseline / shipped, per size
 * Raw per-round times are kept in the raw line. `npx tsx bench/sync-scan.ts [--json] [--quick]`
 */
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { Workspace } from '../guest-agent/src/workspace/confine.ts';
import { WorkspaceSync, type RecordSink } from '../guest-agent/src/workspace/sync.ts';
import { benchArgs, emit, markdownTable, median, round } from './lib/report.ts';

const args = benchArgs();
/** --quick: seconds, to check the bench still runs to its JSON line (test/benches.test.ts), not a measurement. */
const quick = args.argv.includes('--quick');
const SIZES = quick ? [100, 1_000] : [100, 1_000, 10_000];
const ROUNDS = quick ? 3 : 41;
const REPS = quick ? 1 : 3;

const dir = mkdtempSync(join(tmpdir(), 'hutch-bench-scan-'));
process.on('exit', () => rmSync(dir, { recursive: true, force: true }));

/** A project-like tree: directories of 20 files, two levels deep. */
function makeTree(root: string, entries: number): void {
  let made = 0;
  for (let d = 0; made < entries; d++) {
    const sub = join(root, `pkg${d % 10}`, `mod${d}`);
    mkdirSync(sub, { recursive: true });
    made += d < 10 ? 2 : 1;
    for (let f = 0; f < 20 && made < entries; f++, made++) writeFileSync(join(sub, `f${f}.ts`), `export const v = ${f};\n`);
  }
}

const sink: RecordSink = { write: async () => undefined };

async function timeScans(root: string, threadPoolListing: boolean): Promise<number[]> {
  const sync = new WorkspaceSync(new Workspace(root), { threadPoolListing });
  let marker = (await sync.mark()).marker;
  const times: number[] = [];
  for (let i = 0; i < ROUNDS; i++) {
    const t0 = performance.now();
    const r = await sync.changes(marker, { inlineMaxBytes: 64 * 1024 }, sink);
    times.push(performance.now() - t0);
    if (r.changes !== 0) throw new Error(`the tree changed under the bench (${r.changes} changes)`);
    marker = r.marker;
  }
  return times;
}

const rows: Array<Record<string, number>> = [];
const raw: Record<string, { shipped: number[]; baseline: number[] }> = {};
const scan: Record<string, number> = {};
const baseline: Record<string, number> = {};
const speedup: Record<string, number> = {};
for (const n of SIZES) {
  const root = join(dir, `t${n}`);
  makeTree(root, n);
  // Alternate the two so machine noise hits both alike.
  const shipped: number[] = [];
  const pool: number[] = [];
  for (let rep = 0; rep < REPS; rep++) {
    pool.push(...(await timeScans(root, true)));
    shipped.push(...(await timeScans(root, false)));
  }
  raw[n] = { shipped: shipped.map((t) => round(t, 3)), baseline: pool.map((t) => round(t, 3)) };
  scan[n] = round(median(shipped), 3);
  baseline[n] = round(median(pool), 3);
  speedup[n] = round(baseline[n] / scan[n], 2);
  rows.push({ entries: n, scan_p50_ms: scan[n], baseline_scan_p50_ms: baseline[n], speedup: speedup[n] });
}

emit('Guest change scan (native)', markdownTable(rows), { scan_p50_ms: scan, baseline_scan_p50_ms: baseline, speedup, rounds: ROUNDS * REPS }, args.json ? raw : undefined);
