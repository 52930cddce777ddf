import { z } from 'zod';

/**
 * Memory-control methods of the agent protocol (mem.*): reclaim, zswap, DAMON_RECLAIM,
 * MGLRU, free page reporting, activation sets and prefetch. Merged into METHODS in
 * methods.ts; kept in its own module because the memory manager is a concern of its own.
 *
 * The broker drives the guest's memory with one method, mem.policy: `active` when a VM
 * starts or wakes, `idle` when it is released and kept. The agent then applies DAMON,
 * zswap sizing and MGLRU once the first call has started, reclaims (hot set last) on idle,
 * and prefetches the recorded set alongside the first call after it (policy.ts). The other
 * methods are the single steps, for tests and benches:
 *
 *   mem.reporting { order: 0 }       freed 4 KiB pages go back to the host (page-reporting.ts)
 *   mem.activation {}                what the last call touched, overlap with the call before
 *   mem.reclaim { target: 'all' }    workload memory into zswap / swap
 *   mem.prefetch {}                  MADV_WILLNEED of the recorded set
 *
 * Activation sets are recorded by the agent itself around every exec (no call needed):
 * pages the long-lived processes of the workload cgroup touched during the call.
 * Every control validates its values here (zod: a `bad_request` naming the field) and
 * again against the kernel: a knob the kernel lacks is `unavailable`, a value it refuses
 * (an unknown compressor) is `bad_request` with what it accepts in the context.
 * Sizes are bytes, times are milliseconds unless a name says otherwise.
 */

const bytesCount = z.number().int().nonnegative().max(Number.MAX_SAFE_INTEGER);
const percent = z.number().int().min(0).max(100);

/** Pool and swap figures from /proc/meminfo and /proc/vmstat (bytes and event counts). */
export const SwapStatsSchema = z.object({
  /** Compressed size of the zswap pool (meminfo Zswap). */
  zswapPoolBytes: bytesCount,
  /** Uncompressed bytes stored in the pool (meminfo Zswapped). */
  zswapStoredBytes: bytesCount,
  /** Swap in use on the swap device (SwapTotal - SwapFree; pages in the pool count here too). */
  swapUsedBytes: bytesCount,
  /** Cumulative /proc/vmstat counters. */
  zswpout: bytesCount,
  zswpin: bytesCount,
  pswpout: bytesCount,
  pswpin: bytesCount,
  pgmajfault: bytesCount,
});
export type SwapStats = z.infer<typeof SwapStatsSchema>;

export const MemInfoSchema = z.object({
  totalBytes: bytesCount,
  freeBytes: bytesCount,
  availableBytes: bytesCount,
  /** Page cache (meminfo Cached, swap cache excluded). */
  cacheBytes: bytesCount,
  swapCacheBytes: bytesCount,
  anonBytes: bytesCount,
  dirtyBytes: bytesCount,
});

// ---------- mem.reclaim ----------
export const ReclaimParamsSchema = z
  .object({
    /** Bytes to reclaim from the workload cgroup, or 'all' (everything it holds). */
    target: z.union([z.literal('all'), z.number().int().positive().max(Number.MAX_SAFE_INTEGER)]),
    /**
     * "Hot set last": cold pages go out first with the zswap pool closed (straight to the
     * swap disk), then the recorded activation set goes into the pool with writeback off,
     * so the next wake finds its pages compressed in RAM rather than on disk.
     */
    hotSetLast: z.boolean().optional(),
    /** Also drop the guest's clean page cache outside the cgroup (drop_caches=1). Default false. */
    dropCaches: z.boolean().optional(),
  })
  .strict();
export const ReclaimResultSchema = z.object({
  /** Drop of the workload cgroup's memory.current. */
  reclaimedBytes: bytesCount,
  /** memory.current after reclaim. */
  residentBytes: bytesCount,
  ms: z.number().nonnegative(),
  /** Passes written to memory.reclaim (hot set last: two phases). */
  passes: z.number().int().nonnegative(),
  /** The kernel could not reclaim the whole target (EAGAIN): what is left is unreclaimable or hot. */
  partial: z.boolean(),
  /** Bytes of the activation set put into the pool last (hotSetLast only). */
  hotSetBytes: bytesCount.optional(),
  before: SwapStatsSchema,
  after: SwapStatsSchema,
});

