/**
 * fastpath: the same read command bare on the host (`bash -c`, spawned by this process
 * through runProcess) vs through the bubblewrap + seccomp fast path, runs interleaved,
 * medians; then all again while this process holds >= 1 GiB of live heap (many small
 * objects, as a busy broker would), to show whether the fast path's spawn cost grows
 * with the broker's heap (it should not: the sandboxes are forked by a small helper).
 *
 *   npx tsx bench/fastpath.ts [--json] [--quick] [--runs N] [--heap-mib M]
 *
 * Also measured: the fast path with the in-process spawner (the broker forks bwrap
 * itself), which is what the helper is there to avoid; and bubblewrap baselines: a plain
 * `bwrap` with the fast path's namespaces and binds and no seccomp filter, spawned and timed
 * by this process (`raw_bwrap`: what bubblewrap itself costs here), the same forked by a
 * small process started at the beginning and timed inside it (`raw_bwrap_runner`: no round
 * trip, and a cost that does not grow with this process's heap), and bwrap with the filter
 * spawned by this process (`bwrap_only`).
 *
 *   fastpath_over_raw_ms           fast path p50 - raw_bwrap p50 (what hutch adds: filter,
 *                                  limits, helper round trips, request checks)
 *   fastpath_over_raw_strict_ms    fast path p50 - raw_bwrap_runner p50
 *   fastpath_over_raw_big_heap_ms  the same with this process holding the big heap: against
 *                                  the runner, since raw bwrap forked from a big process grows
 *                                  with its heap, which is what the fast path's helper avoids
 */
