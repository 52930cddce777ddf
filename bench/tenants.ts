/**
 * Density: how many tenants one host carries at interactive latency, per level.
 *
 *   npx tsx bench/tenants.ts [--quick] [--json] [--level 4[,3:8,1:2,...]] [--tenants N]
 *       [--start-tenants N] [--max-tenants N] [--duration S] [--time-compression F]
 *       [--budget-min M] [--seed S] [--sessions DIR] [--projects DIR] [--bare-reps K] [--out DIR]
 *
 * The published method (../shared/design.md, "Benchmarks"): N tenants each alternate
 * between away (log-normal, mean 2 min) and a task (a random recorded session replayed
 * through the SDK with its think times, in a fresh sandbox made from its project). Added
 * latency per call = client-observed time minus the same call's bare host time, from bare
 * replays done first in the same run. Pass at N: p99 added < 1.5 s, no errors, no OOM.
 * The search doubles N until a step fails, then bisects; each step is a fresh real broker
 * (qemu backend) with real WebSocket clients, bounded by a fixed wall duration.
 *
 * Levels (host-broker/src/policy/sandbox-policy.ts): 1 a booted VM per tenant, 2 idle
 * kill + cold boot, 3 snapshot restore without routing, 4 routing (default), reclaim,
 * prefetch. "4,3:8" runs level 4 and then level 3 capped at 8 tenants.
 */
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { hostname, tmpdir, availableParallelism, totalmem } from 'node:os';
import { join, relative, resolve } from 'node:path';
import { parseArgs } from 'node:util';
import { policyForLevel } from '../host-broker/src/policy/sandbox-policy.ts';
import { emit, round } from './lib/report.ts';
import { benchCorpus, loadSessions, prepareWorkspace, EXAMPLE_PROJECTS, EXAMPLE_SESSIONS, PROJECTS_DIR, SESSIONS_DIR } from './lib/sessions.ts';
import { measureBare } from './lib/tenants-bare.ts';
import { headline, mergeResults, summaryTable, stepsTable, writeResults, type Results, type RunInfo } from './lib/tenants-output.ts';
import { searchLevel, type LevelResult } from './lib/tenants-search.ts';
import { runStep } from './lib/tenants-step.ts';
import { seededRng, streamSeed } from './lib/tenants-rng.ts';
import { AWAY_MEAN_S, AWAY_SIGMA, type CallSample } from './lib/tenants-tenant.ts';

const HELP = `usage: npx tsx bench/tenants.ts [options]
  --quick               one step of one tenant, 20 s, time compressed 60x, two sessions of the repo's own
                        corpus unless --sessions is given: checks the bench runs to its JSON line, no search
  --json                last line: one JSON object (accel, level, tenants, calls, wakes, errors, ...)
  --level L[:MAX],...   levels to run: 1 2 3 4 reclaim prefetch (default 4); :MAX caps N for that level
  --tenants N           run one step at N instead of searching
  --start-tenants N     first N of the search (default 1)
  --max-tenants N       cap on N (default 1 quick, 64 full)
  --duration S          wall seconds per step (default 20 quick, 300 full)
  --time-compression F  think and away times divided by F (default 60 quick, 1 full)
  --rule R              pass rule that drives the search: broker (default; p99 of the broker's own added
                        time < 1.5 s, which a TCG host can judge) or published (p99 added over bare host
                        < 1.5 s); the largest passing N under both is reported either way
  --budget-min M        wall-clock budget of the whole search, all levels (default 3 quick, 60 full)
  --seed S              workload seed (default 1)
  --sessions DIR        recorded sessions (default ${SESSIONS_DIR} when it exists;
                        the repo's own small corpus is ${EXAMPLE_SESSIONS})
  --projects DIR        projects looked up here first, then in ${PROJECTS_DIR} (when it exists)
                        and ${EXAMPLE_PROJECTS}
  --session-count K     replay a seeded subset of K sessions (default 2 quick, all full)
  --bare-reps K         bare replays per session for the baseline, median per call (default 1 quick, 3 full)
  --render              only re-render tenants.md and tenants.svg from the tenants.json in --out (no run)
  --out DIR             write tenants.{json,md,svg,raw.json} here, merged by level (default bench/results unless --quick)
`;

