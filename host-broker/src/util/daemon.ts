import { spawn, type ChildProcess } from 'node:child_process';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import { boundedLines } from './bounded-lines.ts';

/**
 * Long-lived helper processes the broker owns (a local agent, a QEMU VM). Tenant commands
 * go through runProcess; this is for processes whose lifetime the broker manages, whose
 * output lines are logged, and that must never outlive the broker.
 */
export interface Daemon {
  readonly proc: ChildProcess;
  readonly pid: number;
  /** Resolves when the process exits, with how. */
  readonly exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
  readonly running: boolean;
  /** Last lines of output, kept for error messages. */
  tail(): string[];
  /** SIGTERM, then SIGKILL after graceMs. */
  stop(graceMs?: number): Promise<void>;
}

export interface DaemonOptions {
  argv: string[];
  env?: NodeJS.ProcessEnv;
  cwd?: string;
  log: Logger;
  /** Lines matching are logged at info; everything else at debug. */
  interesting?: RegExp;
  onLine?: (line: string) => void;
  /** Give the process its own process group so a stop reaches its children too. */
  group?: boolean;
  /** Descriptors the child inherits as fd 3, 4, ... (e.g. a seccomp filter for bwrap). */
  extraFds?: number[];
}

/** Longest output line kept (a QEMU's console is the guest's to write). */
export const DAEMON_MAX_LINE_BYTES = 4096;
/** Interesting lines logged in full before only every 1,000th is. */
const LOGGED_IN_FULL = 100;

export function startDaemon(opts: DaemonOptions): Daemon {
  const [file, ...args] = opts.argv;
  if (!file) throw new HutchError('bad_request', 'empty argv');
  const proc = spawn(file, args, {
    env: opts.env ?? process.env,
    cwd: opts.cwd,
    stdio: ['ignore', 'pipe', 'pipe', ...(opts.extraFds ?? [])],
    detached: opts.group ?? false,
  });
  const lines: string[] = [];
  let interesting = 0;
  const onLine = (whole: string, cutBytes: number) => {
    const line = cutBytes ? `${whole}... (${cutBytes} bytes cut)` : whole;
    lines.push(line);
    if (lines.length > 50) lines.shift();
    opts.onLine?.(line);
    if (!opts.interesting?.test(line)) {
      opts.log.debug('daemon.output', { line });
      return;
    }
    // A guest as root can write its console as fast as QEMU emulates the port: the first
    // lines in full, then a sample with the count, so it cannot fill the broker's log.
    const n = ++interesting;
    if (n <= LOGGED_IN_FULL || n % 1000 === 0) opts.log.info('daemon.output', { line, ...(n > LOGGED_IN_FULL ? { interestingLines: n } : {}) });
  };
  for (const s of [proc.stdout, proc.stderr]) {
    if (!s) continue;
    boundedLines(s, DAEMON_MAX_LINE_BYTES, onLine);
    s.on('error', () => undefined);
  }
  let running = true;
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) => {
    proc.once('exit', (code, signal) => {
      running = false;
      resolve({ code, signal });
    });
    proc.once('error', (err) => {
      running = false;
      opts.log.error('daemon.spawn_failed', { argv0: file, error: err.message });
      resolve({ code: null, signal: null });
    });
  });
  const kill = (sig: NodeJS.Signals) => {
    try {
      if (opts.group && proc.pid) process.kill(-proc.pid, sig);
      else proc.kill(sig);
    } catch {
      // already gone
    }
  };
  return {
    proc,
    pid: proc.pid ?? -1,
    exited,
    get running() {
      return running;
    },
    tail: () => [...lines],
    async stop(graceMs = 2000) {
      if (!running) return;
      kill('SIGTERM');
      const t = setTimeout(() => kill('SIGKILL'), graceMs);
      await exited;
      clearTimeout(t);
    },
  };
}
