/**
 * The main job, end to end on the embedded defaults: a real broker (qemu backend, level 4
 * policy) and real sandboxes driven through the SDK over WebSocket, the way a harness
 * drives them. Three agents work at once on copies of the example workspaces in
 * examples/projects (`invoicer`, Python; `slugkit`, Node; each ships with a failing test):
 *
 *   - file tools run in the broker on the host workspace ("inprocess"),
 *   - read-only shell runs in the bubblewrap fast path ("fastpath"),
 *   - the test suite runs in a microVM restored from the pristine snapshot ("vm"),
 *   - an idle VM is released; one that changed ~/.gitconfig is snapshotted into a slot and
 *     its next call restores it; live telemetry and /metrics at the end.
 *
 *   ./hutch demo [--sandboxes N] [--keep]    (or npx tsx examples/demo.ts ...)
 */
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { Sandbox } from 'hutch';
import { Command, int } from '../guest-agent/src/cli-options.ts';
import { describeError, exitStatusOf } from '../host-broker/src/cli/terminal.ts';

const DEMO = new Command({
  name: 'hutch demo',
  summary: 'A real broker with real microVM sandboxes: agents driven through the SDK on the example projects.',
  options: {
    sandboxes: { arg: 'N', help: 'agents working at once (default 3)', default: '3', parse: int(1, 32) },
    keep: { help: 'keep the data dir and the workspaces afterwards' },
  },
});
let parsed;
try {
  parsed = DEMO.parse(process.argv.slice(2));
} catch (err) {
  process.stderr.write(describeError('hutch', err));
  process.exit(exitStatusOf(err));
}
if (!parsed) process.exit(0);
const values = parsed.values;
const n = values.sandboxes;
const bold = (s: string) => (process.stdout.isTTY && !process.env['NO_COLOR'] ? `\x1b[1m${s}\x1b[0m` : s);
const step = (s: string) => process.stdout.write(`\n${bold(`== ${s}`)}\n`);

// The guest image first, with progress (cached after the first run); under ./hutch, the Debian packages before it.
const { runSetup } = await import('../host-broker/src/cli/setup-command.ts');
const { defaultLogFormat } = await import('../host-broker/src/cli/progress.ts');
await runSetup({ packages: process.env['HUTCH_INSTALL_PACKAGES'] === '1', guest: true, format: defaultLogFormat(), level: 'info', size: { memoryMiB: 512, cpus: 1 } });
const [{ Hutch }, { createLogger }, { serve }, { EXAMPLE_PROJECTS, prepareWorkspace }] = await Promise.all([
  import('hutch'),
  import('../guest-agent/src/log.ts'),
  import('../host-broker/src/serve.ts'),
  import('../bench/lib/sessions.ts'),
]);

const dataDir = mkdtempSync(join(tmpdir(), 'hutch-demo-'));
// The broker copies a workspace from a host directory only under a root it was given.
const projectsDir = mkdtempSync(join(tmpdir(), 'hutch-demo-projects-'));
const token = randomBytes(16).toString('hex');
step('starting the broker');
const broker = await serve({ port: 0, host: '127.0.0.1', token, dataDir, workspaceRoots: [projectsDir], policy: { idleMs: 3000 }, log: createLogger({ name: 'hutch-broker', level: 'warn' }) });
const url = `ws://127.0.0.1:${broker.port}`;
const hutch = await Hutch.connect(url, { token });
process.stdout.write(`broker ${url}, backend ${hutch.backend}, accelerator ${hutch.accel ?? 'n/a'}\n`);

/** What each agent does in its workspace: a file to read, a tree to grep, the test command. */
const PROJECTS = [
  { name: 'invoicer', read: 'invoicer/money.py', grep: 'grep -rn "def " invoicer | head -3', test: 'python3 -m unittest 2>&1 | tail -1' },
  { name: 'slugkit', read: 'src/slug.js', grep: 'grep -rn "function" src | head -3', test: 'node --test 2>&1 | grep -E "^# (pass|fail)" | paste -sd " "' },
] as const;
for (const p of PROJECTS) prepareWorkspace(p.name, join(projectsDir, p.name), [EXAMPLE_PROJECTS]);

