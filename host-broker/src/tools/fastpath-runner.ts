import type { ExecResult } from '../../../guest-agent/src/protocol/methods.ts';

/** What a session needs from the fast path (bubblewrap + seccomp on the host workspace). */
export interface FastPathRunRequest {
  command: string;
  workspace: string;
  cwd?: string;
  env?: Record<string, string>;
  stdin?: Uint8Array;
  timeoutMs?: number;
  maxOutputBytes?: number;
  /** Largest file the command may write (RLIMIT_FSIZE): the session's remaining workspace quota. */
  fileSizeLimitBytes?: number;
  onStdout?: (c: Uint8Array) => void | Promise<void>;
  onStderr?: (c: Uint8Array) => void | Promise<void>;
  signal?: AbortSignal;
  /** Receives the function that sends the running command a signal. */
  onSignalable?: (send: (sig: 'SIGINT' | 'SIGTERM' | 'SIGKILL' | 'SIGHUP' | 'SIGQUIT' | 'SIGUSR1' | 'SIGUSR2' | 'SIGSTOP' | 'SIGCONT') => Promise<boolean>) => void;
}

export interface FastPathRunner {
  run(req: FastPathRunRequest): Promise<ExecResult>;
  /** What one run may hold and how many to admit at once; the broker's admission counts each run at `memoryBytes`. */
  readonly runLimits?: { memoryBytes: number; maxConcurrentRuns: number };
  close?(): Promise<void>;
}
