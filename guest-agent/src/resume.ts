import { appendFileSync } from 'node:fs';
import { runProcess } from './process/run-process.ts';
import type { ResultOf } from './protocol/methods.ts';

/**
 * Every VM restored from one snapshot starts with the same kernel RNG state and the
 * clock of the moment the snapshot was taken. The broker hands over entropy and its
 * time right after the restore handshake; the clock is only set when this agent owns
 * its machine (in a VM), never on a host.
 */
export async function resumeAfterRestore(
  p: { unixTimeMs: number; entropy: Uint8Array },
  ownsMachine: boolean,
  /** Receives the clock update, which runs in the background (see below). */
  onClockPending: (done: Promise<void>) => void,
): Promise<ResultOf<'agent.resume'>> {
  let reseeded = false;
  try {
    // Written data is mixed into the input pool: later reads differ between clones.
    appendFileSync('/dev/urandom', p.entropy);
    reseeded = true;
  } catch {
    // not fatal: a host agent may run without /dev
  }
  const delta = p.unixTimeMs - Date.now();
  let clockSet = false;
  if (ownsMachine && Math.abs(delta) > 50) {
    // Setting the clock needs a process (date -s), and the first process after a restore
    // is slow under TCG (empty translation cache). It runs while the broker pushes the
    // workspace; tenant commands wait for it, so none ever sees the stale clock.
    // The clock lands behind by date's own start-up time (sub-second): fine for mtimes and logs.
    const done = runProcess({ argv: ['date', '-u', '-s', `@${(p.unixTimeMs / 1000).toFixed(3)}`], cwd: '/', env: { PATH: '/usr/bin:/bin' }, timeoutMs: 10_000 })
      .result.then(() => undefined, () => undefined);
    onClockPending(done);
    clockSet = true;
  }
  return { clockDeltaMs: delta, clockSet, reseeded };
}
