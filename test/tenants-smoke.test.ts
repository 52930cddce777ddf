import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { describe, expect, it } from 'vitest';

const run = promisify(execFile);

/**
 * CI smoke of the density bench: the quick run (a real broker, real VMs, real WebSocket
 * tenants replaying the repo's own recorded sessions, compressed time) must finish with
 * every call matching its recorded outcome. Latency is the bench's business, not this test's.
 */
describe('bench/tenants.ts --quick', { tags: ['vm'] }, () => {
  it('replays tenants through a real broker with no errors and reports the agreed keys', async () => {
    const { stdout, stderr } = await run(process.execPath, ['--import', 'tsx', 'bench/tenants.ts', '--quick', '--json', '--sessions', 'examples/sessions', '--projects', 'examples/projects'], { timeout: 420_000, maxBuffer: 64 * 1024 * 1024 });
    const last = stdout.trim().split('\n').at(-1) ?? '';
    let summary: Record<string, unknown>;
    try {
      summary = JSON.parse(last) as Record<string, unknown>;
    } catch {
      throw new Error(`the last line is not JSON: ${last.slice(0, 200)}\nstderr tail: ${stderr.slice(-2000)}`);
    }
    for (const k of ['accel', 'level', 'tenants', 'calls', 'wakes', 'errors', 'p50_added_ms', 'p99_added_ms', 'peak_host_mib', 'time_compression', 'max_tenants_broker_rule', 'level4_over_level1', 'levels']) expect(summary, `key ${k}`).toHaveProperty(k);
    const levels = summary['levels'] as Array<Record<string, unknown>>;
    expect(levels.map((l) => l['level'])).toEqual(['4']);
    expect(levels[0]).toHaveProperty('max_tenants_broker_rule');
    expect(levels[0]).toHaveProperty('host_mib_per_tenant');
    expect(summary['unavailable'], String(summary['unavailable'])).toBeUndefined();
    expect(summary['level']).toBe('4');
    expect(summary['time_compression']).toBeGreaterThan(1);
    expect(summary['calls_total'], `no call completed; stderr tail: ${stderr.slice(-2000)}`).toBeGreaterThan(0);
    expect(summary['errors_total'], `errors; stdout: ${stdout.slice(-4000)}`).toBe(0);
  }, 480_000);
});
