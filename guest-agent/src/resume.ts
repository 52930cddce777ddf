import { existsSync } from 'node:fs';
import { runProcess } from './process/run-process.ts';
import type { ResultOf } from './protocol/methods.ts';

/** The helper baked into the guest image (guest-agent/native/hutch-resume.c). */
const RESUME_HELPER = process.env['HUTCH_RESUME_HELPER'] ?? '/opt/hutch/hutch-resume';
/** The helper is the first process after a restore: slow under TCG (empty translation cache). */
const RESUME_TIMEOUT_MS = 20_000;

/**
 * Every VM restored from one snapshot starts with the same kernel RNG state and the
 * clock of the moment the snapshot was taken. The broker hands over entropy and its time
 * right after the restore handshake; hutch-resume adds the entropy, forces the CRNG to
 * reseed (a plain write to /dev/urandom would not change what clones read for up to a
 * minute), and sets the clock. Only an agent that owns its machine (in a VM) does this,
 * never one on a host.
 *
 * The answer says what really happened: reseeded and clockSet only when the helper says
 * so, with its reason otherwise, and the guest's clock read afterwards, so the broker
 * can check it. The broker pushes the workspace while this runs (requests are
 * concurrent), and tenant commands wait for it (`onClockPending`), so none sees the stale
 * clock or the shared RNG.
 */
export async function resumeAfterRestore(
  p: { unixTimeMs: number; entropy: Uint8Array; work?: { bytes: number; files: number } | undefined },
  ownsMachine: boolean,
  onClockPending: (done: Promise<void>) => void,
): Promise<ResultOf<'agent.resume'>> {
  const receivedMono = process.hrtime.bigint();
  const delta = p.unixTimeMs - Date.now();
  if (!ownsMachine) {
    return { clockDeltaMs: delta, clockSet: false, reseeded: false, guestNowMs: Date.now(), clockNote: "not in a VM: the clock and the RNG are the host's" };
  }
  if (!existsSync(RESUME_HELPER)) {
    return { clockDeltaMs: delta, clockSet: false, reseeded: false, guestNowMs: Date.now(), clockError: `${RESUME_HELPER} is missing from the guest image` };
  }
  // Sized first (a mount(8) is quick; the helper is slow under TCG), and tenant commands wait for it too.
  const sized = p.work ? sizeWork(p.work) : Promise.resolve(undefined);
  let out = '';
  let err = '';
  const run = runProcess({
    argv: [RESUME_HELPER, String(Math.round(p.unixTimeMs)), receivedMono.toString()],
    cwd: '/',
    env: { PATH: '/usr/bin:/bin' },
    stdin: p.entropy,
    timeoutMs: RESUME_TIMEOUT_MS,
    onStdout: (c) => void (out += c.toString()),
    onStderr: (c) => void (err += c.toString()),
  }).result;
  onClockPending(Promise.all([run, sized]).then(() => undefined, () => undefined));
  let failure: string | undefined;
  try {
    const r = await run;
    if (r.timedOut) failure = `hutch-resume timed out after ${RESUME_TIMEOUT_MS} ms`;
    else if (r.exitCode === 2 || r.exitCode === null) failure = `hutch-resume failed (${r.exitCode ?? r.signal}): ${err.trim().slice(0, 200)}`;
  } catch (e) {
    failure = `hutch-resume could not run: ${(e as Error).message}`;
  }
  const reseed = /reseed=(\S+)/.exec(out)?.[1];
  const clock = /clock=(.+)$/m.exec(out)?.[1]?.trim();
  const reseeded = reseed === 'ok';
  const clockSet = clock === 'ok';
  const problems = [failure, reseeded || failure ? undefined : `reseed: ${reseed ?? 'no answer'}`, clockSet || failure ? undefined : `clock: ${clock ?? 'no answer'}`].filter(Boolean);
  const workError = await sized;
  return { clockDeltaMs: delta, clockSet, reseeded, guestNowMs: Date.now(), ...(problems.length ? { clockError: problems.join('; ') } : {}), ...(workError ? { workError } : {}) };
}

/** Inodes beyond the quota's entries: the root, and the sync's temporary files while a push replaces a file. */
const WORK_SPARE_INODES = 16;

/**
 * Sizes the tmpfs at /work from the session's quota (the kernel command line's work_size is
 * one size for every VM restored from the snapshot), so a tenant command there hits ENOSPC at
 * the quota. Returns why it could not, or undefined.
 */
async function sizeWork(q: { bytes: number; files: number }): Promise<string | undefined> {
  let err = '';
  try {
    const r = await runProcess({
      argv: ['mount', '-o', `remount,size=${q.bytes},nr_inodes=${q.files + WORK_SPARE_INODES}`, '/work'],
      cwd: '/',
      env: { PATH: '/usr/sbin:/usr/bin:/sbin:/bin' },
      timeoutMs: RESUME_TIMEOUT_MS,
      onStderr: (c) => void (err += c.toString()),
    }).result;
    return r.exitCode === 0 ? undefined : `remounting /work failed (${r.exitCode ?? r.signal}): ${err.trim().slice(0, 200)}`;
  } catch (e) {
    return `remounting /work could not run: ${(e as Error).message}`;
  }
}
