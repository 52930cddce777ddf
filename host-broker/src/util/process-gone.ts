import { readFileSync } from 'node:fs';
import { performance } from 'node:perf_hooks';

/**
 * Waiting for a process that is not our child: the QEMU inside a bwrap wrapper. The
 * wrapper's exit is not QEMU's: the stop signal kills bwrap's outer process at once, and the
 * kernel kills the QEMU in its pid namespace afterwards, asynchronously (measured: right after
 * the wrapper's exit, QEMU was still running or a zombie in 9 of 10 stops). Node cannot wait
 * for a process it did not spawn, so this polls /proc.
 */

/** State (field 3) and start time (field 22, clock ticks since boot) of /proc/PID/stat; undefined once the pid is gone. */
export function procStat(pid: number): { state: string; startTicks: number } | undefined {
  let text: string;
  try {
    text = readFileSync(`/proc/${pid}/stat`, 'utf8');
  } catch {
    return undefined;
  }
  // comm (field 2) may hold spaces and parentheses: what follows it starts after the last ')'.
  const rest = text.slice(text.lastIndexOf(')') + 2).split(' ');
  return { state: rest[0] ?? '?', startTicks: Number(rest[19]) };
}

export interface GoneOptions {
  /** Poll interval. */
  pollMs?: number;
  /** SIGKILL the process itself if it is still there after this long. */
  killAfterMs?: number;
  /** Stop waiting after this long (a process stuck in the kernel); the answer is then false. */
  giveUpMs?: number;
}

/**
 * Resolves true once the process that started at `startTicks` has exited: its pid gone, a
 * zombie (its memory released, no code of its own left to run), or the pid reused by a
 * process that started later. False if it was still there after `giveUpMs`, SIGKILL included.
 */
export async function processGone(pid: number, startTicks: number, opts: GoneOptions = {}): Promise<boolean> {
  const pollMs = opts.pollMs ?? 5;
  const killAfterMs = opts.killAfterMs ?? 5_000;
  const giveUpMs = opts.giveUpMs ?? 15_000;
  const t0 = performance.now();
  let killed = false;
  for (;;) {
    const s = procStat(pid);
    if (!s || s.startTicks !== startTicks || s.state === 'Z' || s.state === 'X') return true;
    const ms = performance.now() - t0;
    if (ms >= giveUpMs) return false;
    if (!killed && ms >= killAfterMs) {
      killed = true;
      try {
        process.kill(pid, 'SIGKILL');
      } catch {
        // gone meanwhile (or not ours to kill: then giving up says so)
      }
    }
    await new Promise((r) => setTimeout(r, pollMs));
  }
}
