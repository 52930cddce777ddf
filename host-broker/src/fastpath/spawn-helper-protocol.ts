/**
 * Messages between the broker and its spawn helper (Node IPC with the structured-clone
 * serializer, so byte chunks cross as Uint8Array without base64). Output is credit-based:
 * the helper stops reading from the child while more than CREDIT_WINDOW_BYTES of a stream
 * are sent and not credited, so a slow consumer stalls the child, not memory; the broker
 * credits what its caller has taken in batches of CREDIT_BATCH_BYTES.
 *
 * A command's whole output usually fits in the window, so a run needs no message beyond
 * `run`, its output and `result`: each message more wakes the other process, and under CPU
 * contention a wake-up costs milliseconds.
 */
import type { RunResult } from '../../../guest-agent/src/process/run-process.ts';
import type { WireError } from '../../../guest-agent/src/protocol/errors.ts';

export type StreamName = 'stdout' | 'stderr';

/** Bytes of a stream the helper may have sent and not had credited. */
export const CREDIT_WINDOW_BYTES = 256 * 1024;
/** The broker credits taken bytes once this many have gathered (less than the window, or the helper would wait forever). */
export const CREDIT_BATCH_BYTES = 64 * 1024;

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
  | { t: 'credit'; id: number; stream: StreamName; bytes: number };

export type FromHelper =
  | { t: 'ready'; pid: number }
  | { t: 'data'; id: number; stream: StreamName; chunk: Uint8Array }
  | { t: 'onkill'; id: number }
  | { t: 'result'; id: number; result: RunResult }
  | { t: 'error'; id: number; error: WireError };
