/**
 * What a client that does not read takes from the broker (issue 38, item 2): a broker is
 * started as its own process (`hutch serve`, unsafe-local), and while one tenant runs a
 * reproduction its RSS is sampled from /proc every 100 ms, /healthz is asked every 100 ms,
 * and another principal's client of the same broker reads a small file every 500 ms.
 * `npx tsx bench/slow-reader.ts [--json] [--case a,b,b16,c] [--seconds N]`; the code before the send
 * budget ran it in a copy of the tree at its commit (the numbers in the README).
 *
 *   a    a WebSocket client sends `read` calls of a file whose answer is ~4 MB and never
 *        reads its socket (the client's own send queue kept under 8 MiB)
 *   b    run('head -c 1200000000 /dev/zero', { maxOutputBytes: 4e9 }), not streamed
 *   b16  the same command with maxOutputBytes at 16 MiB (the broker's cap), not streamed
 *   c    E2B process.Process/Start of `cat /dev/zero` from a raw TCP client that never reads
 *
 *   peak_rss_mib         the broker's highest VmRSS during the case
 *   rss_growth_mib       that peak minus its VmRSS before the case
 *   rss_end_mib          VmRSS at the end of the case, before the tenant's client goes away
 *   rss_after_mib        VmRSS 5 s after the tenant's client went away
 *   worst_healthz_ms     the slowest /healthz answer (or the longest one still waiting)
 *   other_read_worst_ms  the slowest read of the other client
 *   closed_after_s       when the broker closed the tenant's connection or stream (its warn log
 *                        `ws.send_*`, `e2b.send_*` or `e2b.stream_full`; null: it did not)
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { readFileSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { connect, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { randomBytes } from 'node:crypto';
import { performance } from 'node:perf_hooks';
import WebSocket from 'ws';
import { pack } from 'msgpackr';
import { Hutch } from '../host-broker/src/sdk/index.ts';
import { benchArgs, emit, markdownTable, round } from './lib/report.ts';

const args = benchArgs();
const opt = (name: string, dflt: string) => {
  const i = args.argv.indexOf(name);
  return i >= 0 ? (args.argv[i + 1] as string) : dflt;
};
const CASES = opt('--case', 'a,b,b16,c').split(',');
const SECONDS = Number(opt('--seconds', '45'));
const MiB = 1024 * 1024;

interface Broker {
  proc: ChildProcess;
  /** performance.now() of each connection or stream the broker closed for its client not reading. */
  closes: number[];
  pid: number;
  url: string;
  http: string;
  /** The tenant's token, and another principal's. */
  token: string;
  other: string;
  dir: string;
}

async function startBroker(): Promise<Broker> {
  const dir = mkdtempSync(join(tmpdir(), 'hutch-slow-reader-'));
  const token = randomBytes(16).toString('hex');
  const other = randomBytes(16).toString('hex');
  const tokens = join(dir, 'tokens');
  writeFileSync(tokens, `tenant:${token}\nother:${other}\n`, { mode: 0o600 });
  const proc = spawn(process.execPath, ['--import', 'tsx', 'host-broker/src/cli.ts', 'serve', '--port', '0', '--tokens-file', tokens, '--data-dir', join(dir, 'data'), '--backend', 'unsafe-local', '--i-know-unsafe-local', '--ready-json', '--log-level', 'warn'], { stdio: ['ignore', 'pipe', 'pipe'] });
  const closes: number[] = [];
  proc.stderr?.on('data', (d: Buffer) => {
    for (const _ of d.toString().matchAll(/"msg":"(ws\.send_(stalled|overflow)|e2b\.send_(stalled|overflow)|e2b\.stream_full)"/g)) closes.push(performance.now());
  });
  const line = await new Promise<string>((resolve, reject) => {
    let buf = '';
    proc.stdout?.on('data', (d: Buffer) => {
      buf += d.toString();
      const nl = buf.indexOf('\n');
      if (nl >= 0) resolve(buf.slice(0, nl));
    });
    proc.once('exit', (code) => reject(new Error(`broker exited (${code}) before it was ready`)));
  });
  const ready = JSON.parse(line) as { url: string };
  return { proc, closes, pid: proc.pid as number, url: ready.url, http: ready.url.replace('ws:', 'http:'), token, other, dir };
}

