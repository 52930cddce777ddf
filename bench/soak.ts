/**
 * Soak: sessions cycling wake, call, release through a real broker (qemu backend) while
 * faults are injected at random points, checking after every call that nothing was lost.
 *
 *   npx tsx bench/soak.ts --cycles N [--sessions K] [--fault-rate P] [--seed S] [--faults a,b] [--json] [--quick]
 *
 * --quick: 4 cycles of one session, seed 1, faults qemu-kill and agent-exit only (a minute
 * or two under TCG): checks the bench still runs to its JSON line (test/benches.test.ts, VM
 * tier), not a soak. --faults narrows the kinds injected.
 *
 * Faults: SIGKILL of QEMU mid-call and mid-sync (while a call's many files are pulled
 * back), the guest's agent process killed, the guest frozen (SIGSTOP: the broker's
 * deadline must give up on it), the broker SIGKILLed and restarted mid-session, the data
 * dir's disk full (the data dir is a small loop-mounted ext4 filesystem; without loop
 * devices this fault is skipped and the run says so).
 *
 * After every call the host workspace is compared with a model of what the calls that
 * succeeded should have left: a call that failed must have left the workspace as before
 * it or as after it, never a mix. Counted: calls, hangs (no answer within the call's
 * deadline plus a margin), lost files, half-written files (content that is neither),
 * leaked QEMU processes and leaked files under the data dir and the cache.
 *
 * Last line with --json: {cycles, calls, hangs, lost_files, half_written, leaked_processes,
 * leaked_files, faults_injected, ...}.
 */
import { spawn, execFileSync, type ChildProcess } from 'node:child_process';
import { connect } from 'node:net';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { HutchError } from '../guest-agent/src/protocol/errors.ts';
import { cacheDir } from '../host-broker/src/backends/registry.ts';
import { Hutch, type Sandbox } from '../host-broker/src/sdk/index.ts';
import { qemuPids } from '../host-broker/src/vm/qemu-driver.ts';
import { benchArgs, emit, markdownTable, round } from './lib/report.ts';
import { pick, seededRng } from './lib/tenants-rng.ts';

const args = benchArgs();
const flag = (name: string, dflt: number) => {
  const i = args.argv.indexOf(name);
  const v = i >= 0 ? Number(args.argv[i + 1]) : dflt;
  if (!Number.isFinite(v)) throw new Error(`${name} needs a number`);
  return v;
};
const quick = args.argv.includes('--quick');
const CYCLES = flag('--cycles', quick ? 4 : 20);
const SESSIONS = flag('--sessions', quick ? 1 : 2);
const FAULT_RATE = flag('--fault-rate', quick ? 0.7 : 0.35);
const SEED = flag('--seed', quick ? 1 : Date.now() % 100_000);
const faultsIdx = args.argv.indexOf('--faults');
const ONLY_FAULTS = faultsIdx >= 0 ? (args.argv[faultsIdx + 1] ?? '').split(',') : quick ? ['qemu-kill', 'agent-exit'] : undefined;
const rng = seededRng(SEED);
const progress = (m: string) => process.stderr.write(`[soak ${new Date().toISOString().slice(11, 19)}] ${m}\n`);

/** A call that has not settled after this long counts as a hang (the broker's own deadlines are shorter). */
const HANG_MS = 240_000;
/** Given to the broker: a frozen guest is given up on after this much silence. */
const DEAD_AFTER_MS = 8_000;
const IDLE_MS = 1_500;

// ------------------------------------------------------------ the data dir on its own small disk

const base = mkdtempSync(join(tmpdir(), 'hutch-soak-'));
const dataDir = join(base, 'data');
mkdirSync(dataDir);
let loop: string | undefined;
let diskFullReason: string | undefined;
try {
  const img = join(base, 'data.img');
  execFileSync('truncate', ['-s', '1536M', img]);
  execFileSync('mkfs.ext4', ['-q', '-F', '-m', '0', img]);
  loop = execFileSync('losetup', ['--find', '--show', img], { encoding: 'utf8' }).trim();
  execFileSync('mount', [loop, dataDir]);
} catch (err) {
  diskFullReason = `no loop-mounted data dir here (${(err as Error).message.split('\n')[0]}): the disk-full fault is skipped`;
  progress(diskFullReason);
  loop = undefined;
}

