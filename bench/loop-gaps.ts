/**
 * What a tenant's wide directory costs the broker's event loop (every session's calls wait
 * while it is held): one directory of N empty files (default 100,000; the entry quota allows
 * 200,000), walked the ways the broker walks a host workspace.
 *   worst_gap_ms   per walker, the longest the loop went without a turn (median of rounds):
 *                  scan (the push's manifest scan), diff (the push's diff of that scan against
 *                  an empty guest: a fresh VM), measure (the quota), list, glob
 *   total_ms       per walker, how long the whole walk took (median)
 *   baseline_worst_gap_ms  the same directory through the previous ways: one readdir of the
 *                  whole directory (`readdir`), and the scan's walk without yielding between
 *                  entries (`unsliced_scan`)
 *   deep_chain_depth  a second tree: one chain of nested one-letter directories, as deep as
 *                  a path can name (4,000-byte paths). Its walkers: deep_scan (the push's scan),
 *                  deep_diff (a diff that removes the chain), deep_remove (the guest view after
 *                  a pull that deleted its top); baselines deep_diff_per_key_walk and
 *                  deep_remove_per_key_walk, the previous code (every ancestor of every key
 *                  sliced and looked up: cubic in the depth)
 *   Routing a tenant's call: route (the router on the worst of a set of 64 KiB commands, each
 *                  past the syntax budget), git_config (the git check on a repository whose
 *                  .git/config is 64 MiB), git_index (the same check where the index is the
 *                  largest it reads for submodules, 32 MiB of entries); baselines route_unbounded_parse (tree-sitter parsing those
 *                  commands to the end, the least an unbounded router pays) and git_config_read
 *                  (reading and scanning that config whole, the previous code)
 *   Decoding a tenant's request: frames (four 16 MiB WebSocket frames as the broker takes
 *                  them, shape checked then decoded: nested `[[[...]]]`, 16 million empty
 *                  msgpack maps, all whitespace, a string of escaped quotes); baseline
 *                  frames_unchecked (the same decoded straight away, the previous code)
 * Raw per-round numbers are kept in the raw line.
 */
