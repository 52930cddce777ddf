import { readKeyValues } from '../memory/knobs.ts';
import { VMSTAT_COUNTERS } from '../protocol/methods-telemetry.ts';

export type VmstatCounters = Record<(typeof VMSTAT_COUNTERS)[number], number>;

/** The /proc/vmstat counters telemetry reports (0 where the kernel lacks one). */
export function readVmstat(): VmstatCounters {
  const v = readKeyValues('/proc/vmstat');
  return Object.fromEntries(VMSTAT_COUNTERS.map((k) => [k, v.get(k) ?? 0])) as VmstatCounters;
}

export function vmstatDelta(before: VmstatCounters, after: VmstatCounters): VmstatCounters {
  // Counters only grow; a negative difference would mean a reboot, which a restore is not.
  return Object.fromEntries(VMSTAT_COUNTERS.map((k) => [k, Math.max(0, after[k] - before[k])])) as VmstatCounters;
}