const { values: a } = parseArgs({
  options: {
    quick: { type: 'boolean', default: false },
    json: { type: 'boolean', default: false },
    level: { type: 'string', default: '4' },
    tenants: { type: 'string' },
    'start-tenants': { type: 'string' },
    'max-tenants': { type: 'string' },
    duration: { type: 'string' },
    'time-compression': { type: 'string' },
    'budget-min': { type: 'string' },
    rule: { type: 'string', default: 'broker' },
    seed: { type: 'string', default: '1' },
    sessions: { type: 'string' },
    projects: { type: 'string' },
    'bare-reps': { type: 'string' },
    'session-count': { type: 'string' },
    out: { type: 'string' },
    render: { type: 'boolean', default: false },
    help: { type: 'boolean', short: 'h', default: false },
  },
});
if (a.help) {
  process.stdout.write(HELP);
  process.exit(0);
}

function num(name: string, v: string | undefined, dflt: number, min: number): number {
  if (v === undefined) return dflt;
  const n = Number(v);
  if (!Number.isFinite(n) || n < min) {
    process.stderr.write(`tenants: --${name} must be a number >= ${min}, got ${JSON.stringify(v)}\n`);
    process.exit(2);
  }
  return n;
}

const quick = a.quick;
const single = a.tenants !== undefined ? Math.floor(num('tenants', a.tenants, 1, 1)) : undefined;
const maxTenants = Math.floor(num('max-tenants', a['max-tenants'], single ?? (quick ? 1 : 64), 1));
const startTenants = Math.floor(num('start-tenants', a['start-tenants'], single ?? 1, 1));
const durationS = num('duration', a.duration, quick ? 20 : 300, 5);
const compression = num('time-compression', a['time-compression'], quick ? 60 : 1, 1);
const budgetMin = num('budget-min', a['budget-min'], quick ? 3 : 60, 1);
const seed = Math.floor(num('seed', a.seed, 1, 0));
const bareReps = Math.floor(num('bare-reps', a['bare-reps'], quick ? 1 : 3, 1));
const sessionCount = a['session-count'] !== undefined ? Math.floor(num('session-count', a['session-count'], 1, 1)) : quick ? 2 : Infinity;
let corpus;
try {
  corpus = benchCorpus({ sessions: a.sessions ?? (quick ? EXAMPLE_SESSIONS : undefined), projects: a.projects });
} catch (err) {
  process.stderr.write(`tenants: ${(err as Error).message}\n`);
  process.exit(2);
}
const sessionsDir = corpus.sessions;
const projectDirs = corpus.projects;
if (a.rule !== 'broker' && a.rule !== 'published') {
  process.stderr.write(`tenants: --rule must be broker or published, got ${JSON.stringify(a.rule)}\n`);
  process.exit(2);
}
const rule: 'broker' | 'published' = a.rule;
const outDir = a.out ? resolve(a.out) : quick ? undefined : resolve(import.meta.dirname, 'results');
const levels = a.level.split(',').map((spec) => {
  const [name = '', cap] = spec.trim().split(':');
  try {
    return { name, policy: policyForLevel(name), max: cap === undefined ? maxTenants : Math.floor(num(`level ${name} cap`, cap, maxTenants, 1)) };
  } catch (err) {
    process.stderr.write(`tenants: --level: ${(err as Error).message}\n`);
    process.exit(2);
  }
});

if (a.render) {
  const dir = outDir ?? resolve(import.meta.dirname, 'results');
  writeResults(dir, JSON.parse(readFileSync(join(dir, 'tenants.json'), 'utf8')) as Results);
  process.stderr.write(`tenants: re-rendered ${dir}/tenants.md and tenants.svg\n`);
  process.exit(0);
}

const progress = (m: string) => process.stderr.write(`[tenants ${new Date().toISOString().slice(11, 19)}] ${m}\n`);
const startedIso = new Date().toISOString();
const t0 = performance.now();
const budgetEnd = t0 + budgetMin * 60_000;
const runDir = mkdtempSync(join(tmpdir(), 'hutch-bench-tenants-'));

