/**
 * What a guest that is no longer ours (a tenant with root in it) can take from the broker's
 * event loop by flooding its agent channel with costly frames (1 MiB of empty msgpack maps
 * answering a request nobody made; test/helpers/hostile-guest.ts), with the broker's loop
 * share for a guest (the default, GUEST_LOOP_SHARE) and without it (the previous code),
 * alternating in one run. Meanwhile another guest on the same loop is pinged every 50 ms.
 * `npx tsx bench/guest-flood.ts [--json] [--seconds N] [--rounds N]`
 *
 *   loop_busy_{paced,unpaced}       event loop utilisation during the flood (0..1)
 *   hostile_loop_share_paced        loop time charged to the flooding guest over the flood's time
 *   honest_ping_p50_ms / _p99_ms    the other guest's pings, one due every 50 ms, timed from when
 *                                   each was due to its answer: quiet (no flood), paced, unpaced
 *   worst_gap_ms                    the longest the loop went without a turn (1 ms interval),
 *                                   paced and unpaced: one frame's decode either way
 *   paced_over_unpaced_busy         loop_busy_paced / loop_busy_unpaced
 */
import { performance } from 'node:perf_hooks';
import { GUEST_LOOP_SHARE } from '../guest-agent/src/protocol/loop-share.ts';
import { flood, guestPair } from '../test/helpers/hostile-guest.ts';
import { benchArgs, emit, markdownTable, median, percentile, round } from './lib/report.ts';
import { watchLoop } from './lib/loop-watch.ts';

const args = benchArgs();
const opt = (name: string, dflt: number) => {
  const i = args.argv.indexOf(name);
  return i >= 0 ? Number(args.argv[i + 1]) : dflt;
};
const SECONDS = opt('--seconds', 4);
const ROUNDS = opt('--rounds', 3);

type Mode = 'quiet' | 'paced' | 'unpaced';
interface Sample { mode: Mode; busy: number; gapMs: number; pings: number[]; hostileShare: number | null; framesWritten: number }

async function run(mode: Mode): Promise<Sample> {
  const honest = await guestPair({ paced: true });
  const hostile = await guestPair({ paced: mode !== 'unpaced' });
  try {
    await new Promise((r) => setTimeout(r, 100));
    const pings: number[] = [];
    const watch = watchLoop();
    const elu0 = performance.eventLoopUtilization();
    const t0 = performance.now();
    const f = mode === 'quiet' ? undefined : flood(hostile);
    // A ping is due every 50 ms; its time counts from when it was due, so a loop held by
    // the flood (the timer firing late) shows up in it, not only the round trip.
    for (let due = t0; due - t0 < SECONDS * 1000; due += 50) {
      const wait = due - performance.now();
      if (wait > 0) await new Promise((r) => setTimeout(r, wait));
      await honest.client.connection.request('ping', {});
      pings.push(performance.now() - due);
    }
    f?.stop();
    const elapsed = performance.now() - t0;
    const busy = performance.eventLoopUtilization(elu0).utilization;
    const gap = await watch.stop();
    const charged = hostile.client.connection.pacing.chargedMs;
    return { mode, busy, gapMs: gap, pings, hostileShare: mode === 'paced' ? charged / elapsed : null, framesWritten: f?.written() ?? 0 };
  } finally {
    hostile.close();
    honest.close();
    await new Promise((r) => setTimeout(r, 300)); // let the last frames drain away
  }
}

const samples: Sample[] = [];
for (let r = 0; r < ROUNDS; r++) {
  for (const mode of ['quiet', 'paced', 'unpaced'] as const) {
    const s = await run(mode);
    samples.push(s);
    process.stderr.write(`[guest-flood] round ${r + 1}/${ROUNDS} ${mode}: loop busy ${s.busy.toFixed(2)}, worst gap ${s.gapMs.toFixed(0)} ms, ping p50 ${median(s.pings).toFixed(1)} ms (${s.pings.length} pings)\n`);
  }
}
const of = (m: Mode) => samples.filter((s) => s.mode === m);
const med = (m: Mode, f: (s: Sample) => number) => round(median(of(m).map(f)), 3);
const pingsOf = (m: Mode) => of(m).flatMap((s) => s.pings);
const summary = {
  seconds: SECONDS,
  rounds: ROUNDS,
  loop_share: GUEST_LOOP_SHARE,
  loop_busy_paced: med('paced', (s) => s.busy),
  loop_busy_unpaced: med('unpaced', (s) => s.busy),
  paced_over_unpaced_busy: round(med('paced', (s) => s.busy) / med('unpaced', (s) => s.busy), 2),
  hostile_loop_share_paced: med('paced', (s) => s.hostileShare ?? 0),
  honest_ping_p50_ms: { quiet: round(median(pingsOf('quiet')), 1), paced: round(median(pingsOf('paced')), 1), unpaced: round(median(pingsOf('unpaced')), 1) },
  honest_ping_p99_ms: { quiet: round(percentile(pingsOf('quiet'), 99), 1), paced: round(percentile(pingsOf('paced'), 99), 1), unpaced: round(percentile(pingsOf('unpaced'), 99), 1) },
    worst_gap_ms: { paced: med('paced', (s) => s.gapMs), unpaced: med('unpaced', (s) => s.gapMs) },
};
const rows = (['quiet', 'paced', 'unpaced'] as const).map((m) => ({
  flood: m,
  loop_busy: med(m, (s) => s.busy),
  honest_ping_p50_ms: round(median(pingsOf(m)), 1),
  honest_ping_p99_ms: round(percentile(pingsOf(m), 99), 1),
  worst_gap_ms: med(m, (s) => s.gapMs),
}));
emit(`A guest flooding its channel with costly frames (${SECONDS} s, ${ROUNDS} rounds, share ${GUEST_LOOP_SHARE.share}, burst ${GUEST_LOOP_SHARE.burstMs} ms)`, markdownTable(rows), summary, args.json ? samples.map((s) => ({ ...s, pings: s.pings.map((p) => round(p, 1)) })) : undefined);
process.exit(0);
