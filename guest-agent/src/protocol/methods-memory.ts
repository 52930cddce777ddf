/**
 * Memory-control methods of the agent protocol (mem.*): reclaim, zswap, DAMON,
 * activation sets, prefetch. Merged into METHODS in methods.ts; kept in its own module
 * because the memory manager is a concern of its own.
 */
export const MEMORY_METHODS = {} as const;
