/**
 * Router cost and reach.
 *   init_ms                    initRouter(): wasm runtime + bash grammar + host binary probe
 *   parse_p50_us / p99_us      the shell parser alone (tree-sitter parse + adapter), per command
 *   route_p50_us / p99_us      a full routeCommand() decision, per command
 *   spawn_p50_us               baseline in the same run: spawning `true`, the floor of any fast-path call
 *   route_vs_spawn             route_p50 / spawn_p50
 *   fastpath_share_bash_calls  bash calls of the recorded sessions routed to the fast path
 *   fastpath_share_all_calls   the same over all calls (file tools always run in-process)
 * The corpus is every bash command of the recorded sessions (`--sessions DIR`, default the
 * benchmark corpus beside the checkout; see lib/sessions.ts) plus a set of typical agent
 * commands; each is routed `--rounds` times (default 200) after a warm-up.
 * `npx tsx bench/router.ts [--json] [--quick] [--rounds N] [--sessions DIR]`
 */
import { spawnSync } from 'node:child_process';
import { readdirSync, readFileSync } from 'node:fs';
import { performance } from 'node:perf_hooks';
import { initRouter, routeCommand } from '../host-broker/src/router/index.ts';
import { parseScript } from '../host-broker/src/router/parser.ts';
import { benchArgs, emit, markdownTable, median, percentile, round } from './lib/report.ts';
import { benchCorpus, EXAMPLE_SESSIONS } from './lib/sessions.ts';

const args = benchArgs();
/** --quick: seconds, on the repo's own corpus unless --sessions says otherwise (test/benches.test.ts). */
const quick = args.argv.includes('--quick');
const roundsArg = args.argv.indexOf('--rounds');
const rounds = roundsArg >= 0 ? Number(args.argv[roundsArg + 1]) : quick ? 5 : 200;
const sessionsArg = args.argv.indexOf('--sessions');
let sessionsDir: string;
try {
  const given = sessionsArg >= 0 ? args.argv[sessionsArg + 1] : quick ? EXAMPLE_SESSIONS : undefined;
  sessionsDir = `${benchCorpus({ sessions: given }).sessions}/`;
} catch (err) {
  process.stderr.write(`router: ${(err as Error).message}\n`);
  process.exit(2);
}

interface Call {
  tool: string;
  args: { command?: string };
}

function loadCalls(): Call[] {
  const calls: Call[] = [];
  for (const f of readdirSync(sessionsDir).filter((n) => n.endsWith('.jsonl')).sort()) {
    const lines = readFileSync(sessionsDir + f, 'utf8').split('\n').filter(Boolean);
    for (const line of lines.slice(1)) calls.push(JSON.parse(line) as Call);
  }
  return calls;
}

const TYPICAL = [
  'ls -la',
  'cat src/index.js',
  'grep -rn "TODO" --include=*.py . | head -20',
  "find . -name '*.test.js' -not -path './node_modules/*'",
  "sed -n '1,80p' logtally/cli.py",
  'git log --oneline -n 10 -- src/',
  'wc -l $(git ls-files)',
  'cat <<EOF > notes.md\n# Notes\nsome text with $HOME\nEOF',
  'python3 -m unittest discover -s tests -v 2>&1 | tail -n 20',
  'cd src && ls -1 | sort | uniq -c',
];

const t0 = performance.now();
await initRouter();
const initMs = performance.now() - t0;

const calls = loadCalls();
const bash = calls.filter((c) => c.tool === 'bash' && typeof c.args.command === 'string').map((c) => c.args.command as string);
const corpus = [...bash, ...TYPICAL];

function timeEach(fn: (cmd: string) => void): number[] {
  for (const c of corpus) fn(c); // warm-up: JIT and wasm tiering
  const samples: number[] = [];
  for (let r = 0; r < rounds; r++) {
    for (const c of corpus) {
      const s = performance.now();
      fn(c);
      samples.push((performance.now() - s) * 1000);
    }
  }
  return samples;
}

const parseUs = timeEach((c) => void parseScript(c));
const routeUs = timeEach((c) => void routeCommand(c));

const spawnUs: number[] = [];
for (let i = 0; i < 50; i++) {
  const s = performance.now();
  spawnSync('true');
  spawnUs.push((performance.now() - s) * 1000);
}

const fast = bash.filter((c) => routeCommand(c).route === 'fastpath').length;
const nonBash = calls.length - bash.length;

const summary = {
  route_vs_spawn: round(median(routeUs) / median(spawnUs), 4),
  parse_p50_us: round(median(parseUs), 1),
  parse_p99_us: round(percentile(parseUs, 99), 1),
  route_p50_us: round(median(routeUs), 1),
  route_p99_us: round(percentile(routeUs, 99), 1),
  spawn_p50_us: round(median(spawnUs), 1),
  init_ms: round(initMs, 1),
  fastpath_share_bash_calls: round(fast / bash.length, 4),
  fastpath_share_all_calls: round((fast + nonBash) / calls.length, 4),
  fastpath_bash_calls: fast,
  bash_calls: bash.length,
  calls: calls.length,
  corpus_commands: corpus.length,
  rounds,
};

const table = markdownTable([
  { what: 'routeCommand (parse + classify)', p50_us: summary.route_p50_us, p99_us: summary.route_p99_us, vs_spawn: summary.route_vs_spawn },
  { what: 'parse only', p50_us: summary.parse_p50_us, p99_us: summary.parse_p99_us, vs_spawn: round(median(parseUs) / median(spawnUs), 4) },
  { what: 'baseline: spawnSync(true)', p50_us: summary.spawn_p50_us, p99_us: round(percentile(spawnUs, 99), 1), vs_spawn: 1 },
]);
const reach = markdownTable([
  { calls: summary.calls, bash: summary.bash_calls, bash_on_fastpath: fast, share_bash: summary.fastpath_share_bash_calls, share_all: summary.fastpath_share_all_calls, init_ms: summary.init_ms },
]);
emit('router', `${table}\n\n${reach}`, summary, args.json ? { spawn_us: spawnUs.map((v) => round(v, 1)) } : undefined);