function runInfo(accel: string, sessions: number, sessionsTotal: number, excluded: RunInfo['excluded_sessions']): RunInfo {
  return {
    accel,
    host: `${hostname()}: ${availableParallelism()} cores, ${Math.round(totalmem() / 2 ** 30)} GiB`,
    started: startedIso,
    command: `npx tsx bench/tenants.ts ${process.argv.slice(2).join(' ')}`.trim(),
    time_compression: compression,
    step_duration_s: durationS,
    seed,
    sessions,
    sessions_total: sessionsTotal,
    sessions_dir: relative(process.cwd(), sessionsDir) || sessionsDir,
    bare_reps: bareReps,
    excluded_sessions: excluded,
    memory_note: 'peak host MiB = peak of (MemTotal - MemAvailable) above the pre-step baseline, sampled every second, host-wide (other work on a shared host counts too); QEMU PSS = summed PSS of this run\'s QEMU processes (ours only)',
    cpu_note: 'CPU % = CPU time of the bench process tree (broker, clients, QEMU, fast path; QEMU counted when reaped at broker stop) over wall time x all cores; host % = all busy time on the host over the step',
    notes: [
      `away time: log-normal, mean ${AWAY_MEAN_S} s, sigma ${AWAY_SIGMA} (underlying normal); a tenant's first away is a uniform fraction of one, so tenants start spread out`,
      'a task opens a new sandbox from its project (made at the start of the away time, outside any call); level 1 boots its VM during the away time',
      `time compression divides think and away times only; the broker's own windows (5 s idle release) are not compressed`,
      'added latency = client-observed call time - the same call\'s bare host time; "broker-added" = the broker\'s own total minus the command\'s run time where it ran (so it leaves out how much slower a command runs inside the guest)',
      'each step starts with an unmeasured warm-up VM call (builds the pristine snapshot if the guest image changed, checks the level is applied)',
    ],
  };
}

/** Memory per tenant at the level's largest step that passed the search's rule (else its smallest step). */
function idleMemory(r: LevelResult): { host_mib_per_tenant: number | null; qemu_pss_mib_per_live_vm: number | null; memory_at_tenants: number | null } {
  const ok = (st: LevelResult['steps'][number]) => (rule === 'broker' ? st.pass_broker_rule : st.pass);
  const passing = r.steps.filter(ok).sort((x, y) => y.tenants - x.tenants);
  const st = passing[0] ?? [...r.steps].sort((x, y) => x.tenants - y.tenants)[0];
  if (!st) return { host_mib_per_tenant: null, qemu_pss_mib_per_live_vm: null, memory_at_tenants: null };
  return { host_mib_per_tenant: st.host_mib_per_tenant ?? null, qemu_pss_mib_per_live_vm: st.qemu_pss_mib_per_live_vm ?? null, memory_at_tenants: st.tenants };
}

/** Tenants at level a over level b (null when either did not run or b carried none). */
function ratioOf(results: LevelResult[], a: string, b: string, pick: (r: LevelResult) => number): number | null {
  const x = results.find((r) => r.level === a);
  const y = results.find((r) => r.level === b);
  if (!x || !y || pick(y) === 0) return null;
  return round(pick(x) / pick(y), 2);
}

