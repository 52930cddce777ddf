import { existsSync } from 'node:fs';
import { PassThrough } from 'node:stream';
import { runProcess } from './process/run-process.ts';
import type { ResultOf } from './protocol/methods.ts';
import type { Logger } from './log.ts';

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
  if (resident?.alive) {
    const asked = resident.ask(`${Math.round(p.unixTimeMs)} ${receivedMono} ${Buffer.from(p.entropy).toString('hex') || '00'} ${p.work?.bytes ?? 0} ${p.work?.files !== undefined ? p.work.files + WORK_SPARE_INODES : 0}\n`);
    onClockPending(asked.then(() => undefined, () => undefined));
    let answer: string;
    try {
      answer = await asked;
    } catch (e) {
      return { clockDeltaMs: delta, clockSet: false, reseeded: false, guestNowMs: Date.now(), clockError: (e as Error).message };
    }
    const field = (k: string) => new RegExp(`${k}=(\\S+)`).exec(answer)?.[1]?.replace(/_/g, ' ');
    const [reseed, clock, work] = [field('reseed'), field('clock'), field('work')];
    const problems = [reseed === 'ok' ? undefined : `reseed: ${reseed ?? 'no answer'}`, clock === 'ok' ? undefined : `clock: ${clock ?? 'no answer'}`].filter(Boolean);
    const workError = p.work && work !== 'ok' ? (work ?? 'no answer') : undefined;
    return { clockDeltaMs: delta, clockSet: clock === 'ok', reseeded: reseed === 'ok', guestNowMs: Date.now(), ...(problems.length ? { clockError: problems.join('; ') } : {}), ...(workError ? { workError } : {}) };
  }
  if (!existsSync(RESUME_HELPER)) {
    return { clockDeltaMs: delta, clockSet: false, reseeded: false, guestNowMs: Date.now(), clockError: `${RESUME_HELPER} is missing from the guest image` };
  }
  // No resident helper (it died, or this image's helper predates --serve): one process per resume.
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

/**
 * hutch-resume --serve, started by the agent when it comes up in a VM, before the pristine
 * snapshot is taken, and waiting on its stdin in every VM restored from it. A resume is then
 * one line written and one read: no fork of the agent and exec of a helper (nor of mount(8))
 * on the wake's critical path, where under TCG the first fork after a restore costs hundreds
 * of ms. One request at a time; answers come back in order.
 */
class ResidentHelper {
  alive = true;
  /** The helper's stdin: runProcess streams it (a PassThrough is an async iterable of its chunks). */
  private readonly input = new PassThrough();
  private readonly waiting: Array<{ resolve: (line: string) => void; reject: (e: Error) => void }> = [];
  private buffered = '';
  private readonly kill: (sig: NodeJS.Signals) => boolean;

  constructor(path: string, log?: Logger) {
    // Nothing is written once the helper is gone (ask() needs `alive`); a late error is not the agent's to die of.
    this.input.on('error', () => undefined);
    const proc = runProcess({
      argv: [path, '--serve'],
      cwd: '/',
      env: { PATH: '/usr/bin:/bin' },
      stdin: this.input,
      onStdout: (c) => this.onOutput(c.toString()),
      onStderr: (c) => log?.warn('resume.helper_stderr', { text: c.toString().slice(0, 200) }),
      killGroupOnExit: true,
    });
    this.kill = proc.kill;
    proc.result.then(
      (r) => this.died(`hutch-resume --serve exited (${r.exitCode ?? r.signal})`),
      (e: unknown) => this.died(`hutch-resume --serve could not run: ${(e as Error).message}`),
    );
  }

  ask(line: string): Promise<string> {
    return new Promise<string>((resolve, reject) => {
      const timer = setTimeout(() => {
        // A helper that does not answer is of no more use: the next resume runs one of its own.
        this.kill('SIGKILL');
        this.died(`hutch-resume --serve did not answer within ${RESUME_TIMEOUT_MS} ms`);
      }, RESUME_TIMEOUT_MS);
      this.waiting.push({
        resolve: (l) => (clearTimeout(timer), resolve(l)),
        reject: (e) => (clearTimeout(timer), reject(e)),
      });
      this.input.write(line);
    });
  }

  private onOutput(text: string): void {
    this.buffered += text;
    for (let nl = this.buffered.indexOf('\n'); nl >= 0; nl = this.buffered.indexOf('\n')) {
      const line = this.buffered.slice(0, nl);
      this.buffered = this.buffered.slice(nl + 1);
      this.waiting.shift()?.resolve(line);
    }
  }

  private died(why: string): void {
    this.alive = false;
    this.input.end();
    for (const w of this.waiting.splice(0)) w.reject(new Error(why));
  }
}

let resident: ResidentHelper | undefined;

/** Starts the resident helper (the agent in a VM, at start-up, so every snapshot holds it waiting). */
export function startResumeHelper(log?: Logger): void {
  if (resident?.alive || !existsSync(RESUME_HELPER)) return;
  resident = new ResidentHelper(RESUME_HELPER, log);
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
