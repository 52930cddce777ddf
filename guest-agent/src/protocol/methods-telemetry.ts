import { z } from 'zod';
import { MemoryPolicyOutcomeSchema } from './methods-memory.ts';

/**
 * Telemetry methods and events of the agent protocol (telemetry.*): what the guest's
 * memory and processes are doing, sampled on request (the broker polls live VMs for a
 * subscription or a /metrics scrape; an idle VM is never woken for it). Merged into
 * METHODS/EVENTS in methods.ts.
 */
const count = z.number().int().nonnegative().max(Number.MAX_SAFE_INTEGER);

/** What one call cost in memory terms: vmstat deltas over the call (guest-wide). */
export const CallUsageSchema = z.object({
  majorFaults: count,
  /** Pages read back from the swap disk (pswpin x page size). */
  swapReadBytes: count,
  /** Pages decompressed from the zswap pool. */
  zswapIns: count,
  /** Pages that were evicted and needed again (workingset_refault_anon + _file). */
  refaults: count,
});
export type CallUsage = z.infer<typeof CallUsageSchema>;

export const VMSTAT_COUNTERS = ['pswpin', 'pswpout', 'zswpin', 'zswpout', 'workingset_refault_anon', 'workingset_refault_file', 'pgmajfault'] as const;

export const ProcessSampleSchema = z.object({
  pid: z.number().int(),
  comm: z.string(),
  /** CPU use since the previous sample of this process, percent of one CPU. */
  cpuPercent: z.number().nonnegative(),
  rssBytes: count,
  /** The agent itself, not a tenant process. */
  agent: z.boolean(),
});

export const PsiSchema = z.object({ someAvg10: z.number(), fullAvg10: z.number(), someTotalUs: count, fullTotalUs: count });

export const TelemetrySampleSchema = z.object({
  atMs: z.number(),
  uptimeS: z.number(),
  memory: z.object({
    totalBytes: count,
    freeBytes: count,
    availableBytes: count,
    cacheBytes: count,
    anonBytes: count,
    swapUsedBytes: count,
    zswapPoolBytes: count,
    zswapStoredBytes: count,
  }),
  /** Cumulative counters (since boot) and their increase since this agent's previous sample. */
  vmstat: z.record(z.enum(VMSTAT_COUNTERS), count),
  vmstatDelta: z.record(z.enum(VMSTAT_COUNTERS), count),
  /** /proc/pressure/memory; absent when the kernel has no PSI. */
  psiMemory: PsiSchema.optional(),
  /** The guest's memory policy (mem.policy): state, steps, what the last idle reclaimed, the last wake's prefetch. */
  memoryPolicy: MemoryPolicyOutcomeSchema.optional(),
  processes: z.array(ProcessSampleSchema),
});
export type TelemetrySample = z.infer<typeof TelemetrySampleSchema>;

export const TelemetrySampleParamsSchema = z.object({ processes: z.boolean().optional() }).strict();

export const TELEMETRY_METHODS = {
  'telemetry.sample': { params: TelemetrySampleParamsSchema, result: TelemetrySampleSchema },
} as const;
export const TELEMETRY_EVENTS = {} as const;