async function stopBroker(b: Broker): Promise<void> {
  if (b.proc.exitCode === null && b.proc.signalCode === null) {
    const exited = new Promise((r) => b.proc.once('exit', r));
    b.proc.kill('SIGTERM');
    const t = setTimeout(() => b.proc.kill('SIGKILL'), 20_000);
    await exited;
    clearTimeout(t);
  }
  rmSync(b.dir, { recursive: true, force: true });
}

function rssMiB(pid: number): number {
  try {
    const m = /VmRSS:\s+(\d+) kB/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'));
    return m ? Number(m[1]) / 1024 : NaN;
  } catch {
    return NaN;
  }
}

/** RSS every 100 ms; /healthz every 100 ms (one at a time: a slow one counts while it waits); another client's read every 500 ms. */
function watch(b: Broker, other: { read(): Promise<unknown> }) {
  let peak = 0;
  let worstHealth = 0;
  let worstRead = 0;
  let readFailures = 0;
  let healthStart: number | undefined;
  let readStart: number | undefined;
  let stopped = false;
  const rssTimer = setInterval(() => (peak = Math.max(peak, rssMiB(b.pid) || 0)), 100);
  const health = (async () => {
    while (!stopped) {
      healthStart = performance.now();
      await fetch(`${b.http}/healthz`, { signal: AbortSignal.timeout(60_000) }).then((r) => r.text()).catch(() => undefined);
      worstHealth = Math.max(worstHealth, performance.now() - healthStart);
      healthStart = undefined;
      await new Promise((r) => setTimeout(r, 100));
    }
  })();
  const reads = (async () => {
    while (!stopped) {
      readStart = performance.now();
      await other.read().catch(() => readFailures++);
      worstRead = Math.max(worstRead, performance.now() - readStart);
      readStart = undefined;
      await new Promise((r) => setTimeout(r, 500));
    }
  })();
  return {
    async stop() {
      const now = performance.now();
      if (healthStart !== undefined) worstHealth = Math.max(worstHealth, now - healthStart);
      if (readStart !== undefined) worstRead = Math.max(worstRead, now - readStart);
      stopped = true;
      clearInterval(rssTimer);
      await Promise.race([Promise.all([health, reads]), new Promise((r) => setTimeout(r, 2000))]);
      return { peak, worstHealth, worstRead, readFailures };
    },
  };
}

/** (a): read calls with ~4 MB answers from a WebSocket whose socket is never read. */
async function caseA(b: Broker, session: string, until: number): Promise<{ dropped: number | undefined; sent: number; close(): void }> {
  const ws = new WebSocket(b.url, { headers: { authorization: `Bearer ${b.token}` } });
  ws.on('error', () => undefined);
  await new Promise((r) => ws.once('message', r)); // the hello
  const raw = (ws as unknown as { _socket: Socket })._socket;
  raw.pause();
  const t0 = performance.now();
  let dropped: number | undefined;
  raw.once('close', () => (dropped ??= performance.now() - t0));
  let sent = 0;
  while (performance.now() < until && dropped === undefined) {
    if (ws.readyState !== ws.OPEN) break;
    if (ws.bufferedAmount < 8 * MiB) ws.send(pack({ t: 'req', id: ++sent, op: 'call', p: { session, tool: 'read', args: { filePath: 'big.txt' } } }));
    else await new Promise((r) => setTimeout(r, 20));
    if (sent % 64 === 0) await new Promise((r) => setImmediate(r));
  }
  // A peer that closed is seen when we write (its kernel answers with a reset): ping until the end of the case.
  while (performance.now() < until && dropped === undefined) {
    if (ws.readyState === ws.OPEN) ws.ping();
    await new Promise((r) => setTimeout(r, 200));
  }
  return { dropped, sent, close: () => ws.terminate() };
}