// ---------- mem.zswap ----------
export const ZswapParamsSchema = z
  .object({
    enabled: z.boolean().optional(),
    /** A crypto compressor the kernel has (lzo, lz4, zstd, deflate, ...). */
    compressor: z.string().regex(/^[a-z0-9-]{1,32}$/, 'compressor: lower-case name such as lzo or zstd').optional(),
    zpool: z.enum(['zsmalloc', 'zbud', 'z3fold']).optional(),
    maxPoolPercent: percent.optional(),
    /** Once the pool was full, it takes stores again below this percentage of max_pool_percent. */
    acceptThresholdPercent: percent.optional(),
    /** Writes cold pool entries back to the swap disk under memory pressure. */
    shrinkerEnabled: z.boolean().optional(),
    /** Per-cgroup (workload) cap of the pool: bytes or 'max'; 0 closes the pool to the workload. */
    cgroupMax: z.union([z.literal('max'), bytesCount]).optional(),
    /** Per-cgroup: whether pool entries may be written back to the swap disk. */
    cgroupWriteback: z.boolean().optional(),
  })
  .strict();
export const ZswapStateSchema = z.object({
  enabled: z.boolean(),
  compressor: z.string(),
  zpool: z.string(),
  maxPoolPercent: z.number().int(),
  acceptThresholdPercent: z.number().int(),
  shrinkerEnabled: z.boolean().nullable(),
  cgroupMax: z.union([z.literal('max'), bytesCount]).nullable(),
  cgroupWriteback: z.boolean().nullable(),
  stats: SwapStatsSchema,
});

// ---------- mem.mglru ----------
export const MglruParamsSchema = z.object({ enabled: z.boolean() }).strict();
export const MglruResultSchema = z.object({ enabled: z.boolean(), raw: z.string() });

// ---------- mem.damon ----------
export const DAMON_PROFILES = ['previous', 'tuned', 'off'] as const;
export const DamonParamsSchema = z
  .object({
    /** DAMON_RECLAIM profile (design.md); 'off' stops kdamond. */
    profile: z.enum(DAMON_PROFILES),
    /**
     * How the profile runs. sysfs (default): DAMON_RECLAIM's scheme through the DAMON sysfs
     * interface. module: the damon_reclaim module's parameters, which on this 6.12 kernel
     * drop their own scheme and reclaim nothing (kept to show that, and for fixed kernels).
     */
    backend: z.enum(['sysfs', 'module']).optional(),
    /**
     * Opt-in aggressive dirty-page flushing (vm.dirty_* small, writeback every 100 ms):
     * less dirty memory, slower write-heavy work. false restores the kernel defaults.
     * Absent: left as it is.
     */
    dirtyFlush: z.boolean().optional(),
  })
  .strict();
export const DamonStateSchema = z.object({
  profile: z.enum([...DAMON_PROFILES, 'custom']),
  backend: z.enum(['sysfs', 'module']).nullable(),
  enabled: z.boolean(),
  /** kdamond's pid, or null when it is not running. */
  kdamondPid: z.number().int().nullable(),
  /** Parameters of the profile (module: as the kernel reads them back). */
  params: z.record(z.string(), z.string()),
  /** Monitored physical range: min start / max end + 1 of all "System RAM" ranges in /proc/iomem. */
  monitorRegion: z.object({ start: bytesCount, end: bytesCount }).nullable(),
  stats: z.object({
    nrReclaimTriedRegions: bytesCount,
    bytesReclaimTriedRegions: bytesCount,
    nrReclaimedRegions: bytesCount,
    bytesReclaimedRegions: bytesCount,
    nrQuotaExceeds: bytesCount,
  }),
  dirtyFlush: z.boolean(),
});

/** What a monitoring-only DAMON context sees over the same range (diagnostics). */
export const DamonRegionsParamsSchema = z.object({ ms: z.number().int().min(200).max(60_000) }).strict();
export const DamonRegionsResultSchema = z.object({
  regions: z.array(z.object({ start: bytesCount, end: bytesCount, nrAccesses: z.number().int(), age: z.number().int() })),
  /** Bytes in regions with no access in the last aggregation interval. */
  idleBytes: bytesCount,
  totalBytes: bytesCount,
});

// ---------- mem.reporting ----------
export const ReportingParamsSchema = z
  .object({
    /**
     * page_reporting_order: free blocks of 2^order pages and larger are reported to the host.
     * The kernel's default (pageblock order, 4 MiB here) never sees the scattered 4 KiB pages
     * that reclaim into zswap frees; a low order returns them.
     */
    order: z.number().int().min(0).max(10),
  })
  .strict();
export const ReportingResultSchema = z.object({ order: z.number().int(), available: z.boolean() });