import { closeSync, mkdirSync, mkdtempSync, openSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { promises as fsp } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { Workspace } from '../guest-agent/src/workspace/confine.ts';
import { FileTools } from '../guest-agent/src/workspace/file-tools.ts';
import { walk } from '../guest-agent/src/workspace/walk.ts';
import { lstatAt } from '../guest-agent/src/workspace/fd-path.ts';
import { diffManifests, scanTree, type Manifest } from '../host-broker/src/sync/manifest.ts';
import { removeWithChildren } from '../host-broker/src/sync/workspace-mirror.ts';
import { execFileSync } from 'node:child_process';
import { measureWorkspace } from '../host-broker/src/sessions/workspace-quota.ts';
import { createRequire } from 'node:module';
import { Language, Parser } from 'web-tree-sitter';
import { gitConfigHazard, MAX_INDEX_BYTES, programKey } from '../host-broker/src/router/git-config.ts';
import { initRouter, MAX_ROUTED_LENGTH, routeCall } from '../host-broker/src/router/index.ts';
import { Packr } from 'msgpackr';
import { checkMsgpackShape, parseJsonBounded } from '../guest-agent/src/protocol/value-shape.ts';
import { benchArgs, emit, markdownTable, median, round } from './lib/report.ts';
import { watchLoop } from './lib/loop-watch.ts';

const args = benchArgs();
/**
 * --quick: seconds, to check the bench still runs to its JSON line (test/benches.test.ts):
 * every walker and baseline on small inputs (a short chain, 1 MiB frames, a 1 MiB config),
 * so its numbers say nothing about the loop.
 */
const quick = args.argv.includes('--quick');
const N = quick ? 2_000 : 100_000;
const ROUNDS = quick ? 1 : 3;

const root = mkdtempSync(join(tmpdir(), 'hutch-bench-gaps-'));
process.on('exit', () => rmSync(root, { recursive: true, force: true }));
const wide = join(root, 'wide');
mkdirSync(wide);
process.stderr.write(`making ${N} files in one directory...\n`);
for (let i = 0; i < N; i++) closeSync(openSync(join(wide, `f${((i * 7919) % N).toString(36)}`), 'w'));

/** Runs `fn` while a 1 ms interval watches the loop: its worst gap and the run's time. */
async function watched(fn: () => Promise<unknown>): Promise<{ gap: number; ms: number }> {
  await new Promise((r) => setTimeout(r, 50));
  const watch = watchLoop();
  const t0 = performance.now();
  await fn();
  const ms = performance.now() - t0;
  return { gap: await watch.stop(), ms };
}

// One chain of one-letter directories, made with relative names as a tenant would: level k
// is 2k - 1 bytes, so 2,000 levels stay inside a 4,096-byte path.
const DEPTH = quick ? 100 : 2000;
const deepRoot = mkdtempSync(join(tmpdir(), 'hutch-bench-deep-'));
process.on('exit', () => execFileSync('rm', ['-rf', '--', deepRoot]));
execFileSync('python3', ['-c', `import os\nos.chdir(${JSON.stringify(deepRoot)})\nfor _ in range(${DEPTH}):\n    os.mkdir('d'); os.chdir('d')`]);
const deepScanned = await scanTree(deepRoot);
if (deepScanned.size !== DEPTH) throw new Error(`the deep chain scanned as ${deepScanned.size} entries, not ${DEPTH}`);

/** The previous code's per-key walk: every ancestor sliced and looked up. */
function perKeyAncestor(key: string, test: (a: string) => boolean): boolean {
  for (let i = key.lastIndexOf('/'); i > 0; i = key.lastIndexOf('/', i - 1)) if (test(key.slice(0, i))) return true;
  return false;
}

// Commands a tenant may send (each just under the length limit) whose syntax is far past
// the router's budget, and a repository with a configuration far past what the check reads.
const fill = (head: string, unit: string, tail = '') => head + unit.repeat(Math.floor((MAX_ROUTED_LENGTH - head.length - tail.length - 1) / unit.length)) + tail;
const heavyCommands = [
  fill('ls ', 'a '),
  fill('echo ', '"a"'),
  fill('cat a', ' | cat a'),
  fill('cat > f.sh <<EOF\n', 'echo $x and $y\n', 'EOF'),
  fill('', '('),
];
// WebSocket frames a tenant may send (16 MiB; the limit is 64): what decoding them costs.
const FRAME = (quick ? 1 : 16) * 1024 * 1024;
const emptyMaps = Buffer.alloc(5 + FRAME, 0x80);
emptyMaps[0] = 0xdd;
emptyMaps.writeUInt32BE(FRAME, 1);
const heavyFrames: Array<{ bin: boolean; data: Buffer }> = [
  { bin: false, data: Buffer.from('['.repeat(FRAME / 2) + ']'.repeat(FRAME / 2)) },
  { bin: true, data: emptyMaps },
  { bin: false, data: Buffer.from('{"a":' + ' '.repeat(FRAME) + '1}') },
  { bin: false, data: Buffer.from(JSON.stringify({ c: '"'.repeat(FRAME / 2) })) },
];
const framePackr = new Packr({ useRecords: false });
async function decodeFrames(checked: boolean): Promise<void> {
  for (const f of heavyFrames) {
    try {
      if (f.bin) {
        if (checked) checkMsgpackShape(f.data);
        framePackr.unpack(f.data);
      } else {
        const text = f.data.toString('utf8');
        if (checked) parseJsonBounded(text);
        else JSON.parse(text);
      }
    } catch {
      // refused: what the broker answers with a typed error
    }
    await new Promise((r) => setImmediate(r)); // frames arrive one by one
  }
}
await initRouter();
const rawParser = new Parser();
rawParser.setLanguage(await Language.load(createRequire(import.meta.url).resolve('tree-sitter-bash/tree-sitter-bash.wasm')));
const gitRoot = mkdtempSync(join(tmpdir(), 'hutch-bench-git-'));
process.on('exit', () => rmSync(gitRoot, { recursive: true, force: true }));
mkdirSync(join(gitRoot, '.git'));
writeFileSync(join(gitRoot, '.git', 'config'), '[core]\n\tbare = false\n'.repeat(quick ? 50_000 : 3_000_000));
// A repository whose index is as large as the git check reads (version 2, SHA-1 entries of 72 bytes).
const indexRoot = mkdtempSync(join(tmpdir(), 'hutch-bench-index-'));
process.on('exit', () => rmSync(indexRoot, { recursive: true, force: true }));
mkdirSync(join(indexRoot, '.git'));
{
  const entries = Math.floor((MAX_INDEX_BYTES - 32) / 72);
  const index = Buffer.alloc(12 + entries * 72 + 20);
  index.write('DIRC', 0, 'latin1');
  index.writeUInt32BE(2, 4);
  index.writeUInt32BE(entries, 8);
  for (let i = 0; i < entries; i++) {
    const at = 12 + i * 72;
    index.writeUInt32BE(0o100644, at + 24);
    index.writeUInt16BE(8, at + 60);
    index.write(`f${String(i).padStart(7, '0')}`, at + 62, 'latin1');
  }
  writeFileSync(join(indexRoot, '.git', 'index'), index);
}

const tools = new FileTools(new Workspace(root));
const scanned = await scanTree(root);
const walkers: Record<string, () => Promise<unknown>> = {
  scan: () => scanTree(root),
  diff: () => diffManifests(scanned, new Map()),
  measure: () => measureWorkspace(root),
  list: () => tools.list({ path: 'wide' }),
  glob: () => tools.glob({ pattern: '**/f1*' }),
  deep_scan: () => scanTree(deepRoot),
  deep_diff: () => diffManifests(new Map(), deepScanned),
  deep_remove: () => removeWithChildren(new Map(deepScanned), new Set(['d'])),
  route: async () => {
    for (const command of heavyCommands) {
      await routeCall({ command });
      await new Promise((r) => setImmediate(r)); // calls arrive one by one, not in one turn
    }
  },
  git_config: () => gitConfigHazard(gitRoot, { dirs: [''] }),
  git_index: () => gitConfigHazard(indexRoot, { dirs: [''] }),
  frames: () => decodeFrames(true),
};
const baselines: Record<string, () => Promise<unknown>> = {
  readdir: () => fsp.readdir(wide, { withFileTypes: true, encoding: 'buffer' }),
  unsliced_scan: async () => {
    for await (const e of walk(root)) lstatAt(e.dirFd, e.name);
  },
  deep_diff_per_key_walk: async () => {
    const from: Manifest = new Map();
    const remove: string[] = [];
    for (const p of deepScanned.keys()) if (!from.has(p) && !perKeyAncestor(p, (a) => deepScanned.has(a) && !from.has(a))) remove.push(p);
    return remove;
  },
  deep_remove_per_key_walk: async () => {
    const view = new Map(deepScanned);
    const gone = new Set(['d']);
    for (const k of [...view.keys()]) if (gone.has(k) || perKeyAncestor(k, (a) => gone.has(a))) view.delete(k);
  },
  route_unbounded_parse: async () => {
    for (const command of heavyCommands) {
      rawParser.parse(command)?.delete();
      await new Promise((r) => setImmediate(r));
    }
  },
  git_config_read: async () => programKey(readFileSync(join(gitRoot, '.git', 'config'), 'utf8')),
  frames_unchecked: () => decodeFrames(false),
};

const raw: Record<string, Array<{ gap: number; ms: number }>> = {};
for (let r = 0; r < ROUNDS; r++) {
  for (const [name, fn] of [...Object.entries(walkers), ...Object.entries(baselines)]) {
    const m = await watched(fn);
    (raw[name] ??= []).push({ gap: round(m.gap, 1), ms: round(m.ms, 1) });
  }
}
const gapOf = (k: string) => round(median((raw[k] ?? []).map((x) => x.gap)), 1);
const msOf = (k: string) => round(median((raw[k] ?? []).map((x) => x.ms)), 1);
const worst = Object.fromEntries(Object.keys(walkers).map((k) => [k, gapOf(k)]));
const total = Object.fromEntries(Object.keys(walkers).map((k) => [k, msOf(k)]));
const baseline = Object.fromEntries(Object.keys(baselines).map((k) => [k, gapOf(k)]));
const rows = [...Object.keys(walkers), ...Object.keys(baselines)].map((k) => ({ walker: k, baseline: k in baselines, worst_gap_ms: gapOf(k), total_ms: msOf(k) }));
emit(`Broker event loop on a directory of ${N} entries`, markdownTable(rows), { entries: N, deep_chain_depth: DEPTH, worst_gap_ms: worst, total_ms: total, baseline_worst_gap_ms: baseline, rounds: ROUNDS }, args.json ? raw : undefined);