const token = randomBytes(12).toString('hex');
const control = join(base, 'control.sock');
const runner = fileURLToPath(new URL('./lib/soak-broker.ts', import.meta.url));

interface Runner {
  proc: ChildProcess;
  url: string;
}

async function startRunner(): Promise<Runner> {
  const proc = spawn(process.execPath, ['--import', 'tsx', runner, JSON.stringify({ dataDir, token, idleMs: IDLE_MS, control })], {
    stdio: ['ignore', 'pipe', 'inherit'],
    env: { ...process.env, HUTCH_GUEST_DEAD_AFTER_MS: String(DEAD_AFTER_MS) },
  });
  const port = await new Promise<number>((resolve, reject) => {
    let out = '';
    proc.stdout?.on('data', (d: Buffer) => {
      out += d.toString();
      const nl = out.indexOf('\n');
      if (nl >= 0) resolve((JSON.parse(out.slice(0, nl)) as { port: number }).port);
    });
    proc.once('exit', (code) => reject(new Error(`broker exited (${code}) before listening`)));
  });
  return { proc, url: `ws://127.0.0.1:${port}` };
}

async function stopRunner(r: Runner, signal: NodeJS.Signals): Promise<void> {
  if (r.proc.exitCode !== null || r.proc.signalCode !== null) return;
  const gone = new Promise((res) => r.proc.once('exit', res));
  r.proc.kill(signal);
  await gone;
}

function controlCmd(cmd: Record<string, unknown>): Promise<{ ok: boolean; why?: string }> {
  return new Promise((resolve) => {
    const s = connect(control);
    let buf = '';
    s.on('connect', () => s.write(JSON.stringify(cmd) + '\n'));
    s.on('data', (d) => (buf += d.toString()));
    s.on('close', () => resolve(buf ? (JSON.parse(buf) as { ok: boolean }) : { ok: false, why: 'no answer' }));
    s.on('error', () => resolve({ ok: false, why: 'control socket unreachable' }));
  });
}

// ------------------------------------------------------------ the model

type Tree = Map<string, string>;
type Effect = Array<[path: string, content: string | null]>;

function applyEffect(t: Tree, e: Effect): Tree {
  const n = new Map(t);
  for (const [p, c] of e) {
    if (c === null) n.delete(p);
    else n.set(p, c);
  }
  return n;
}

function readTree(session: string): Tree {
  const root = join(dataDir, 'sessions', session, 'workspace');
  const out: Tree = new Map();
  const walk = (rel: string) => {
    for (const d of readdirSync(join(root, rel), { withFileTypes: true })) {
      const r = rel ? `${rel}/${d.name}` : d.name;
      if (d.isDirectory()) walk(r);
      else if (d.isFile()) out.set(r, readFileSync(join(root, r), 'utf8'));
    }
  };
  walk('');
  return out;
}

/** Files of `want` missing from `got`, and files present in both with other content. */
function compare(want: Tree, got: Tree): { lost: number; wrong: number; extra: number } {
  let lost = 0;
  let wrong = 0;
  for (const [p, c] of want) {
    const g = got.get(p);
    if (g === undefined) lost++;
    else if (g !== c) wrong++;
  }
  let extra = 0;
  for (const p of got.keys()) if (!want.has(p)) extra++;
  return { lost, wrong, extra };
}

function same(a: Tree, b: Tree): boolean {
  const c = compare(a, b);
  return c.lost === 0 && c.wrong === 0 && c.extra === 0;
}

// ------------------------------------------------------------ the run