/** (c): E2B Start of `cat /dev/zero` on a raw socket that sends its request and never reads. */
async function caseC(b: Broker, until: number): Promise<{ dropped: number | undefined; sent: number; close(): void }> {
  const created = (await (await fetch(`${b.http}/e2b/api/sandboxes`, { method: 'POST', headers: { 'x-api-key': b.token, 'content-type': 'application/json' }, body: '{}' })).json()) as { sandboxID: string; envdAccessToken: string };
  const json = Buffer.from(JSON.stringify({ process: { cmd: '/bin/bash', args: ['-l', '-c', 'cat /dev/zero'] } }));
  const head = Buffer.alloc(5);
  head.writeUInt32BE(json.length, 1);
  const body = Buffer.concat([head, json]);
  const port = Number(new URL(b.http).port);
  const s = connect({ port, host: '127.0.0.1' });
  s.on('error', () => undefined);
  await new Promise((r) => s.once('connect', r));
  s.pause();
  const t0 = performance.now();
  let dropped: number | undefined;
  s.once('close', () => (dropped ??= performance.now() - t0));
  s.write(
    `POST /e2b/envd/process.Process/Start HTTP/1.1\r\nHost: x\r\ncontent-type: application/connect+json\r\ne2b-sandbox-id: ${created.sandboxID}\r\nx-access-token: ${created.envdAccessToken}\r\ncontent-length: ${body.length}\r\n\r\n`,
  );
  s.write(body);
  while (performance.now() < until && dropped === undefined) {
    if (s.writable) s.write(Buffer.alloc(0));
    await new Promise((r) => setTimeout(r, 200));
  }
  return { dropped, sent: 1, close: () => s.destroy() };
}

async function runCase(name: string): Promise<Record<string, string | number | boolean | null>> {
  const b = await startBroker();
  try {
    const h = await Hutch.connect(b.url, { token: b.token });
    const line = 'x'.repeat(1990);
    const tenant = await h.create({ workspace: { files: { 'big.txt': Array.from({ length: 2000 }, () => line).join('\n') + '\n' } } });
    const otherConn = await Hutch.connect(b.url, { token: b.other });
    const otherSb = await otherConn.create({ workspace: { files: { 'small.txt': 'hello\n' } } });
    await new Promise((r) => setTimeout(r, 1000));
    const before = rssMiB(b.pid);
    const w = watch(b, { read: () => otherSb.files.read('small.txt') });
    const t0 = performance.now();
    const until = t0 + SECONDS * 1000;
    let dropped: number | undefined;
    let detail = '';
    let leave = () => undefined as void;
    if (name === 'a') {
      const r = await caseA(b, tenant.id, until);
      dropped = r.dropped;
      detail = `${r.sent} reads sent`;
      leave = r.close;
    } else if (name === 'c') {
      const r = await caseC(b, until);
      dropped = r.dropped;
      leave = r.close;
    } else {
      const max = name === 'b' ? 4e9 : 16 * MiB;
      const conn = await Hutch.connect(b.url, { token: b.token });
      const sb = await conn.attach(tenant.id);
      let answered = false;
      const closed = new Promise<number>((r) => conn['ws'].once('close', () => r(performance.now() - t0)));
      const out = await Promise.race([
        sb.run('head -c 1200000000 /dev/zero', { maxOutputBytes: max, timeoutMs: SECONDS * 1000 }).then(
          (r) => `stdout ${r.stdout.length} chars, truncated ${r.truncated}`,
          (e: { code?: string; message?: string }) => `error ${e.code ?? ''} ${String(e.message).slice(0, 80)}`,
        ).finally(() => (answered = true)),
        closed.then((ms) => {
          if (!answered) dropped = ms; // not our own close after the answer
          return 'connection dropped';
        }),
        new Promise<string>((r) => setTimeout(() => r('no answer'), SECONDS * 1000 + 5000)),
      ]);
      detail = out;
      leave = () => conn.close();
    }
    const during = await w.stop();
    const end = rssMiB(b.pid);
    const closedAt = b.closes.find((t) => t >= t0);
    if (dropped !== undefined) detail = `${detail}; the client saw its connection close at ${round(dropped / 1000, 1)} s`;
    leave();
    await new Promise((r) => setTimeout(r, 5000));
    const after = rssMiB(b.pid);
    h.close();
    otherConn.close();
    return {
      case: name,
      rss_before_mib: round(before, 0),
      peak_rss_mib: round(during.peak, 0),
      rss_growth_mib: round(during.peak - before, 0),
      rss_end_mib: round(end, 0),
      rss_after_mib: round(after, 0),
      worst_healthz_ms: round(during.worstHealth, 0),
      other_read_worst_ms: round(during.worstRead, 0),
      other_read_failures: during.readFailures,
      closed_after_s: closedAt === undefined ? null : round((closedAt - t0) / 1000, 1),
      detail,
    };
  } finally {
    await stopBroker(b);
  }
}

const rows: Array<Record<string, string | number | boolean | null>> = [];
for (const c of CASES) rows.push(await runCase(c));
emit('A client that does not read (issue 38 item 2)', markdownTable(rows), { seconds: SECONDS, cases: rows });
