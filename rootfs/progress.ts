/**
 * Phase-by-phase progress for long builds: each phase prints when it starts
 * and how long it took, and a running total, so a slow step is obvious.
 */

export type LogFn = (message: string) => void;

export function defaultLog(message: string): void {
  process.stderr.write(`[rootfs] ${message}\n`);
}

export function fmtSeconds(s: number): string {
  return s >= 60 ? `${Math.floor(s / 60)}m${String(Math.round(s % 60)).padStart(2, "0")}s` : `${s.toFixed(1)}s`;
}

export function fmtBytes(n: number): string {
  if (n >= 1024 ** 3) return `${(n / 1024 ** 3).toFixed(2)} GiB`;
  if (n >= 1024 ** 2) return `${(n / 1024 ** 2).toFixed(1)} MiB`;
  if (n >= 1024) return `${(n / 1024).toFixed(1)} KiB`;
  return `${n} B`;
}

export class Phases {
  private readonly started = performance.now();

  constructor(
    private readonly prefix: string,
    private readonly log: LogFn,
  ) {}

  /** Seconds since this object was created. */
  elapsed(): number {
    return (performance.now() - this.started) / 1000;
  }

  /** Runs `fn` as a named phase, logging its start and duration (also on failure). */
  async run<T>(name: string, fn: () => Promise<T>): Promise<T> {
    const t0 = performance.now();
    this.log(`${this.prefix}: ${name} ...`);
    try {
      const out = await fn();
      this.log(`${this.prefix}: ${name} done in ${fmtSeconds((performance.now() - t0) / 1000)} (total ${fmtSeconds(this.elapsed())})`);
      return out;
    } catch (err) {
      this.log(`${this.prefix}: ${name} FAILED after ${fmtSeconds((performance.now() - t0) / 1000)}`);
      throw err;
    }
  }
}

/**
 * Throttled progress for a chatty child process: prints at most one line per
 * `everyMs`, prefixed with the elapsed time, so a minute-long debootstrap
 * shows it is alive without flooding the terminal.
 */
export function throttledLines(log: LogFn, prefix: string, everyMs = 5000): (line: string) => void {
  const t0 = performance.now();
  let last = 0;
  return (line: string) => {
    const now = performance.now();
    const text = line.trim();
    if (text === "" || now - last < everyMs) return;
    last = now;
    log(`${prefix} [${fmtSeconds((now - t0) / 1000)}] ${text.slice(0, 160)}`);
  };
}