const counts = { cycles: 0, calls: 0, ok: 0, failed: 0, hangs: 0, lost_files: 0, half_written: 0, leaked_processes: 0, leaked_files: 0, faults_injected: 0 };
const faultsByKind: Record<string, number> = {};
const errorsByCode: Record<string, number> = {};
const FAULT_KINDS = ['qemu-kill', 'qemu-kill-in-sync', 'agent-exit', 'freeze', 'broker-kill', 'disk-full'] as const;
type Fault = (typeof FAULT_KINDS)[number];
for (const f of ONLY_FAULTS ?? []) if (!(FAULT_KINDS as readonly string[]).includes(f)) throw new Error(`--faults: unknown fault ${f} (${FAULT_KINDS.join(', ')})`);
const FAULTS: readonly Fault[] = FAULT_KINDS.filter((f) => (ONLY_FAULTS === undefined || ONLY_FAULTS.includes(f)) && (f !== 'disk-full' || loop !== undefined));

let run = await startRunner();
let hutch = await Hutch.connect(run.url, { token });
const sessions: Array<{ sb: Sandbox; model: Tree }> = [];
for (let i = 0; i < SESSIONS; i++) {
  const sb = await hutch.create({ workspace: { files: { 'seed.txt': 'seed\n' } } });
  sessions.push({ sb, model: new Map([['seed.txt', 'seed\n']]) });
}
progress(`broker up at ${run.url}; ${SESSIONS} sessions; data dir ${loop ? `on ${loop}` : 'in /tmp'}; seed ${SEED}`);

async function reconnect(): Promise<void> {
  hutch.close();
  run = await startRunner();
  hutch = await Hutch.connect(run.url, { token });
  for (const s of sessions) s.sb = await hutch.attach(s.sb.id);
}

function withHangWatch<T>(p: Promise<T>): Promise<{ ok: true; v: T } | { ok: false; err: unknown } | { hang: true }> {
  return new Promise((resolve) => {
    const t = setTimeout(() => resolve({ hang: true }), HANG_MS);
    p.then(
      (v) => {
        clearTimeout(t);
        resolve({ ok: true, v });
      },
      (err: unknown) => {
        clearTimeout(t);
        resolve({ ok: false, err });
      },
    );
  });
}

const vmDir = (id: string) => join(dataDir, 'vms', id);
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function inject(fault: Fault, id: string): Promise<void> {
  counts.faults_injected++;
  faultsByKind[fault] = (faultsByKind[fault] ?? 0) + 1;
  switch (fault) {
    case 'qemu-kill':
      await sleep(200 + rng() * 2500);
      for (const pid of qemuPids(vmDir(id))) process.kill(pid, 'SIGKILL');
      return;
    case 'qemu-kill-in-sync':
      // The command itself is quick; most of the call is the pull of its many files.
      await sleep(600 + rng() * 3000);
      for (const pid of qemuPids(vmDir(id))) process.kill(pid, 'SIGKILL');
      return;
    case 'agent-exit':
      await sleep(300 + rng() * 1500);
      await controlCmd({ cmd: 'agent-exit', session: id });
      return;
    case 'freeze':
      await sleep(300 + rng() * 1500);
      for (const pid of qemuPids(vmDir(id))) process.kill(pid, 'SIGSTOP');
      return;
    case 'broker-kill':
      await sleep(300 + rng() * 2500);
      await stopRunner(run, 'SIGKILL');
      return;
    case 'disk-full':
      return; // applied before the call (see below)
  }
}

/** Fills the data dir's disk to its last 256 KiB (the space left moves while VMs write: retry a little smaller). */
function fillDisk(): string | undefined {
  const filler = join(dataDir, 'filler.bin');
  for (let slack = 256 * 1024; slack <= 64 * 1024 * 1024; slack *= 4) {
    const free = Number(execFileSync('df', ['--output=avail', '-B1', dataDir], { encoding: 'utf8' }).split('\n')[1]);
    try {
      execFileSync('fallocate', ['-l', String(Math.max(4096, free - slack)), filler], { stdio: 'ignore' });
      return filler;
    } catch {
      rmSync(filler, { force: true });
    }
  }
  return undefined;
}

