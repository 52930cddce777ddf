import { spawn, type ChildProcess } from 'node:child_process';
import { createInterface } from 'node:readline';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';

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
  const onLine = (line: string) => {
    lines.push(line);
    if (lines.length > 50) lines.shift();
    opts.onLine?.(line);
    if (opts.interesting?.test(line)) opts.log.info('daemon.output', { line });
    else opts.log.debug('daemon.output', { line });
  };
  // The interface re-emits stream errors on itself; unheard, they would crash the broker.
  for (const s of [proc.stdout, proc.stderr]) if (s) createInterface({ input: s }).on('line', onLine).on('error', () => undefined);
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
