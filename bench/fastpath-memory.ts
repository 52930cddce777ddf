/**
 * What concurrent memory-heavy fast-path calls take from the host (issue 38 item 3): N calls
 * of `cat /dev/zero | tail -c 400000000` (each ~400 MB, under the per-run 512 MiB cgroup
 * limit) in one session and then across N sessions of one principal, on a real broker with
 * the unsafe-local backend (no VM is needed).
 *   peak_fastpath_mib   the most the fast path's cgroups held at once (memory.usage_in_bytes
 *                       of their parent, sampled every 50 ms; v1 or v2)
 *   peak_rss_mib        the most the processes in them held at once (sum of VmRSS)
 *   worst_healthz_ms    the broker's slowest /healthz answer meanwhile (asked every 50 ms)
 *   routes / errors     how the calls ended (a refused one: its error code)
 * and then --more-calls (16) sessions, past the fast path's own cap of runs at once.
 *   npx tsx bench/fastpath-memory.ts [--calls 8] [--more-calls 16] [--bytes 400000000] [--timeout-ms 20000] [--json]
 */
import { readdirSync, readFileSync } from 'node:fs';
import { get } from 'node:http';
import { dirname, join } from 'node:path';
import { startBroker } from '../test/helpers/broker.ts';
import { FastPath } from '../host-broker/src/fastpath/index.ts';

const arg = (name: string, fallback: number): number => {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 ? Number(process.argv[i + 1]) : fallback;
};
let CALLS = arg('calls', 8);
const BYTES = arg('bytes', 400_000_000);
const TIMEOUT_MS = arg('timeout-ms', 20_000);

/** The memory hierarchy's `hutch-fastpath` directory, where every fast path of this process makes its run cgroups. */
async function fastPathMemoryParent(): Promise<string> {
  const fp = await FastPath.create();
  try {
    const parents = fp.describe().limits.cgroupParents;
    const memory = parents.find((p) => p.includes('/memory/')) ?? parents[0];
    if (!memory) throw new Error('the fast path uses no cgroups here');
    // This code's pools, or the slots right there (before pools).
    return memory.includes('/pool-') ? dirname(memory) : memory;
  } finally {
    await fp.close();
  }
}

function usage(dir: string): number {
  for (const f of ['memory.usage_in_bytes', 'memory.current']) {
    try {
      return Number(readFileSync(join(dir, f), 'utf8'));
    } catch {
      // the other cgroup version's file
    }
  }
  return 0;
}

/** Sum over every cgroup below `dir` (a parent without hierarchical accounting reports only its own). */
function treeUsage(dir: string): { bytes: number; rss: number } {
  let bytes = 0;
  let rss = 0;
  const pids = new Set<number>();
  const visit = (d: string): void => {
    let names: string[] = [];
    try {
      names = readdirSync(d);
    } catch {
      return;
    }
    const mine = names.filter((n) => n.startsWith(`slot-${process.pid}-`) || n.startsWith(`pool-${process.pid}-`));
    for (const n of mine) visit(join(d, n));
    if (mine.length > 0 || d === dir) return; // a parent: its children count
    bytes += usage(d);
    try {
      for (const l of readFileSync(join(d, 'cgroup.procs'), 'utf8').split('\n')) if (l) pids.add(Number(l));
    } catch {
      // gone
    }
  };
  visit(dir);
  for (const pid of pids) {
    try {
      const m = /VmRSS:\s+(\d+) kB/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'));
      if (m) rss += Number(m[1]) * 1024;
    } catch {
      // exited
    }
  }
  return { bytes, rss };
}

/** One GET on a connection of its own (a reused keep-alive socket can be reset under the broker's handshake timeout). */
function getOnce(url: string): Promise<void> {
  return new Promise((resolve, reject) => {
    get(url, { agent: false }, (res) => {
      res.resume();
      res.on('end', () => resolve());
    }).on('error', reject);
  });
}

async function scenarioWith(name: string, calls: number): Promise<Record<string, unknown>> {
  const saved = CALLS;
  CALLS = calls;
  try {
    return await scenario(name, calls);
  } finally {
    CALLS = saved;
  }
}

async function scenario(name: string, sessions: number): Promise<Record<string, unknown>> {
  const parent = await fastPathMemoryParent();
  const b = await startBroker();
  const healthz = b.url.replace('ws:', 'http:') + '/healthz';
  try {
    const h = await b.connect();
    const sbs = await Promise.all(Array.from({ length: sessions }, () => h.create()));
    let peakBytes = 0;
    let peakRss = 0;
    let worstHealthz = 0;
    let done = false;
    const sampler = (async () => {
      while (!done) {
        const t = performance.now();
        await getOnce(healthz);
        worstHealthz = Math.max(worstHealthz, performance.now() - t);
        const u = treeUsage(parent);
        peakBytes = Math.max(peakBytes, u.bytes);
        peakRss = Math.max(peakRss, u.rss);
        await new Promise((r) => setTimeout(r, 50));
      }
    })();
    const t0 = performance.now();
    const results = await Promise.allSettled(
      Array.from({ length: CALLS }, (_, i) => (sbs[i % sessions] as (typeof sbs)[number]).run(`cat /dev/zero | tail -c ${BYTES} | wc -c`, { timeoutMs: TIMEOUT_MS })),
    );
    const wallMs = performance.now() - t0;
    done = true;
    await sampler;
    const routes: Record<string, number> = {};
    for (const r of results) {
      const k = r.status === 'fulfilled' ? `${r.value.route}${r.value.timedOut ? ' (timed out)' : ''}` : `error ${(r.reason as { code?: string }).code ?? (r.reason as Error).message}`;
      routes[k] = (routes[k] ?? 0) + 1;
    }
    return { scenario: name, calls: CALLS, sessions, peak_fastpath_mib: Math.round(peakBytes / 2 ** 20), peak_rss_mib: Math.round(peakRss / 2 ** 20), worst_healthz_ms: Math.round(worstHealthz), wall_ms: Math.round(wallMs), routes };
  } finally {
    await b.stop();
  }
}

const out = [await scenario('one session', 1), await scenario('one principal, a session per call', CALLS)];
// Past the fast path's own cap (4 runs at once by default on a 2-core host): what the total is held to.
const more = arg('more-calls', 16);
if (more > CALLS) out.push(await scenarioWith('one principal, a session per call, past the cap', more));
if (process.argv.includes('--json')) console.log(JSON.stringify(out));
else for (const o of out) console.log(o);
