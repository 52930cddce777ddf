/**
 * The bubblewrap + seccomp fast path for read/edit-only shell commands on the host workspace.
 * See fast-path.ts for the entry point; the design notes (Router, fast path) say where it sits.
 */
export { FastPath, type FastPathDescription, type FastPathOptions, type FastPathRequest, type FastPathResult } from './fast-path.ts';
export type { LimitDescription, LimitMechanism, RunLimitReport } from './limits.ts';
export { seccompFilter, buildSeccompFilter, verdict, type SeccompFilter } from './seccomp-filter.ts';
export type { SpawnerKind } from './spawner.ts';
