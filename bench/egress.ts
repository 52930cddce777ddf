/**
 * A sandbox's network through hutch's egress proxy, against the same transfers on the host,
 * in one run (qemu backend; the accelerator is reported: under TCG the guest's TCP stack,
 * curl and the agent's tunnel all run emulated).
 * `npx tsx bench/egress.ts [--json] [--quick]`
 *
 *   proxy_over_host          throughput of a large download in a sandbox (through the agent's
 *                            tunnel and the broker's proxy) over the same download on the host
 *   download_mb_s            {guest, host} medians, MB/s
 *   connect_added_p50_ms     time to the first byte of a small plain-HTTP GET in the sandbox,
 *                            minus the same on the host (what the tunnel and the proxy add,
 *                            plus the emulated guest's own curl)
 *   loop_delay_ms            the broker's event loop while SANDBOXES sandboxes download at once:
 *                            {p50, p99, max} of a 10 ms timer's lateness, with {idle} beside it
 *   parallel_mb_s            those sandboxes' total throughput
 *
 * The destination is Debian's mirror (what this machine reaches): the bookworm Packages
 * index (about 9 MB, a fixed name) and its Release file (small). Both sides fetch the same
 * URLs alternately, so the mirror's own variance hits both.
 */
import { execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { monitorEventLoopDelay } from 'node:perf_hooks';
import { createLogger } from '../guest-agent/src/log.ts';
import { Broker } from '../host-broker/src/broker.ts';
import { QemuBackend } from '../host-broker/src/backends/qemu-backend.ts';
import { cacheDir } from '../host-broker/src/backends/registry.ts';
import { createFastPath } from '../host-broker/src/tools/fastpath-factory.ts';
import { Hutch, type Sandbox } from '../host-broker/src/sdk/index.ts';
import { benchArgs, emit, markdownTable, median, percentile, round, writeResults } from './lib/report.ts';

const args = benchArgs();
const quick = args.argv.includes('--quick');
const ROUNDS = quick ? 1 : 5;
const SMALL = quick ? 3 : 15;
const SANDBOXES = quick ? 2 : 8;
const BIG = 'http://deb.debian.org/debian/dists/bookworm/main/binary-amd64/Packages.xz';
const SMALL_URL = 'http://deb.debian.org/debian/dists/bookworm/Release';
const progress = (m: string) => process.stderr.write(`[egress] ${m}\n`);
const log = createLogger({ name: 'bench-egress', level: 'warn' });
const dataDir = mkdtempSync(join(tmpdir(), 'hutch-bench-egress-'));
const token = randomBytes(12).toString('hex');

const backend = await QemuBackend.create({ dataDir, cacheDir: cacheDir(), log });
await backend.prepare({ memoryMiB: 512, cpus: 1 });
const broker = new Broker({
  port: 0,
  token,
  dataDir,
  backend,
  fastPath: await createFastPath(log),
  log,
  idleMs: 3_600_000,
  // The bench's own download cap: the default 32 MiB/s would be the figure measured otherwise.
  network: { limits: { maxConnections: 64, bytesPerSecond: 1024 * 1024 * 1024 } },
  admission: { memoryBudgetMiB: 1024 * (SANDBOXES + 2) },
});
const hutch = await Hutch.connect(`ws://127.0.0.1:${await broker.start()}`, { token });

/** curl's -w figures: seconds to the first byte, total seconds, bytes. */
interface Fetch {
  ttfb: number;
  total: number;
  bytes: number;
}
const W = '%{time_starttransfer} %{time_total} %{size_download}';
const parse = (out: string): Fetch => {
  const [a, b, c] = out.trim().split(/\s+/).map(Number);
  return { ttfb: a! * 1000, total: b! * 1000, bytes: c! };
};
const hostFetch = (url: string): Fetch => parse(execFileSync('curl', ['-sS', '-o', '/dev/null', '-w', W, url], { encoding: 'utf8' }));
async function guestFetch(sb: Sandbox, url: string): Promise<Fetch> {
  const r = await sb.run(`curl -sS -o /dev/null -w '${W}' ${url}`, { timeoutMs: 600_000 });
  if (r.exitCode !== 0) throw new Error(`curl in the sandbox failed: ${r.stderr || r.stdout}`);
  return parse(r.stdout);
}

const sb = await hutch.create({ network: { base: 'none', allow: ['deb.debian.org:80'] } });
progress(`accel ${backend.accel}; warming the sandbox`);
await guestFetch(sb, SMALL_URL);

const mbs = (f: Fetch) => f.bytes / 1e6 / (f.total / 1000);
const guestBig: Fetch[] = [];
const hostBig: Fetch[] = [];
for (let i = 0; i < ROUNDS; i++) {
  hostBig.push(hostFetch(BIG));
  guestBig.push(await guestFetch(sb, BIG));
  progress(`round ${i + 1}/${ROUNDS}: host ${round(mbs(hostBig.at(-1)!))} MB/s, sandbox ${round(mbs(guestBig.at(-1)!))} MB/s`);
}
const guestSmall: number[] = [];
const hostSmall: number[] = [];
for (let i = 0; i < SMALL; i++) {
  hostSmall.push(hostFetch(SMALL_URL).ttfb);
  guestSmall.push((await guestFetch(sb, SMALL_URL)).ttfb);
}

// The broker's loop: idle, then while many sandboxes download at once.
const loop = async (work: () => Promise<unknown>) => {
  const h = monitorEventLoopDelay({ resolution: 10 });
  h.enable();
  const t0 = performance.now();
  await work();
  const ms = performance.now() - t0;
  h.disable();
  return { p50: round(h.percentile(50) / 1e6), p99: round(h.percentile(99) / 1e6), max: round(h.max / 1e6), ms };
};
const idle = await loop(() => new Promise((r) => setTimeout(r, 3000)));
const many = await Promise.all(Array.from({ length: SANDBOXES }, () => hutch.create({ network: { base: 'none', allow: ['deb.debian.org:80'] } })));
progress(`waking ${SANDBOXES} sandboxes`);
await Promise.all(many.map((s) => s.run('true', { timeoutMs: 600_000 })));
progress(`${SANDBOXES} sandboxes downloading at once`);
let parallelBytes = 0;
const busy = await loop(() => Promise.all(many.map(async (s) => (parallelBytes += (await guestFetch(s, BIG)).bytes))));

const out = {
  accel: backend.accel,
  sandboxes: SANDBOXES,
  proxy_over_host: round(median(guestBig.map(mbs)) / median(hostBig.map(mbs)), 3),
  download_mb_s: { guest: round(median(guestBig.map(mbs))), host: round(median(hostBig.map(mbs))) },
  download_bytes: guestBig[0]?.bytes ?? 0,
  connect_added_p50_ms: round(median(guestSmall) - median(hostSmall)),
  ttfb_p50_ms: { guest: round(median(guestSmall)), host: round(median(hostSmall)) },
  ttfb_p99_ms: { guest: round(percentile(guestSmall, 99)), host: round(percentile(hostSmall, 99)) },
  loop_delay_ms: { idle: { p50: idle.p50, p99: idle.p99, max: idle.max }, downloading: { p50: busy.p50, p99: busy.p99, max: busy.max } },
  parallel_mb_s: round(parallelBytes / 1e6 / (busy.ms / 1000)),
  raw: { guestBig, hostBig, guestSmall, hostSmall },
};
await hutch.close();
await broker.stop();
rmSync(dataDir, { recursive: true, force: true });
const { raw, ...summary } = out;
const table = markdownTable([
  { figure: 'large download MB/s (sandbox / host)', value: `${out.download_mb_s.guest} / ${out.download_mb_s.host}`, ratio: out.proxy_over_host },
  { figure: 'small GET first byte p50 ms (sandbox / host)', value: `${out.ttfb_p50_ms.guest} / ${out.ttfb_p50_ms.host}`, ratio: `+${out.connect_added_p50_ms} ms` },
  { figure: `broker loop delay p99 / max ms, ${SANDBOXES} downloading (idle)`, value: `${busy.p99} / ${busy.max} (${idle.p99} / ${idle.max})`, ratio: '' },
]);
const title = `Egress through the sandbox proxy vs the host (${backend.accel})`;
if (!quick) writeResults('egress', title, table, summary, raw);
if (args.json) emit(title, table, summary);
else process.stdout.write(`## ${title}\n\n${table}\n`);
process.exit(0);
