/**
 * Every bench runs to its JSON line. A bench nobody runs rots: lifecycle.ts crashed after
 * its wakes once the per-principal session limit came in, and its README figures could no
 * longer be reproduced. Each bench here runs in its `--quick` mode (seconds for the host
 * ones; the least that still runs every part once for the VM ones) with `--json`, and its
 * last line must be one JSON object with the keys the bench documents. The numbers of a
 * quick run are not measurements and are not judged.
 */
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { clusterSkipReason } from './helpers/cluster.ts';

const repo = resolve(import.meta.dirname, '..');

interface Bench {
  name: string;
  /** Keys the bench documents for its last line. */
  keys: string[];
  /** A bound on a hang (a quick run takes a fraction of it), not a timing assertion. */
  timeoutMs: number;
  args?: () => string[];
  /** Why it cannot run here (logged, and the test skipped), or undefined. */
  skip?: string | undefined;
}

/** Runs one bench in its quick mode; its exit code, its last stdout line and the tail of stderr. */
function runBench(b: Bench): Promise<{ code: number | null; last: string; stderr: string }> {
  return new Promise((done, fail) => {
    const p = spawn(process.execPath, ['--import', 'tsx', `bench/${b.name}.ts`, '--quick', '--json', ...(b.args?.() ?? [])], { cwd: repo, stdio: ['ignore', 'pipe', 'pipe'], detached: true });
    let out = '';
    let err = '';
    p.stdout.on('data', (d: Buffer) => (out = (out + d.toString()).slice(-1_000_000)));
    p.stderr.on('data', (d: Buffer) => (err = (err + d.toString()).slice(-8_000)));
    const timer = setTimeout(() => {
      if (p.pid !== undefined) process.kill(-p.pid, 'SIGKILL');
      fail(new Error(`bench/${b.name}.ts --quick did not end within ${b.timeoutMs} ms; stderr: ${err.slice(-2000)}`));
    }, b.timeoutMs);
    p.once('exit', (code) => {
      clearTimeout(timer);
      const lines = out.split('\n').filter((l) => l.trim() !== '');
      done({ code, last: lines.at(-1) ?? '', stderr: err });
    });
  });
}

function check(b: Bench): void {
  if (b.skip) console.log(`SKIPPING bench/${b.name}.ts in test/benches.test.ts: ${b.skip}`);
  it.skipIf(b.skip !== undefined)(`bench/${b.name}.ts --quick --json ends with its JSON line`, async () => {
    const r = await runBench(b);
    expect(r.code, `exit code; stderr: ${r.stderr.slice(-2000)}`).toBe(0);
    let summary: Record<string, unknown>;
    try {
      summary = JSON.parse(r.last) as Record<string, unknown>;
    } catch {
      throw new Error(`the last line of bench/${b.name}.ts is not JSON: ${r.last.slice(0, 500)}`);
    }
    expect(typeof summary === 'object' && summary !== null && !Array.isArray(summary)).toBe(true);
    for (const k of b.keys) expect(summary, `bench/${b.name}.ts: ${k}`).toHaveProperty(k);
  }, b.timeoutMs + 10_000);
}

const HOST_BENCHES: Bench[] = [
  { name: 'protocol', keys: ['throughput_ratio', 'raw_mb_s', 'proto_mb_s', 'rpc_p50_us', 'rpc_p99_us'], timeoutMs: 120_000 },
  { name: 'sync-scan', keys: ['scan_p50_ms', 'baseline_scan_p50_ms', 'speedup'], timeoutMs: 120_000 },
  { name: 'loop-gaps', keys: ['entries', 'deep_chain_depth', 'worst_gap_ms', 'total_ms', 'baseline_worst_gap_ms'], timeoutMs: 180_000 },
  { name: 'router', keys: ['init_ms', 'parse_p50_us', 'parse_p99_us', 'route_p50_us', 'route_p99_us', 'spawn_p50_us', 'route_vs_spawn', 'fastpath_share_bash_calls', 'fastpath_share_all_calls'], timeoutMs: 120_000 },
  { name: 'fastpath', keys: ['ratio', 'ratio_big_heap', 'fastpath_over_raw_ms', 'fastpath_over_raw_strict_ms', 'fastpath_over_raw_big_heap_ms', 'bwrap_growth_big_heap', 'inprocess_read_p50_ms', 'ws_exec_p50_ms'], timeoutMs: 180_000 },
  { name: 'guest-flood', keys: ['loop_busy_guarded', 'loop_busy_unguarded', 'guarded_over_unguarded_busy', 'hostile_loop_share_guarded', 'honest_ping_p50_ms', 'honest_ping_p99_ms', 'worst_gap_ms'], timeoutMs: 180_000 },
  { name: 'gateway', keys: ['direct_p50_ms', 'via_gateway_p50_ms', 'added_p50_ms', 'added_p99_ms'], timeoutMs: 180_000, skip: clusterSkipReason() },
];

