/**
 * What a gateway adds to a call: an in-process file read (the cheapest call there is, so the
 * gateway's share is as visible as it gets) on one session, straight to its broker and through
 * a gateway, interleaved in one run so both see the same machine load.
 *   direct_p50_ms / via_gateway_p50_ms   client-side round trip of a read
 *   added_p50_ms / added_p99_ms          via gateway minus direct, at that percentile
 * Real processes: redis-server, one broker (unsafe-local), one gateway, on loopback.
 *   npx tsx bench/gateway.ts [--json] [--quick]
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { Hutch, type Sandbox } from '../host-broker/src/sdk/index.ts';
import { clusterSkipReason, startCluster, TENANTS } from '../test/helpers/cluster.ts';
import { benchArgs, emit, markdownTable, percentile, round } from './lib/report.ts';

const args = benchArgs();
/** --quick: seconds past the cluster's start, to check the bench still runs to its JSON line (test/benches.test.ts). */
const quick = args.argv.includes('--quick');
const reads = quick ? 50 : 3000;
const warmup = quick ? 20 : 200;

const skip = clusterSkipReason();
if (skip) {
  process.stderr.write(`bench/gateway: cannot run here: ${skip}\n`);
  process.exit(2);
}

const work = mkdtempSync(join(tmpdir(), 'hutch-bench-gateway-'));
const cluster = await startCluster(work);
try {
  const broker = await cluster.startBroker('bench-b1', { leaseMs: 10_000 });
  const gateway = await cluster.startGateway();
  const via = await Hutch.connect(gateway.url, { token: TENANTS.alice });
  const content = 'x'.repeat(60) + '\n';
  const sbVia = await via.create({ workspace: { files: { 'f.txt': content.repeat(64) } } });
  const direct = await Hutch.connect(broker.url, { token: TENANTS.alice });
  const sbDirect = await direct.attach(sbVia.id);

  const time = async (sb: Sandbox): Promise<number> => {
    const t0 = performance.now();
    await sb.files.read('f.txt');
    return performance.now() - t0;
  };
  for (let i = 0; i < warmup; i++) {
    await time(sbDirect);
    await time(sbVia);
  }
  const d: number[] = [];
  const v: number[] = [];
  for (let i = 0; i < reads; i++) {
    // Alternate which goes first, so neither always runs right after the other.
    if (i % 2) {
      d.push(await time(sbDirect));
      v.push(await time(sbVia));
    } else {
      v.push(await time(sbVia));
      d.push(await time(sbDirect));
    }
  }
  via.close();
  direct.close();
  const summary = {
    bench: 'gateway',
    reads,
    direct_p50_ms: round(percentile(d, 50), 3),
    direct_p99_ms: round(percentile(d, 99), 3),
    via_gateway_p50_ms: round(percentile(v, 50), 3),
    via_gateway_p99_ms: round(percentile(v, 99), 3),
    added_p50_ms: round(percentile(v, 50) - percentile(d, 50), 3),
    added_p99_ms: round(percentile(v, 99) - percentile(d, 99), 3),
  };
  const table = markdownTable([
    { path: 'direct to the broker', p50_ms: summary.direct_p50_ms, p99_ms: summary.direct_p99_ms },
    { path: 'through a gateway', p50_ms: summary.via_gateway_p50_ms, p99_ms: summary.via_gateway_p99_ms },
    { path: 'added by the gateway', p50_ms: summary.added_p50_ms, p99_ms: summary.added_p99_ms },
  ]);
  if (args.json) process.stdout.write(JSON.stringify(summary) + '\n');
  else emit(`gateway: ${reads} in-process reads each way, interleaved`, table, summary);
} finally {
  await cluster.stopAll();
  rmSync(work, { recursive: true, force: true });
}