const rows: Array<Record<string, string | number>> = [];
const t0 = Date.now();
for (let cycle = 0; cycle < CYCLES; cycle++) {
  for (const s of sessions) {
    const id = s.sb.id;
    const n = Math.floor(rng() * 12);
    const content = `c${cycle}-${randomBytes(4).toString('hex')}`;
    const kind = pick(rng, ['vm-write', 'vm-many', 'vm-delete', 'inproc-write', 'dirty'] as const);
    let effect: Effect = [];
    let call: () => Promise<unknown>;
    switch (kind) {
      case 'vm-write':
        effect = [[`f/${n}.txt`, content]];
        call = () => s.sb.run(`mkdir -p f && printf %s ${content} > f/${n}.txt`, { route: 'vm' });
        break;
      case 'vm-many':
        effect = Array.from({ length: 60 }, (_, k): [string, string] => [`m/${k}.txt`, `${content}-${k}`]);
        call = () => s.sb.run(`mkdir -p m && for k in $(seq 0 59); do printf %s ${content}-$k > m/$k.txt; done`, { route: 'vm' });
        break;
      case 'vm-delete': {
        const victim = [...s.model.keys()].find((p) => p.startsWith('f/')) ?? 'f/none.txt';
        effect = [[victim, null]];
        call = () => s.sb.run(`rm -f ${victim}`, { route: 'vm' });
        break;
      }
      case 'inproc-write':
        effect = [[`f/${n}.txt`, content]];
        call = () => s.sb.files.write(`f/${n}.txt`, content);
        break;
      case 'dirty':
        call = () => s.sb.run(`git config --global user.name soak${cycle}`, { route: 'vm' });
        break;
    }
    const fits = kind === 'vm-many' ? FAULTS : FAULTS.filter((f) => f !== 'qemu-kill-in-sync');
    const fault: Fault | undefined = kind !== 'inproc-write' && fits.length > 0 && rng() < FAULT_RATE ? pick(rng, fits) : undefined;
    let filler: string | undefined;
    if (fault === 'disk-full') {
      filler = fillDisk();
      if (filler) {
        counts.faults_injected++;
        faultsByKind[fault] = (faultsByKind[fault] ?? 0) + 1;
      } else progress(`cycle ${cycle}: could not fill the data dir's disk; this call runs without the fault`);
    }
    counts.calls++;
    const before = s.model;
    const settled = withHangWatch(call());
    const injected = fault && fault !== 'disk-full' ? inject(fault, id) : Promise.resolve();
    const r = await settled;
    await injected;
    if (filler) rmSync(filler, { force: true });
    for (const pid of qemuPids(vmDir(id))) {
      // A frozen VM the broker gave up on was killed by it; one still stopped here is a leak.
      try {
        process.kill(pid, 'SIGCONT');
      } catch {
        // gone
      }
    }
    if (fault === 'broker-kill') await reconnect();
    let outcome: string;
    if ('hang' in r) {
      counts.hangs++;
      outcome = 'HANG';
      progress(`cycle ${cycle} ${id} ${kind} fault=${fault ?? '-'}: no answer within ${HANG_MS} ms`);
    } else if (r.ok) {
      counts.ok++;
      outcome = 'ok';
    } else {
      counts.failed++;
      const code = r.err instanceof HutchError ? r.err.code : 'untyped';
      errorsByCode[code] = (errorsByCode[code] ?? 0) + 1;
      outcome = code;
    }
    const after = applyEffect(before, effect);
    const got = readTree(id);
    if (outcome === 'ok' && same(after, got)) s.model = after;
    else if (outcome !== 'ok' && same(before, got)) s.model = before;
    else if (outcome !== 'ok' && same(after, got)) s.model = after;
    else {
      // Neither before nor after: count what differs from the nearer one.
      const want = outcome === 'ok' ? after : before;
      const c = compare(want, got);
      counts.lost_files += c.lost;
      counts.half_written += c.wrong + c.extra;
      progress(`cycle ${cycle} ${id} ${kind} fault=${fault ?? '-'} -> ${outcome}: workspace is neither before nor after (lost ${c.lost}, wrong ${c.wrong}, extra ${c.extra})`);
      s.model = got; // go on from what is there
    }
    rows.push({ cycle, session: id, op: kind, fault: fault ?? '-', outcome });
    // Release now and then, so the next call wakes (kill or snapshot slot).
    if (rng() < 0.5) {
      await withHangWatch(s.sb.hint('idle'));
    }
  }
  counts.cycles++;
  if (cycle % 5 === 4 || cycle === CYCLES - 1) progress(`cycle ${cycle + 1}/${CYCLES}: ${counts.calls} calls, ${counts.failed} failed (typed), ${counts.hangs} hangs, ${counts.faults_injected} faults, ${Math.round((Date.now() - t0) / 1000)} s`);
}

