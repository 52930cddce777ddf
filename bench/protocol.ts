/**
 * Protocol throughput and RPC latency against the real agent process.
 * `npx tsx bench/protocol.ts [--json] [--quick]`
 *   raw_mb_s          bytes through a plain Unix socket to an echo process and back (the baseline)
 *   proto_mb_s        the same bytes through one protocol stream to the agent (debug.echo) and back
 *   throughput_ratio  proto / raw
 *   rpc_p50_us/p99_us a small fs.stat call, sequential round trips
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { connect } from 'node:net';
import { waitForSocket } from '../host-broker/src/util/wait-for-socket.ts';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { AgentClient } from '../host-broker/src/agent-client.ts';
import { buildAgent } from '../guest-agent/build.ts';
import { benchArgs, emit, markdownTable, median, percentile, round } from './lib/report.ts';

const args = benchArgs();
/** --quick: seconds, to check the bench still runs to its JSON line (test/benches.test.ts), not a measurement. */
const quick = args.argv.includes('--quick');
const MB = 1024 * 1024;
const totalBytes = (quick ? 16 : 512) * MB;
const chunk = Buffer.alloc(256 * 1024, 0x5a);
const rpcCalls = quick ? 200 : 3000;
const rounds = quick ? 1 : 3;

const dir = mkdtempSync(join(tmpdir(), 'hutch-bench-proto-'));
const ws = join(dir, 'ws');
const children: ChildProcess[] = [];
process.on('exit', () => {
  for (const c of children) c.kill('SIGKILL');
  rmSync(dir, { recursive: true, force: true });
});

function* source(): Generator<Buffer> {
  for (let sent = 0; sent < totalBytes; sent += chunk.length) yield chunk;
}

/** Plain Unix socket: an echo process pipes the socket to itself. */
async function rawRound(path: string): Promise<number> {
  const sock = connect(path);
  await new Promise((r) => sock.once('connect', r));
  const t0 = performance.now();
  let got = 0;
  const done = new Promise<void>((resolve) => {
    sock.on('data', (d: Buffer) => {
      got += d.length;
      if (got >= totalBytes) resolve();
    });
  });
  for (const c of source()) if (!sock.write(c)) await new Promise((r) => sock.once('drain', r));
  await done;
  const s = (performance.now() - t0) / 1000;
  sock.destroy();
  return totalBytes / MB / s;
}

async function protoRound(client: AgentClient): Promise<number> {
  let got = 0;
  const t0 = performance.now();
  await client.echo(
    (async function* () {
      yield* source();
    })(),
    (c) => void (got += c.length),
  );
  const s = (performance.now() - t0) / 1000;
  if (got !== totalBytes) throw new Error(`echo returned ${got} of ${totalBytes} bytes`);
  return totalBytes / MB / s;
}

const bundle = await buildAgent(join(dir, 'hutch-agent.mjs'));
rmSync(ws, { recursive: true, force: true });
await import('node:fs').then((fs) => fs.mkdirSync(ws));
writeFileSync(join(ws, 'small.txt'), 'hello\n');

const echoSock = join(dir, 'echo.sock');
const echo = spawn(process.execPath, ['-e', `require('net').createServer(s => s.pipe(s)).listen(${JSON.stringify(echoSock)})`], { stdio: 'inherit' });
children.push(echo);
const agentSock = join(dir, 'agent.sock');
const agent = spawn(process.execPath, [bundle.path, '--listen', `unix:${agentSock}`, '--root', ws, '--log-level', 'warn'], { stdio: 'inherit' });
children.push(agent);
await Promise.all([waitForSocket(echoSock), waitForSocket(agentSock)]);
const client = await AgentClient.connectUnix(agentSock);

const raw: number[] = [];
const proto: number[] = [];
for (let i = 0; i < rounds; i++) {
  raw.push(await rawRound(echoSock));
  proto.push(await protoRound(client));
}
const rpc: number[] = [];
for (let i = 0; i < rpcCalls; i++) {
  const t0 = performance.now();
  await client.call('fs.stat', { path: 'small.txt' });
  rpc.push((performance.now() - t0) * 1000);
}
client.close();

const rawMb = median(raw);
const protoMb = median(proto);
const summary = {
  throughput_ratio: round(protoMb / rawMb, 3),
  raw_mb_s: round(rawMb, 1),
  proto_mb_s: round(protoMb, 1),
  rpc_p50_us: round(median(rpc), 1),
  rpc_p99_us: round(percentile(rpc, 99), 1),
  bytes_per_round: totalBytes,
  rounds,
  rpc_calls: rpcCalls,
};
emit(
  'protocol: one stream to the agent and back vs a plain Unix socket',
  markdownTable([
    { measure: 'throughput ratio (proto/raw)', value: summary.throughput_ratio, aim: '>= 0.5' },
    { measure: 'raw Unix socket echo MB/s (median)', value: summary.raw_mb_s, aim: '' },
    { measure: 'protocol stream echo MB/s (median)', value: summary.proto_mb_s, aim: '' },
    { measure: 'fs.stat RPC p50 us', value: summary.rpc_p50_us, aim: '<= 200' },
    { measure: 'fs.stat RPC p99 us', value: summary.rpc_p99_us, aim: '' },
  ]),
  summary,
  { raw_mb_s: raw.map((x) => round(x, 1)), proto_mb_s: proto.map((x) => round(x, 1)), rpc_us_sample: rpc.slice(0, 20).map((x) => round(x, 1)) },
);
process.exit(0);
