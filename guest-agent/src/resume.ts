import { appendFileSync } from 'node:fs';
import { runProcess } from './process/run-process.ts';
import type { ResultOf } from './protocol/methods.ts';

/** Below this the guest clock is left alone: setting it costs a process start. */
const CLOCK_TOLERANCE_MS = 50;
/** `date -s` is the first process after a restore: slow under TCG (empty translation cache). */
const CLOCK_SET_TIMEOUT_MS = 20_000;

/**
 * Every VM restored from one snapshot starts with the same kernel RNG state and the
 * clock of the moment the snapshot was taken. The broker hands over entropy and its
 * time right after the restore handshake; the clock is only set when this agent owns
 * its machine (in a VM), never on a host.
 *
 * The answer says what really happened: the clock is reported set only once `date -s`
 * succeeded, and the guest's clock is read after it, so the broker can check it. The
 * broker pushes the workspace while this runs (requests are concurrent), and tenant
 * commands wait for it (`onClockPending`), so none ever sees the stale clock.
 */
export async function resumeAfterRestore(
  p: { unixTimeMs: number; entropy: Uint8Array },
  ownsMachine: boolean,
  onClockPending: (done: Promise<void>) => void,
): Promise<ResultOf<'agent.resume'>> {
  const received = Date.now();
  let reseeded = false;
  try {
    // Written data is mixed into the input pool: later reads differ between clones.
    appendFileSync('/dev/urandom', p.entropy);
    reseeded = true;
  } catch {
    // not fatal: a host agent may run without /dev
  }
  const delta = p.unixTimeMs - received;
  if (!ownsMachine || Math.abs(delta) <= CLOCK_TOLERANCE_MS) {
    return { clockDeltaMs: delta, clockSet: false, reseeded, guestNowMs: Date.now(), ...(ownsMachine ? {} : { clockNote: 'not in a VM: the clock is the host\'s' }) };
  }
  // The broker's time plus what has passed here since it arrived (by the monotonic clock).
  const t0 = performance.now();
  let stderr = '';
  const run = runProcess({
    argv: ['date', '-u', '-s', `@${((p.unixTimeMs + (performance.now() - t0)) / 1000).toFixed(3)}`],
    cwd: '/',
    env: { PATH: '/usr/bin:/bin' },
    timeoutMs: CLOCK_SET_TIMEOUT_MS,
    onStderr: (c) => void (stderr += c.toString()),
  }).result;
  const done = run.then(() => undefined, () => undefined);
  onClockPending(done);
  let clockError: string | undefined;
  try {
    const r = await run;
    if (r.exitCode !== 0) clockError = `date -s exited ${r.exitCode ?? r.signal}${r.timedOut ? ' (timed out)' : ''}: ${stderr.trim().slice(0, 200)}`;
  } catch (err) {
    clockError = `date -s could not run: ${(err as Error).message}`;
  }
  return { clockDeltaMs: delta, clockSet: clockError === undefined, reseeded, guestNowMs: Date.now(), ...(clockError ? { clockError } : {}) };
}
