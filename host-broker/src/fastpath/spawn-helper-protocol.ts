/**
 * Messages between the broker and its spawn helper (Node IPC with the structured-clone
 * serializer, so byte chunks cross as Uint8Array without base64). Output is credit-based:
 * the broker sends a `credit` for each chunk its caller has taken; the helper stops reading
 * from the child while more than a fixed window (spawn-helper-main.ts) is uncredited, so a
 * slow consumer stalls the child, not memory.
 */
import type { RunResult } from '../../../guest-agent/src/process/run-process.ts';
import type { WireError } from '../../../guest-agent/src/protocol/errors.ts';

export type StreamName = 'stdout' | 'stderr';

/** RunOptions minus what cannot cross a process boundary (callbacks, signals, async input). */
export interface HelperRunOptions {
  argv: string[];
  cwd: string;
  env: Record<string, string>;
  stdin?: Uint8Array | undefined;
  extraInputs?: Uint8Array[] | undefined;
  maxOutputBytes?: number | undefined;
  timeoutMs?: number | undefined;
  killGraceMs?: number | undefined;
  pipeGraceMs?: number | undefined;
  killGroupOnExit?: boolean | undefined;
  uid?: number | undefined;
  gid?: number | undefined;
  wantStdout: boolean;
  wantStderr: boolean;
  /** v1 `tasks` files the helper's forking thread joins just for the fork (RunSlot.threadEntry). */
  cgroupTasks?: string[] | undefined;
}

export type ToHelper =
  | { t: 'run'; id: number; opts: HelperRunOptions }
  | { t: 'cancel'; id: number }
  | { t: 'kill'; id: number; signal: NodeJS.Signals }
  | { t: 'credit'; id: number; stream: StreamName };

export type FromHelper =
  | { t: 'ready'; pid: number }
  | { t: 'data'; id: number; stream: StreamName; chunk: Uint8Array }
  | { t: 'onkill'; id: number }
  | { t: 'result'; id: number; result: RunResult }
  | { t: 'error'; id: number; error: WireError };
