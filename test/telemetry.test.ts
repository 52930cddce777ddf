import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { BrokerMetrics } from '../host-broker/src/metrics.ts';
import type { TelemetrySample } from '../guest-agent/src/protocol/methods-telemetry.ts';
import type { TelemetryEvent } from '../host-broker/src/sdk/index.ts';
import type { Hutch } from '../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from './helpers/broker.ts';

function fakeSample(comms: string[]): TelemetrySample {
  const zero = { pswpin: 0, pswpout: 0, zswpin: 0, zswpout: 0, workingset_refault_anon: 0, workingset_refault_file: 0, pgmajfault: 0 };
  return {
    atMs: 0,
    uptimeS: 1,
    memory: { totalBytes: 100, freeBytes: 50, availableBytes: 60, cacheBytes: 10, anonBytes: 20, swapUsedBytes: 0, zswapPoolBytes: 0, zswapStoredBytes: 0 },
    vmstat: zero,
    vmstatDelta: { ...zero, pgmajfault: 3 },
    processes: comms.map((comm, i) => ({ pid: i + 1, comm, cpuPercent: 1, rssBytes: 1000 + i, agent: false })),
  };
}

describe('guest telemetry metrics', () => {
  it('keeps label sets bounded however many process names guests have', async () => {
    const m = new BrokerMetrics();
    const comms = Array.from({ length: 40 }, (_, i) => `proc${i}`);
    m.setGuestGauges([{ vm: 'live', sample: fakeSample(comms) }, { vm: 'reclaimed' }, { vm: 'none' }]);
    const text = await m.text();
    const series = text.split('\n').filter((l) => l.startsWith('hutch_guest_process_rss_bytes{'));
    expect(series.length).toBeLessThanOrEqual(13);
    expect(text).toMatch(/hutch_guest_process_rss_bytes\{comm="other"\}/);
    expect(text).toMatch(/hutch_guest_vms\{state="reclaimed"\} 1/);
    expect(text).toMatch(/hutch_guest_memory_bytes\{kind="total"\} 100/);
  });
});

/** Real VM: the agent samples its guest; the broker exports it on /metrics and as a WebSocket subscription. */
describe('telemetry from a real VM', { tags: ['vm'] }, () => {
  let b: TestBroker;
  let hutch: Hutch;
  beforeAll(async () => {
    b = await startBroker({ backend: 'qemu', policy: { idleMs: 600_000 } });
    hutch = await b.connect();
  }, 1_800_000);
  afterAll(async () => {
    await b?.stop();
  });

  it('streams samples of a live VM with its processes, and exports per-call and guest metrics', async () => {
    const sb = await hutch.create({});
    // A long-lived tenant process, outside the call's process group so it survives the call.
    const r = await sb.run('setsid sleep 600 > /dev/null 2>&1 < /dev/null & python3 -c "print(sum(range(1000)))"', { route: 'vm' });
    expect(r.stdout.trim()).toBe('499500');
    const events: TelemetryEvent[] = [];
    const res = await hutch.telemetry({ session: sb.id, intervalMs: 200, count: 3, onSample: (e) => events.push(e) });
    expect(res.samples).toBe(3);
    expect(events).toHaveLength(3);
    expect(events.map((e) => e.sessions[0]?.vm)).toEqual(['live', 'live', 'live']);
    // Under a loaded emulator one sample may miss the broker's deadline; it says so, and the others arrive.
    const s = events.map((e) => e.sessions[0]).find((x) => x?.sample);
    expect(s?.session).toBe(sb.id);
    const sample = s?.sample;
    expect(sample?.memory.totalBytes).toBeGreaterThan(100 * 1024 * 1024);
    expect(sample?.memory.availableBytes).toBeLessThanOrEqual(sample?.memory.totalBytes ?? 0);
    expect(sample?.processes.find((p) => p.agent)?.rssBytes).toBeGreaterThan(1024 * 1024);
    expect(sample?.processes.some((p) => p.comm === 'sleep' && !p.agent)).toBe(true);
    // The agent runs through the agent layer's loader; telemetry still names it for what it is.
    expect(sample?.processes.find((p) => p.agent)?.comm).toBe('hutch-agent');
    expect(sample?.psiMemory).toBeDefined();

    const metrics = await (await fetch(`${b.url.replace('ws:', 'http:')}/metrics`, { headers: { authorization: `Bearer ${b.token}` } })).text();
    expect(metrics).toMatch(/hutch_call_major_faults_count [1-9]/);
    expect(metrics).toMatch(/hutch_guest_memory_bytes\{kind="total"\} [1-9]/);
    expect(metrics).toMatch(/hutch_guest_process_rss_bytes\{comm="sleep"\} [1-9]/);
    expect(metrics).toMatch(/hutch_guest_vms\{state="live"\} 1/);
    await sb.close();
  }, 900_000);

  it('ends a subscription when the client aborts it, and refuses unknown sessions', async () => {
    const ac = new AbortController();
    let n = 0;
    const done = hutch.telemetry({ intervalMs: 100, signal: ac.signal, onSample: () => void (++n === 2 && ac.abort()) });
    const r = await done;
    expect(r.cancelled).toBe(true);
    expect(n).toBeGreaterThanOrEqual(2);
    await expect(hutch.telemetry({ session: 'no-such-session', count: 1, onSample: () => undefined })).rejects.toMatchObject({ code: 'not_found' });
  }, 60_000);
});
