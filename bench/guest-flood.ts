/**
 * What a guest that is no longer ours (a tenant with root in it) can take from the broker's
 * event loop by flooding its agent channel with costly 1 MiB frames answering a request
 * nobody made (test/helpers/hostile-guest.ts), guarded (the default: the guest's loop share,
 * GUEST_LOOP_SHARE, and the shape check of its frames, GUEST_FRAME_SHAPE_LIMITS) and
 * unguarded (the previous code), alternating in one run. Each is sent the costliest frame
 * it lets through: guarded, timestamps up to the object limit then fixints; unguarded,
 * empty maps. Meanwhile another guest on the same loop is pinged every 50 ms.
 * `npx tsx bench/guest-flood.ts [--json] [--quick] [--seconds N] [--rounds N]`
 *
 *   loop_busy_{guarded,unguarded}   event loop utilisation during the flood (0..1)
 *   hostile_loop_share_guarded      loop time charged to the flooding guest over the flood's time
 *   honest_ping_p50_ms / _p99_ms    the other guest's pings, one due every 50 ms, timed from when
 *                                   each was due to its answer: quiet (no flood), guarded, unguarded
 *   worst_gap_ms                    the longest the loop went without a turn (1 ms interval):
 *                                   one frame's decode
 *   guarded_over_unguarded_busy     loop_busy_guarded / loop_busy_unguarded
 */
import { performance } from 'node:perf_hooks';
import { GUEST_LOOP_SHARE } from '../guest-agent/src/protocol/loop-share.ts';
import { GUEST_FRAME_SHAPE_LIMITS } from '../guest-agent/src/protocol/value-shape.ts';
import { flood, guestPair } from '../test/helpers/hostile-guest.ts';
import { benchArgs, emit, markdownTable, median, percentile, round } from './lib/report.ts';
import { watchLoop } from './lib/loop-watch.ts';

const args = benchArgs();
const opt = (name: string, dflt: number) => {
  const i = args.argv.indexOf(name);
  return i >= 0 ? Number(args.argv[i + 1]) : dflt;
};
/** --quick: seconds (one round of a second each), to check the bench still runs to its JSON line (test/benches.test.ts). */
const quick = args.argv.includes('--quick');
const SECONDS = opt('--seconds', quick ? 1 : 4);
const ROUNDS = opt('--rounds', quick ? 1 : 3);

type Mode = 'quiet' | 'guarded' | 'unguarded';
interface Sample { mode: Mode; busy: number; gapMs: number; pings: number[]; hostileShare: number | null; framesWritten: number }

async function run(mode: Mode): Promise<Sample> {
  const honest = await guestPair({ guarded: true });
  const hostile = await guestPair({ guarded: mode !== 'unguarded' });
  try {
    await new Promise((r) => setTimeout(r, 100));
    const pings: number[] = [];
    const watch = watchLoop();
    const elu0 = performance.eventLoopUtilization();
    const t0 = performance.now();
    // Each side gets the costliest frame it lets through.
    const f = mode === 'quiet' ? undefined : flood(hostile, mode === 'guarded' ? 'within-limits' : 'empty-maps');
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
    return { mode, busy, gapMs: gap, pings, hostileShare: mode === 'guarded' ? charged / elapsed : null, framesWritten: f?.written() ?? 0 };
  } finally {
    hostile.close();
    honest.close();
    await new Promise((r) => setTimeout(r, 300)); // let the last frames drain away
  }
}

const samples: Sample[] = [];
for (let r = 0; r < ROUNDS; r++) {
  for (const mode of ['quiet', 'guarded', 'unguarded'] as const) {
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
  frame_shape: GUEST_FRAME_SHAPE_LIMITS,
  loop_busy_guarded: med('guarded', (s) => s.busy),
  loop_busy_unguarded: med('unguarded', (s) => s.busy),
  guarded_over_unguarded_busy: round(med('guarded', (s) => s.busy) / med('unguarded', (s) => s.busy), 2),
  hostile_loop_share_guarded: med('guarded', (s) => s.hostileShare ?? 0),
  honest_ping_p50_ms: { quiet: round(median(pingsOf('quiet')), 1), guarded: round(median(pingsOf('guarded')), 1), unguarded: round(median(pingsOf('unguarded')), 1) },
  honest_ping_p99_ms: { quiet: round(percentile(pingsOf('quiet'), 99), 1), guarded: round(percentile(pingsOf('guarded'), 99), 1), unguarded: round(percentile(pingsOf('unguarded'), 99), 1) },
  worst_gap_ms: { guarded: round(med('guarded', (s) => s.gapMs), 1), unguarded: round(med('unguarded', (s) => s.gapMs), 1) },
};
const rows = (['quiet', 'guarded', 'unguarded'] as const).map((m) => ({
  flood: m,
  loop_busy: med(m, (s) => s.busy),
  honest_ping_p50_ms: round(median(pingsOf(m)), 1),
  honest_ping_p99_ms: round(percentile(pingsOf(m), 99), 1),
  worst_gap_ms: med(m, (s) => s.gapMs),
}));
emit(`A guest flooding its channel with costly frames (${SECONDS} s, ${ROUNDS} rounds, share ${GUEST_LOOP_SHARE.share}, burst ${GUEST_LOOP_SHARE.burstMs} ms, at most ${GUEST_FRAME_SHAPE_LIMITS.maxObjects} objects a frame)`, markdownTable(rows), summary, args.json ? samples.map((s) => ({ ...s, pings: s.pings.map((p) => round(p, 1)) })) : undefined);
process.exit(0);