function show(i: number, what: string, r: { route: string; reason: string; woke: boolean; timing: { totalMs: number; addedMs: number; wakeMs: number } }, extra = ''): void {
  const wake = r.woke ? ` woke in ${r.timing.wakeMs.toFixed(0)} ms` : '';
  process.stdout.write(`[sandbox ${i}] ${what.padEnd(34)} route=${r.route.padEnd(9)} ${r.timing.totalMs.toFixed(0).padStart(6)} ms (added ${r.timing.addedMs.toFixed(0)} ms${wake})${extra}\n`);
}

async function agent(i: number): Promise<Sandbox> {
  const p = PROJECTS[i % PROJECTS.length] as (typeof PROJECTS)[number];
  const sb = await hutch.create({ cpus: 1, memoryMiB: 512, workspace: { dir: join(projectsDir, p.name) } });
  const read = await sb.files.read(p.read, { limit: 5 });
  show(i, `read ${p.read}`, read);
  const grep = await sb.run(p.grep);
  show(i, p.grep.replace(/ \|.*$/, ''), grep);
  const tests = await sb.run(p.test, { timeoutMs: 600_000 });
  show(i, `${p.name}: ${p.test.replace(/ 2>&1.*$/, '')}`, tests, `  -> ${tests.stdout.trim()} (${p.name} ships with one failing test)`);
  return sb;
}

step(`${n} agents at once: file tool, read-only shell, test suite`);
const t0 = Date.now();
const sandboxes = await Promise.all(Array.from({ length: n }, (_, i) => agent(i)));
process.stdout.write(`all ${n} done in ${((Date.now() - t0) / 1000).toFixed(1)} s\n`);

step('state outside the workspace survives release (snapshot slot)');
const sb0 = sandboxes[0] as Sandbox;
const cfg = await sb0.run('git config --global user.name "Demo Agent" && echo ok');
show(0, 'git config --global user.name ...', cfg);
process.stdout.write('idle for 5 s: the broker releases every VM (kill when clean, snapshot when not)\n');
await new Promise((r) => setTimeout(r, 5000));
const again = await sb0.run('git config --global user.name');
show(0, 'git config --global user.name', again, `  -> ${again.stdout.trim()}`);

step('live telemetry (one sample of sandbox 0)');
await hutch.telemetry({
  session: sb0.id,
  count: 1,
  onSample: (e) => {
    const s = e.sessions[0];
    const m = s?.sample?.memory;
    if (!m) return void process.stdout.write(`vm ${s?.vm}${s?.error ? `: ${s.error}` : ''}\n`);
    const mib = (b: number) => `${(b / 1048576).toFixed(0)} MiB`;
    process.stdout.write(`vm ${s.vm}: total ${mib(m.totalBytes)}, available ${mib(m.availableBytes)}, page cache ${mib(m.cacheBytes)}, zswap ${mib(m.zswapPoolBytes)}; processes: ${s.sample?.processes.map((p) => `${p.comm}(${mib(p.rssBytes)})`).join(' ')}\n`);
  },
});

step('what the broker counted (/metrics excerpt)');
const metrics = await (await fetch(`${url.replace('ws:', 'http:')}/metrics`, { headers: { authorization: `Bearer ${token}` } })).text();
for (const line of metrics.split('\n')) if (/^hutch_(calls_total|wakes_total|releases_total)\{/.test(line)) process.stdout.write(`${line}\n`);

for (const sb of sandboxes) await sb.close();
hutch.close();
await broker.stop();
if (values.keep) process.stdout.write(`\nkept ${dataDir} and ${projectsDir}\n`);
else for (const d of [dataDir, projectsDir]) rmSync(d, { recursive: true, force: true });
process.stdout.write(`\n${bold('demo finished')}: run your own with ./hutch serve, connect with the SDK (import { Hutch } from 'hutch').\n`);