// ---------- activation sets ----------
export const ACTIVATION_METHODS = ['idle', 'pagemap'] as const;
export const ActivationParamsSchema = z
  .object({
    /** Turn recording of each call's activation set on or off (default: on). */
    track: z.boolean().optional(),
    /**
     * idle: idle page tracking (/sys/kernel/mm/page_idle/bitmap), every touched page;
     * pagemap: pages that went from swapped/absent to present (the fallback without page_idle).
     * Default: idle where the kernel has it.
     */
    method: z.enum(ACTIVATION_METHODS).optional(),
    /** Include up to this many ranges per process in the answer (default 0: totals only). */
    maxRanges: z.number().int().nonnegative().max(100_000).optional(),
  })
  .strict();
export const ActivationProcessSchema = z.object({
  pid: z.number().int(),
  comm: z.string(),
  pages: z.number().int().nonnegative(),
  /** Page-aligned [start, end) virtual address ranges, hex strings (addresses exceed 2^53). */
  ranges: z.array(z.tuple([z.string(), z.string()])),
  rangeCount: z.number().int().nonnegative(),
});
export const ActivationResultSchema = z.object({
  track: z.boolean(),
  method: z.enum(ACTIVATION_METHODS),
  /** Calls recorded since the agent started. */
  calls: z.number().int().nonnegative(),
  /** Long-lived workload processes and what the last call touched in each. */
  processes: z.array(ActivationProcessSchema),
  pages: z.number().int().nonnegative(),
  bytes: bytesCount,
  /** |last ∩ previous| / |last ∪ previous| over (process, page); null before the second call. */
  overlap: z.number().min(0).max(1).nullable(),
  /** |last ∩ previous| / |last|: the share of the last call's pages the previous set would have prefetched. */
  coverage: z.number().min(0).max(1).nullable(),
  /** Time spent recording the last call, ms. */
  recordMs: z.number().nonnegative(),
  /** The last prefetch and how many of its pages the call after it touched. */
  prefetch: z
    .object({ pages: z.number().int().nonnegative(), hits: z.number().int().nonnegative().nullable(), hitRatio: z.number().min(0).max(1).nullable() })
    .nullable(),
});

// ---------- mem.prefetch ----------
export const PrefetchParamsSchema = z.object({}).strict();
export const PrefetchResultSchema = z.object({
  /** Pages of the recorded set advised (MADV_WILLNEED), in processes still alive. */
  pages: z.number().int().nonnegative(),
  bytes: bytesCount,
  ranges: z.number().int().nonnegative(),
  processes: z.number().int().nonnegative(),
  /** Recorded processes that are gone (not prefetched). */
  skippedProcesses: z.number().int().nonnegative(),
  ms: z.number().nonnegative(),
  /** Swap and fault counters around the prefetch (reads it caused). */
  before: SwapStatsSchema,
  after: SwapStatsSchema,
});

// ---------- mem.status ----------
export const StatusParamsSchema = z.object({}).strict();
export const StatusResultSchema = z.object({
  mem: MemInfoSchema,
  swap: SwapStatsSchema,
  workload: z.object({ cgroup: z.string().nullable(), currentBytes: bytesCount.nullable(), swapBytes: bytesCount.nullable(), zswapBytes: bytesCount.nullable(), processes: z.number().int() }),
  zswap: ZswapStateSchema.nullable(),
  mglru: MglruResultSchema.nullable(),
  damon: DamonStateSchema.nullable(),
  reporting: ReportingResultSchema,
  idlePageTracking: z.boolean(),
  prefetchHelper: z.string().nullable(),
});

// ---------- mem.policy ----------
/**
 * The agent's own memory policy. The broker says only `active` (a session uses the VM) or
 * `idle` (it released it); the agent does the rest (policy.ts) and reports the outcome
 * here and in every telemetry sample. Each step can be switched off, for measurement.
 */
export const MemoryPolicyStepsSchema = z
  .object({
    /** While active: the tuned DAMON_RECLAIM scheme through DAMON sysfs (stopped on idle). */
    damon: z.boolean(),
    /** zswap's max_pool_percent sized from the guest's RAM (zswap.ts: zswapPoolPercentFor). */
    zswap: z.boolean(),
    /** Multi-generational LRU on. */
    mglru: z.boolean(),
    /** Record each exec's activation set (idle page tracking) around every exec. */
    activationSet: z.boolean(),
    /** On idle: memory.reclaim of the whole workload cgroup. */
    reclaim: z.boolean(),
    /** Reclaim with the hot set last (needs activationSet). */
    hotSetLast: z.boolean(),
    /** On the first call after idle: MADV_WILLNEED of the recorded set, started once the call has started. */
    prefetch: z.boolean(),
    /** While idle: free page reporting of every free 4 KiB page (order 0); back to order 10 when active. */
    reporting: z.boolean(),
    /** On idle: also drop the guest's clean page cache outside the workload (drop_caches=1). */
    dropCaches: z.boolean(),
  })
  .strict();
