import type { MethodName } from '../../guest-agent/src/protocol/methods.ts';

/**
 * Every guest RPC has a deadline, sized by what it does: control calls in seconds, sync
 * calls by the entries and bytes they move, exec by its own timeout plus a grace for the
 * kill and the answer. Past it the guest counts as unresponsive: the call fails with
 * `guest_unresponsive` and its VM is torn down (the host workspace is the source of truth,
 * so a fresh VM loses nothing the host did not already have).
 *
 * `scale` stretches every figure for a slower guest: under TCG every guest instruction is
 * emulated and a loaded two-core host runs many guests, so the same RPC takes several
 * times longer than under KVM.
 */
export interface DeadlinePolicy {
  scale: number;
}

export const KVM_DEADLINES: DeadlinePolicy = { scale: 1 };
export const TCG_DEADLINES: DeadlinePolicy = { scale: 4 };

/** What a call will move, for the calls whose cost grows with the workspace. */
export interface CallWork {
  /** Entries in the workspace (scans walk all of them). */
  entries?: number;
  /** Bytes the call carries. */
  bytes?: number;
}

const BASE_MS: Record<string, number> = {
  ping: 5_000,
  'agent.resume': 15_000,
  'agent.state': 15_000,
  'agent.detach': 5_000,
  'exec.signal': 5_000,
  'sync.mark': 15_000,
  'sync.changes': 20_000,
  'sync.apply': 20_000,
  'sync.read': 20_000,
  'telemetry.sample': 10_000,
  'debug.echo': 30_000,
  'debug.exit': 5_000,
};
/** Memory calls (reclaim of a whole guest, DAMON scans) take longest of the control calls. */
const MEMORY_MS = 120_000;
/** File tools run in the guest only with routing off; they read whole files at most. */
const FILE_TOOL_MS = 30_000;
/** Per workspace entry a scan visits (lstat + compare), and guest bytes moved per second. */
const PER_ENTRY_MS = 1;
const BYTES_PER_MS = 1024; // 1 MiB/s: a TCG guest under load; the scale stretches it further
/** After an exec's own timeout the agent kills the group and answers: this is the slack for that. */
export const EXEC_GRACE_MS = 15_000;

export function deadlineFor(method: MethodName, work: CallWork, policy: DeadlinePolicy): number {
  const base = BASE_MS[method] ?? (method.startsWith('mem.') ? MEMORY_MS : method.startsWith('fs.') ? FILE_TOOL_MS : 30_000);
  const variable = (work.entries ?? 0) * PER_ENTRY_MS + (work.bytes ?? 0) / BYTES_PER_MS;
  return Math.ceil((base + variable) * policy.scale);
}

export function execDeadline(timeoutMs: number, policy: DeadlinePolicy): number {
  return timeoutMs + Math.ceil(EXEC_GRACE_MS * policy.scale);
}