try {
  const loaded = loadSessions(sessionsDir);
  if (loaded.length === 0) throw new Error(`no sessions (*.jsonl) in ${sessionsDir}`);
  // A quick run's bare baseline is most of its fixed cost; a seeded subset keeps it short.
  const order = seededRng(streamSeed(seed, 'sessions'));
  const all = [...loaded].map((s) => ({ s, k: order() })).sort((x, y) => x.k - y.k).slice(0, sessionCount).map((x) => x.s);
  const templates = new Map<string, string>();
  for (const project of new Set(all.map((s) => s.project))) {
    const dir = join(runDir, 'templates', project);
    prepareWorkspace(project, dir, projectDirs);
    templates.set(project, dir);
  }
  progress(`bare baseline: ${all.length} sessions x ${bareReps}`);
  const bare = await measureBare(all, projectDirs, join(runDir, 'bare'), bareReps, progress);
  const pool = all.filter((s) => bare.ms.has(s.id));
  if (pool.length === 0) throw new Error(`every session's bare replay failed; first: ${bare.excluded[0]?.reason}`);
  progress(`bare baseline done in ${(bare.totalMs / 1000).toFixed(1)} s; ${pool.length} sessions in the pool; time compression ${compression}; ${durationS} s per step`);

  const raw: Record<string, Array<Record<string, unknown>>> = {};
  const keep = (level: string, n: number, samples: CallSample[]) => {
    raw[`${level}@${n}`] = samples.map((s) => ({ t: s.tenant, s: s.session, i: s.index, tool: s.tool, r: s.route, w: s.woke ? 1 : 0, ok: s.ok ? 1 : 0, ms: round(s.ms, 1), bare: round(s.bareMs, 1), added: round(s.addedMs, 1), broker: s.brokerAddedMs, at: round(s.at, 1), ...(s.error ? { e: s.error } : {}) }));
  };
  const results: LevelResult[] = [];
  const save = (levels: LevelResult[]) => {
    if (!outDir) return;
    const accel = levels.flatMap((r) => r.steps.map((s) => s.accel))[0] ?? 'unknown';
    writeResults(outDir, mergeResults(outDir, startedIso, runInfo(accel, pool.length, loaded.length, bare.excluded), levels), { run: startedIso, bare_ms: Object.fromEntries(bare.ms), calls: raw });
  };
  for (const lv of levels) {
    progress(`level ${lv.name}: ${JSON.stringify(lv.policy)}; N from ${startTenants} up to ${lv.max}`);
    const r = await searchLevel(
      {
        level: lv.name,
        start: startTenants,
        max: single ?? lv.max,
        budgetEnd,
        stepEstimateMs: durationS * 1000 + 60_000,
        resolution: 0.125,
        rule,
        progress,
        run: (tenants) =>
          runStep({ level: lv.name, policy: lv.policy, tenants, durationMs: durationS * 1000, compression, seed, sessions: pool, templates, bare: bare.ms, workDir: runDir, progress }),
      },
      (partial, n, samples) => {
        keep(lv.name, n, samples);
        save([...results, partial]);
      },
    );
    progress(`level ${lv.name}: ${r.unavailable ? `unavailable: ${r.unavailable}` : `max tenants ${r.max_tenants} (published rule), ${r.max_tenants_broker_rule ?? 0} (broker-added rule); ${r.stopped}`}`);
    results.push(r);
    save(results);
  }
  if (outDir) progress(`results written to ${outDir}/tenants.{json,md,svg,raw.json}`);

  const accel = results.flatMap((r) => r.steps.map((s) => s.accel))[0] ?? 'unknown';

  const first = results[0] as LevelResult;
  const h = headline(first);
  const allSteps = results.flatMap((r) => r.steps);
  const summary = {
    accel,
    level: first.level,
    tenants: first.max_tenants,
    calls: h?.calls ?? 0,
    wakes: h?.wakes ?? 0,
    errors: h?.errors ?? 0,
    p50_added_ms: h?.p50_added_ms ?? null,
    p99_added_ms: h?.p99_added_ms ?? null,
    peak_host_mib: h?.peak_host_mib ?? null,
    time_compression: compression,
    at_tenants: h?.tenants ?? null,
    p99_broker_added_ms: h?.p99_broker_added_ms ?? null,
    peak_qemu_pss_mib: h?.peak_qemu_pss_mib ?? null,
    cpu_pct: h?.cpu_tree_pct ?? null,
    peak_host_mib_is: 'MemTotal-MemAvailable above the pre-step baseline, host-wide',
    steps: allSteps.map((s) => `${s.level}@${s.tenants}:${s.pass ? 'pass' : 'fail'}`),
    calls_total: allSteps.reduce((x, s) => x + s.calls, 0),
    errors_total: allSteps.reduce((x, s) => x + s.errors, 0),
    step_duration_s: durationS,
    ...(first.unavailable ? { unavailable: first.unavailable } : {}),
    rule,
    max_tenants_broker_rule: first.max_tenants_broker_rule ?? 0,
    levels: results.map((r) => ({
      level: r.level,
      max_tenants: r.max_tenants,
      max_tenants_broker_rule: r.max_tenants_broker_rule ?? 0,
      ...idleMemory(r),
      ...(r.unavailable ? { unavailable: r.unavailable } : {}),
    })),
    level4_over_level1: ratioOf(results, '4', '1', (r) => r.max_tenants_broker_rule ?? 0),
    level4_over_level1_published: ratioOf(results, '4', '1', (r) => r.max_tenants),
    search_wall_min: round((performance.now() - t0) / 60_000, 1),
    wall_s: round((performance.now() - t0) / 1000, 0),
  };
  emit(
    `tenants: density per level (${accel}; time compression ${compression}; ${durationS} s per step)`,
    `${summaryTable(results)}\n\n${stepsTable(results)}\n\n${results.map((r) => `level ${r.level}: ${r.unavailable ? `unavailable: ${r.unavailable}` : r.stopped}`).join('\n')}`,
    summary,
    a.json ? undefined : { steps: allSteps },
  );
} finally {
  rmSync(runDir, { recursive: true, force: true });
}
process.exit(0);
