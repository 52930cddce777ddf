/**
 * Telemetry methods and events of the agent protocol (telemetry.*): per-process CPU and
 * memory, meminfo, vmstat deltas, zswap, PSI. Merged into METHODS/EVENTS in methods.ts.
 */
export const TELEMETRY_METHODS = {} as const;
export const TELEMETRY_EVENTS = {} as const;
