/**
 * What one tenant's `read` of a file of many short lines costs every other tenant: a broker
 * (`hutch serve --backend unsafe-local`, its own process) is asked for the whole of a file
 * of N empty lines (`limit: 2**31`, as in issue 38: 40 million lines in a 40 MB file, made
 * in 170 ms on the fast path), while this process probes its `/healthz` every 100 ms and
 * samples its resident memory from /proc.
 *   rss_before_mib / rss_peak_mib   the broker's VmRSS before the read and the highest
 *                  sampled while it ran (VmHWM, the kernel's own peak, beside it)
 *   healthz_worst_ms  the longest a probe waited for its answer (every session's calls
 *                  wait as long); healthz_late  probes that took over 1 s; healthz_failed
 *                  probes not answered within 5 s; healthz_idle_worst_ms  the same probes
 *                  for 3 s before the read (the host's own noise)
 *   read_ms, answer_bytes  the call's time and the size of the content it answered
 *
 *   npx tsx bench/read-answer.ts [--lines N[,N...]] [--json]     (default 8000000,40000000)
 */
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { Worker } from 'node:worker_threads';
import { Hutch } from '../host-broker/src/sdk/index.ts';
import { benchArgs, emit, markdownTable, round } from './lib/report.ts';

const args = benchArgs();
const linesArg = args.argv[args.argv.indexOf('--lines') + 1];
const SIZES = args.argv.includes('--lines') && linesArg ? linesArg.split(',').map(Number) : [8_000_000, 40_000_000];
const PROBE_EVERY_MS = 100;
const LATE_MS = 1000;
const FAIL_MS = 5000;

interface Broker {
  port: number;
  pid: number;
  dataDir: string;
  token: string;
  stop(): void;
}

/** A broker of its own per size: its peak memory is that read's alone. */
async function startBroker(): Promise<Broker> {
  const dataDir = mkdtempSync(join(tmpdir(), 'hutch-bench-read-'));
  const token = randomBytes(12).toString('hex');
  // node with tsx's loader, no npx or tsx wrapper: the child is the broker whose memory is sampled.
  const child = spawn(process.execPath, ['--import', 'tsx', 'host-broker/src/cli.ts', 'serve', '--backend', 'unsafe-local', '--i-know-unsafe-local', '--port', '0', '--token', token, '--data-dir', dataDir, '--standby', '0', '--ready-json', '--log-level', 'warn'], {
    stdio: ['ignore', 'pipe', 'inherit'],
    detached: true,
  });
  const stop = () => {
    try {
      process.kill(-(child.pid as number), 'SIGTERM');
    } catch {
      // already gone
    }
    rmSync(dataDir, { recursive: true, force: true });
  };
  process.on('exit', stop);
  const ready = await new Promise<{ port: number }>((resolve, reject) => {
    let buf = '';
    child.stdout?.on('data', (c: Buffer) => {
      buf += c.toString();
      const nl = buf.indexOf('\n');
      if (nl >= 0) resolve(JSON.parse(buf.slice(0, nl)) as { port: number });
    });
    child.once('exit', (code) => reject(new Error(`broker exited (${code}) before it was ready`)));
  });
  return { port: ready.port, pid: child.pid as number, dataDir, token, stop };
}

/**
 * The prober and the memory sampler run in a worker thread: this thread's loop is busy
 * decoding the answer when it arrives, and must not delay the probes it times.
 */
const WATCHER = `
const { parentPort, workerData } = require('node:worker_threads');
const { request } = require('node:http');
const { readFileSync } = require('node:fs');
const { port, pid, everyMs, failMs } = workerData;
const rss = () => Number(/^VmRSS:\\s+(\\d+) kB/m.exec(readFileSync('/proc/' + pid + '/status', 'utf8'))[1]) / 1024;
const hwm = () => Number(/^VmHWM:\\s+(\\d+) kB/m.exec(readFileSync('/proc/' + pid + '/status', 'utf8'))[1]) / 1024;
const before = rss();
let peak = before;
const probes = [];
const probe = () => new Promise((resolve) => {
  const t0 = performance.now();
  const req = request({ host: '127.0.0.1', port, path: '/healthz', timeout: failMs }, (res) => {
    res.resume();
    res.on('end', () => resolve(performance.now() - t0));
  });
  req.on('timeout', () => req.destroy());
  req.on('error', () => resolve(null));
  req.end();
});
const t = setInterval(() => {
  peak = Math.max(peak, rss());
  probes.push(probe());
}, everyMs);
parentPort.postMessage({ started: true });
parentPort.on('message', async () => {
  clearInterval(t);
  parentPort.postMessage({ before, peak: Math.max(peak, rss()), hwm: hwm(), waited: await Promise.all(probes) });
});
`;

interface Watched {
  before: number;
  peak: number;
  hwm: number;
  waited: Array<number | null>;
}

async function watch(port: number, pid: number): Promise<{ stop(): Promise<Watched> }> {
  const w = new Worker(WATCHER, { eval: true, workerData: { port, pid, everyMs: PROBE_EVERY_MS, failMs: FAIL_MS } });
  await new Promise((r) => w.once('message', r));
  return {
    async stop() {
      const done = new Promise<Watched>((r) => w.once('message', r));
      w.postMessage('stop');
      const out = await done;
      await w.terminate();
      return out;
    },
  };
}

const rows: Array<Record<string, string | number>> = [];
const summary: Record<string, unknown> = {};
for (const n of SIZES) {
  const b = await startBroker();
  const hutch = await Hutch.connect(`ws://127.0.0.1:${b.port}`, { token: b.token });
  const sb = await hutch.create({});
  writeFileSync(join(b.dataDir, 'sessions', sb.id, 'workspace', 'lines.txt'), Buffer.alloc(n, 10));
  await new Promise((r) => setTimeout(r, 500));
  // The same probes for 3 s with nothing running: the host's own noise, to read the rest against.
  const idle = await watch(b.port, b.pid);
  await new Promise((r) => setTimeout(r, 3000));
  const quiet = (await idle.stop()).waited.filter((w): w is number => w !== null);
  const watcher = await watch(b.port, b.pid);
  const t0 = performance.now();
  const r = await sb.files.read('lines.txt', { limit: 2 ** 31 }).catch((e: unknown) => e as Error);
  const readMs = performance.now() - t0;
  await new Promise((res) => setTimeout(res, 300));
  const m = await watcher.stop();
  const answered = m.waited.filter((w): w is number => w !== null);
  const row = {
    lines: n,
    rss_before_mib: round(m.before, 0),
    rss_peak_mib: round(m.peak, 0),
    hwm_mib: round(m.hwm, 0),
    healthz_idle_worst_ms: quiet.length ? round(Math.max(...quiet), 0) : 'none answered',
    healthz_worst_ms: answered.length ? round(Math.max(...answered), 0) : 'none answered',
    healthz_probes: m.waited.length,
    healthz_late: answered.filter((w) => w > LATE_MS).length,
    healthz_failed: m.waited.length - answered.length,
    read_ms: round(readMs, 0),
    answer_bytes: r instanceof Error ? `error: ${r.message.slice(0, 60)}` : Buffer.byteLength(r.content),
    answer_lines: r instanceof Error ? 0 : r.lines,
  };
  rows.push(row);
  summary[`lines_${n}`] = row;
  hutch.close();
  b.stop();
}
emit('One read of a file of many empty lines, limit 2**31: the broker meanwhile', markdownTable(rows), summary);
process.exit(0);