export type MemoryPolicySteps = z.infer<typeof MemoryPolicyStepsSchema>;
export const DEFAULT_MEMORY_POLICY: MemoryPolicySteps = {
  damon: true,
  zswap: true,
  mglru: true,
  activationSet: true,
  reclaim: true,
  hotSetLast: true,
  prefetch: true,
  reporting: true,
  dropCaches: false,
};
export const MemoryPolicyParamsSchema = z
  .object({
    state: z.enum(['active', 'idle']),
    /** Steps to switch on or off from now on (absent: as before; the agent starts with DEFAULT_MEMORY_POLICY). */
    steps: MemoryPolicyStepsSchema.partial().strict().optional(),
  })
  .strict();
export const PrefetchOutcomeSchema = z.object({
  state: z.enum(['armed', 'running', 'done', 'failed']),
  /** Guest wall clock (ms since the epoch) when the first call after idle reached the agent's exec, and when the prefetch started. */
  callStartedAtMs: z.number().nullable(),
  startedAtMs: z.number().nullable(),
  pages: z.number().int().nonnegative(),
  ms: z.number().nonnegative(),
  error: z.string().nullable(),
});
export const MemoryPolicyOutcomeSchema = z.object({
  state: z.enum(['none', 'active', 'idle']),
  steps: MemoryPolicyStepsSchema,
  /** Guest wall clock of the last change (ms since the epoch). */
  atMs: z.number(),
  damon: z
    .object({
      running: z.boolean(),
      /** Why it is not running although the step is on (this kernel has no DAMON, it refused the scheme). */
      unavailable: z.string().nullable(),
      /** Bytes DAMON paged out while active (its scheme's sz_applied), read when it stopped. */
      reclaimedBytes: bytesCount,
    })
    .nullable(),
  zswap: z.object({ maxPoolPercent: z.number().int(), compressor: z.string() }).nullable(),
  /** The last idle's reclaim; null before one, or with the step off. */
  reclaim: ReclaimResultSchema.nullable(),
  activation: z.object({ track: z.boolean(), calls: z.number().int().nonnegative(), pages: z.number().int().nonnegative() }),
  /** The last wake's prefetch; null before one, or with the step off. */
  prefetch: PrefetchOutcomeSchema.nullable(),
  /** What a step could not do (said here and in the agent's log, never silently skipped). */
  warnings: z.array(z.string()),
});
export type MemoryPolicyOutcome = z.infer<typeof MemoryPolicyOutcomeSchema>;

export const MEMORY_METHODS = {
  /** memory.reclaim on the workload cgroup to a target; optionally hot set last. */
  'mem.reclaim': { params: ReclaimParamsSchema, result: ReclaimResultSchema },
  /** zswap module parameters and the workload cgroup's zswap limits; returns the state after. */
  'mem.zswap': { params: ZswapParamsSchema, result: ZswapStateSchema },
  /** Multi-generational LRU on or off (experiments). */
  'mem.mglru': { params: MglruParamsSchema, result: MglruResultSchema },
  /** DAMON_RECLAIM profile (previous | tuned | off) and the opt-in dirty-flush profile. */
  'mem.damon': { params: DamonParamsSchema, result: DamonStateSchema },
  /** Regions a monitoring-only DAMON context sees in physical memory: why DAMON_RECLAIM does or does not act. */
  'mem.damonRegions': { params: DamonRegionsParamsSchema, result: DamonRegionsResultSchema },
  /** Free page reporting order (what size of free blocks goes back to the host). */
  'mem.reporting': { params: ReportingParamsSchema, result: ReportingResultSchema },
  /** The last call's activation set (and tracking on/off). */
  'mem.activation': { params: ActivationParamsSchema, result: ActivationResultSchema },
  /** MADV_WILLNEED of the recorded activation set, before the next call runs. */
  'mem.prefetch': { params: PrefetchParamsSchema, result: PrefetchResultSchema },
  /** The agent's own memory policy: the broker says active or idle, the agent does the rest. */
  'mem.policy': { params: MemoryPolicyParamsSchema, result: MemoryPolicyOutcomeSchema },
  /** Everything above, read-only. */
  'mem.status': { params: StatusParamsSchema, result: StatusResultSchema },
} as const;