import { mkdtempSync, rmSync, writeFileSync, mkdirSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { setTimeout as sleep } from 'node:timers/promises';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { runProcess } from '../guest-agent/src/process/run-process.ts';
import { noopLogger } from '../guest-agent/src/log.ts';
import { FastPath, seccompFilter } from '../host-broker/src/fastpath/index.ts';
import { bwrapArgv, probeHostLayout } from '../host-broker/src/fastpath/bwrap-argv.ts';
import { createSandboxEtc } from '../host-broker/src/fastpath/sandbox-etc.ts';
import { HelperSpawner } from '../host-broker/src/fastpath/spawn-helper-client.ts';
import { benchArgs, emit, markdownTable, median, percentile, round } from './lib/report.ts';
import { randomBytes } from 'node:crypto';
import { Broker } from '../host-broker/src/broker.ts';
import { UnsafeLocalBackend } from '../host-broker/src/backends/local-backend.ts';
import { createFastPath } from '../host-broker/src/tools/fastpath-factory.ts';
import { Hutch } from '../host-broker/src/sdk/index.ts';

const args = benchArgs();
const numArg = (name: string, dflt: number): number => {
  const i = args.argv.indexOf(name);
  const v = i >= 0 ? Number(args.argv[i + 1]) : NaN;
  return Number.isFinite(v) && v > 0 ? v : dflt;
};
/** --quick: seconds (a few runs, a small "big" heap), to check the bench still runs to its JSON line (test/benches.test.ts). */
const quick = args.argv.includes('--quick');
const RUNS = numArg('--runs', quick ? 3 : 30);
const HEAP_MIB = numArg('--heap-mib', quick ? 64 : 1100);
const READS = quick ? 20 : 300;
const COMMANDS = ['ls', 'cat small.txt'];
const log = (s: string) => {
  if (!args.json) process.stderr.write(s + '\n');
};

type Variant = 'bare' | 'raw_bwrap' | 'raw_bwrap_runner' | 'fastpath' | 'fastpath_inprocess' | 'bwrap_only';
const VARIANTS: readonly Variant[] = ['bare', 'raw_bwrap', 'raw_bwrap_runner', 'fastpath', 'fastpath_inprocess', 'bwrap_only'];
const IDENTITY = { uid: 1000, gid: 1000, user: 'user', home: '/tmp' };
const etc = createSandboxEtc(IDENTITY);
const layout = probeHostLayout();
type Samples = Record<Variant, number[]>;

function makeWorkspace(): string {
  const ws = mkdtempSync(join(tmpdir(), 'hutch-bench-fastpath-'));
  writeFileSync(join(ws, 'small.txt'), 'hello from the workspace\n'.repeat(40));
  mkdirSync(join(ws, 'src'));
  for (let i = 0; i < 20; i++) writeFileSync(join(ws, 'src', `f${i}.ts`), `export const x${i} = ${i};\n`);
  return ws;
}

async function timeBare(ws: string, command: string): Promise<number> {
  const t = performance.now();
  const r = await runProcess({ argv: ['/bin/bash', '-c', command], cwd: ws, env: { PATH: '/usr/bin:/bin', LANG: 'C.UTF-8' }, onStdout: () => undefined }).result;
  if (r.exitCode !== 0) throw new Error(`bare ${command} exited ${r.exitCode}`);
  return performance.now() - t;
}

/** The fast path's bwrap command line for `command`, with or without the seccomp filter. */
function sandboxArgv(ws: string, command: string, seccomp: boolean): string[] {
  const argv = bwrapArgv({ bwrap: '/usr/bin/bwrap', workspace: ws, cwd: '/work', env: { PATH: '/usr/bin:/bin', HOME: '/tmp', LANG: 'C.UTF-8' }, etcDir: etc.dir, emptyDir: etc.emptyDir, identity: IDENTITY, layout, tmpBytes: 256 << 20, command });
  if (!seccomp) argv.splice(argv.indexOf('--seccomp'), 2);
  return argv;
}

/** bwrap spawned by this process, with no limits step and no helper; with or without the filter. */
async function timeBwrap(ws: string, command: string, seccomp: boolean): Promise<number> {
  const t = performance.now();
  const r = await runProcess({ argv: sandboxArgv(ws, command, seccomp), cwd: '/', env: { PATH: '/usr/bin:/bin' }, extraInputs: seccomp ? [seccompFilter().bpf] : undefined, killGroupOnExit: true, onStdout: () => undefined }).result;
  if (r.exitCode !== 0) throw new Error(`bwrap ${command} exited ${r.exitCode}`);
  return performance.now() - t;
}

/**
 * Plain bwrap (the same namespaces, binds and /proc masks; no filter, no limits) forked by
 * the small runner process and timed inside it: bubblewrap's own cost, whatever this
 * process's heap.
 */
async function timeRawBwrap(ws: string, command: string): Promise<number> {
  const r = await rawRunner.run({ argv: sandboxArgv(ws, command, false), cwd: '/', env: { PATH: '/usr/bin:/bin' }, killGroupOnExit: true }).result;
  if (r.exitCode !== 0) throw new Error(`raw bwrap ${command} exited ${r.exitCode}`);
  return r.durationMs;
}

async function timeFast(fp: FastPath, ws: string, command: string): Promise<number> {
  const t = performance.now();
  const r = await fp.run({ command, workspace: ws, onStdout: () => undefined });
  if (r.exitCode !== 0) throw new Error(`fast path ${command} exited ${r.exitCode}`);
  return performance.now() - t;
}

async function measure(label: string, ws: string, helper: FastPath, inproc: FastPath): Promise<Samples> {
  const s: Samples = { bare: [], raw_bwrap: [], raw_bwrap_runner: [], fastpath: [], fastpath_inprocess: [], bwrap_only: [] };
  const once = (v: Variant, c: string): Promise<number> =>
    v === 'bare' ? timeBare(ws, c)
    : v === 'raw_bwrap_runner' ? timeRawBwrap(ws, c)
    : v === 'raw_bwrap' || v === 'bwrap_only' ? timeBwrap(ws, c, v === 'bwrap_only')
    : timeFast(v === 'fastpath' ? helper : inproc, ws, c);
  // Warm-up: page cache, the helper's JIT, the cgroup slot pool.
  for (const c of COMMANDS) for (const v of VARIANTS) await once(v, c);
  for (let i = 0; i < RUNS; i++) {
    for (const c of COMMANDS) {
      // Interleaved, order rotated, so drift in machine load hits all variants alike.
      const order = VARIANTS.map((_, j) => VARIANTS[(i + j) % VARIANTS.length] as Variant);
      for (const v of order) s[v].push(await once(v, c));
    }
    if ((i + 1) % 10 === 0) log(`${label}: ${i + 1}/${RUNS}`);
  }
  return s;
}

/** Live heap of many small objects (what a broker holding sessions looks like), not one Buffer. */
function growHeap(mib: number): unknown[] {
  const keep: unknown[] = [];
  const target = mib * 1024 * 1024;
  while (process.memoryUsage().heapUsed < target) {
    const block: Array<{ id: number; name: string; tags: number[] }> = [];
    for (let i = 0; i < 100_000; i++) block.push({ id: i, name: `session-${i}`, tags: [i, i + 1] });
    keep.push(block);
  }
  return keep;
}

/** A real broker on loopback and an SDK client: what a harness sees for the cheap routes. */
async function measureThroughBroker(): Promise<{ read: number[]; exec: number[] }> {
  const dataDir = mkdtempSync(join(tmpdir(), 'hutch-bench-fp-broker-'));
  const token = randomBytes(12).toString('hex');
  const fastPath = await createFastPath(noopLogger);
  const broker = new Broker({ port: 0, token, dataDir, backend: new UnsafeLocalBackend(fastPath, noopLogger), fastPath, log: noopLogger });
  const port = await broker.start();
  const hutch = await Hutch.connect(`ws://127.0.0.1:${port}`, { token });
  const sb = await hutch.create({ workspace: { files: { 'page.txt': 'x'.repeat(4095) + '\n', 'small.txt': 'hello\n' } } });
  const read: number[] = [];
  const exec: number[] = [];
  try {
    for (let i = 0; i < 20; i++) await sb.files.read('page.txt'); // warm-up
    for (let i = 0; i < READS; i++) {
      const t0 = performance.now();
      await sb.files.read('page.txt');
      read.push(performance.now() - t0);
    }
    for (let i = 0; i < RUNS; i++) {
      const t0 = performance.now();
      const r = await sb.run('ls');
      exec.push(performance.now() - t0);
      if (r.route !== 'fastpath' || r.exitCode !== 0) throw new Error(`ls went to ${r.route} (exit ${r.exitCode})`);
    }
  } finally {
    await sb.close();
    hutch.close();
    await broker.stop();
    rmSync(dataDir, { recursive: true, force: true });
  }
  log(`through the broker: read p50 ${median(read).toFixed(2)} ms, fast-path ls p50 ${median(exec).toFixed(2)} ms`);
  return { read, exec };
}

const ws = makeWorkspace();
// The raw bwrap runner and both fast paths are started first, while this process is small:
// that is when a broker forks its helper.
const rawRunner = await HelperSpawner.start(noopLogger);
const helper = await FastPath.create({ log: noopLogger });
const inproc = await FastPath.create({ log: noopLogger, spawner: 'in-process' });
const desc = helper.describe();
let heap: unknown[] = [];
try {
  const wsNumbers = await measureThroughBroker();
  const small = await measure('small heap', ws, helper, inproc);
  log(`growing the heap to ${HEAP_MIB} MiB...`);
  heap = growHeap(HEAP_MIB);
  // Let the collector finish with the new heap first, so the second pass measures fork
  // cost with a big heap, not CPU taken by a concurrent major GC.
  setFlagsFromString('--expose-gc');
  (runInNewContext('gc') as () => void)();
  await sleep(2000);
  const heapMib = process.memoryUsage().heapUsed / 2 ** 20;
  const big = await measure('big heap', ws, helper, inproc);

  const p50 = (a: number[]) => round(median(a), 2);
  const summary = {
    ratio: round(median(small.fastpath) / median(small.bare), 2),
    ratio_big_heap: round(median(big.fastpath) / median(big.bare), 2),
    bare_p50_ms: p50(small.bare),
    bwrap_p50_ms: p50(small.fastpath),
    bare_big_heap_p50_ms: p50(big.bare),
    bwrap_big_heap_p50_ms: p50(big.fastpath),
    // How much each grew when the heap did (1.0 = not at all).
    bwrap_growth_big_heap: round(median(big.fastpath) / median(small.fastpath), 2),
    bare_growth_big_heap: round(median(big.bare) / median(small.bare), 2),
    inprocess_spawner_p50_ms: p50(small.fastpath_inprocess),
    inprocess_spawner_big_heap_p50_ms: p50(big.fastpath_inprocess),
    bwrap_only_p50_ms: p50(small.bwrap_only),
    raw_bwrap_p50_ms: p50(small.raw_bwrap),
    raw_bwrap_big_heap_p50_ms: p50(big.raw_bwrap),
    raw_bwrap_runner_p50_ms: p50(small.raw_bwrap_runner),
    raw_bwrap_runner_big_heap_p50_ms: p50(big.raw_bwrap_runner),
    // Aim <= 2 ms, and flat with the big heap.
    fastpath_over_raw_ms: round(median(small.fastpath) - median(small.raw_bwrap), 2),
    fastpath_over_raw_strict_ms: round(median(small.fastpath) - median(small.raw_bwrap_runner), 2),
    fastpath_over_raw_big_heap_ms: round(median(big.fastpath) - median(big.raw_bwrap_runner), 2),
    bwrap_only_big_heap_p50_ms: p50(big.bwrap_only),
    bwrap_p99_ms: round(percentile(small.fastpath, 99), 2),
    bare_p99_ms: round(percentile(small.bare, 99), 2),
    heap_mib: round(heapMib, 0),
    runs: RUNS,
    commands: COMMANDS,
    limit_mechanism: desc.limits.mechanism,
    process_limit_enforced: desc.limits.processLimitEnforced,
    spawner: desc.spawner.kind,
    // Through a real broker and WebSocket client: a 4 KiB read served in process, and `ls`
    // routed to the fast path (both round trips, client-observed).
    inprocess_read_p50_ms: p50(wsNumbers.read),
    ws_exec_p50_ms: p50(wsNumbers.exec),
  };
  const names: Record<Variant, string> = {
    bare: 'bare bash -c',
    raw_bwrap: 'raw bwrap (same namespaces and binds, no seccomp, in-process)',
    raw_bwrap_runner: 'raw bwrap, forked and timed by a small process',
    fastpath: 'fast path (helper spawner, default)',
    fastpath_inprocess: 'fast path (in-process spawner)',
    bwrap_only: 'bwrap + seccomp only (no limits, in-process)',
  };
  const rows = VARIANTS.map((v) => ({
    variant: names[v],
    p50_ms: p50(small[v]),
    p50_big_heap_ms: p50(big[v]),
    ratio_vs_bare: round(median(small[v]) / median(small.bare), 2),
    ratio_vs_bare_big_heap: round(median(big[v]) / median(big.bare), 2),
  }));
  emit(
    `fastpath: bwrap + seccomp vs bare (${COMMANDS.join(', ')}; ${RUNS} runs each; heap ${round(heapMib, 0)} MiB in the second pass; limits: ${desc.limits.mechanism})`,
    markdownTable(rows),
    summary,
    { small, big },
  );
} finally {
  heap = [];
  void heap;
  await helper.close();
  await inproc.close();
  await rawRunner.close();
  etc.remove();
  rmSync(ws, { recursive: true, force: true });
}