describe.concurrent('host benches run to their JSON line', () => {
  for (const b of HOST_BENCHES) check(b);
});

const templatesDir = mkdtempSync(join(tmpdir(), 'hutch-bench-test-templates-'));
afterAll(() => rmSync(templatesDir, { recursive: true, force: true }));

const VM_BENCHES: Bench[] = [
  { name: 'qemu-jail', keys: ['jailed_restore_ms', 'plain_restore_ms', 'restore_jail_over_plain', 'jailed_snapshot_ms', 'plain_snapshot_ms', 'snapshot_jail_over_plain', 'state_mib'], timeoutMs: 600_000 },
  // A data dir of its own: the default template only, never the operator's templates.
  { name: 'templates', keys: ['templates.default.restoreMs', 'templates.default.wakeMs', 'templates.default.snapshotBytes'], timeoutMs: 600_000, args: () => ['--data-dir', templatesDir] },
  {
    name: 'lifecycle',
    keys: ['wake_p50_ms', 'wake_p99_ms', 'wake_over_restore', 'restore_ms', 'wake_phases_ms', 'standby_refill_p50_ms', 'restore_wake_p50_ms', 'restore_wake_phases_ms', 'first_call_p50_ms', 'first_call_after_pending_p50_ms', 'release_kill_ms', 'release_snapshot_ms', 'slot_restore_ms', 'push_mb_s', 'idle_host_mib_per_session'],
    timeoutMs: 900_000,
  },
  {
    name: 'vm',
    keys: ['cold_boot_ms', 'restore_ms', 'restore_over_boot', 'private_mib_per_idle_vm', 'pss_mib_per_idle_vm', 'private_mib_after_call', 'tcg_tb_mib', 'private_mib_excl_tcg', 'guest_ram_private_mib', 'qemu_own_private_mib_excl_tcg', 'private_mib_excl_tcg_idle_policy', 'unittest_cpu_ms_preloaded', 'unittest_cpu_ms_cold'],
    timeoutMs: 1_200_000,
  },
  { name: 'soak', keys: ['cycles', 'calls', 'hangs', 'lost_files', 'half_written', 'leaked_processes', 'leaked_files', 'faults_injected'], timeoutMs: 900_000 },
  { name: 'tenants', keys: ['accel', 'level', 'tenants', 'calls', 'wakes', 'errors', 'p50_added_ms', 'p99_added_ms', 'max_tenants_broker_rule'], timeoutMs: 900_000 },
  { name: 'damon', keys: ['search_previous_occupied_mib', 'search_previous_cache_mib', 'search_previous_runtime_s', 'search_tuned_occupied_mib', 'search_tuned_cache_mib', 'search_tuned_runtime_s'], timeoutMs: 900_000 },
  { name: 'egress', keys: ['accel', 'proxy_over_host', 'download_mb_s', 'connect_added_p50_ms', 'ttfb_p50_ms', 'loop_delay_ms', 'parallel_mb_s'], timeoutMs: 900_000 },
  { name: 'wakeup-memory', keys: ['python_stock_swap_mb_read', 'python_stock_wake_ms', 'python_stock_idle_host_mib', 'python_stock_idle_rss_mib'], timeoutMs: 900_000 },
];

describe('VM benches run to their JSON line', { tags: ['vm'] }, () => {
  for (const b of VM_BENCHES) check(b);
});