// ------------------------------------------------------------ leaks

for (const s of sessions) await withHangWatch(s.sb.close());
hutch.close();
await stopRunner(run, 'SIGTERM');
await sleep(500);
const leftoverQemu = qemuPids(dataDir);
counts.leaked_processes = leftoverQemu.length;
for (const pid of leftoverQemu) process.kill(pid, 'SIGKILL');
const leaked: string[] = [];
const walkLeaks = (dir: string, rel: string) => {
  for (const d of readdirSync(dir, { withFileTypes: true })) {
    const r = rel ? `${rel}/${d.name}` : d.name;
    if (r === 'lost+found') continue;
    if (d.isDirectory()) {
      const inner = readdirSync(join(dir, d.name));
      if (inner.length === 0 && ['sessions', 'vms'].includes(r)) continue;
      walkLeaks(join(dir, d.name), r);
    } else leaked.push(r);
  }
};
walkLeaks(dataDir, '');
// The cache holds only finished artifacts: no half-built snapshot dirs or stale locks.
const snapDir = join(cacheDir(), 'snapshots');
if (existsSync(snapDir)) for (const n of readdirSync(snapDir)) if (/\.tmp-|\.lock$/.test(n)) leaked.push(`cache/snapshots/${n}`);
counts.leaked_files = leaked.length;
if (leaked.length) progress(`leaked files: ${leaked.slice(0, 10).join(', ')}`);

if (loop) {
  try {
    execFileSync('umount', [dataDir]);
    execFileSync('losetup', ['-d', loop]);
  } catch (err) {
    progress(`cleanup: ${(err as Error).message}`);
  }
}
rmSync(base, { recursive: true, force: true });

const seconds = Math.round((Date.now() - t0) / 1000);
const summary = {
  ...counts,
  seconds,
  seed: SEED,
  sessions: SESSIONS,
  fault_rate: FAULT_RATE,
  faults_by_kind: faultsByKind,
  errors_by_code: errorsByCode,
  disk_full: diskFullReason ?? 'loop-mounted data dir',
};
const table = markdownTable([
  { measure: 'cycles', value: counts.cycles },
  { measure: 'calls (ok / failed with a typed error)', value: `${counts.calls} (${counts.ok} / ${counts.failed})` },
  { measure: 'faults injected', value: `${counts.faults_injected} ${JSON.stringify(faultsByKind)}` },
  { measure: 'hangs', value: counts.hangs },
  { measure: 'lost files', value: counts.lost_files },
  { measure: 'half-written files', value: counts.half_written },
  { measure: 'leaked QEMU processes', value: counts.leaked_processes },
  { measure: 'leaked files (data dir, cache)', value: counts.leaked_files },
  { measure: 'seconds', value: seconds },
  { measure: 'calls per minute', value: round((counts.calls / Math.max(1, seconds)) * 60, 1) },
]);
writeFileSync(join(tmpdir(), 'hutch-soak-last.json'), JSON.stringify({ summary, rows }, null, 2));
emit(`soak: ${counts.cycles} cycles x ${SESSIONS} sessions, fault rate ${FAULT_RATE}`, table, summary);
process.exit(0);
