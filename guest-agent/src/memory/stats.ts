import type { z } from 'zod';
import type { MemInfoSchema, SwapStats } from '../protocol/methods-memory.ts';
import { readKeyValues } from './knobs.ts';

/** Guest-wide memory figures the mem.* results report before/after an action. */

const KiB = 1024;

export function memInfo(): z.infer<typeof MemInfoSchema> {
  const m = readKeyValues('/proc/meminfo');
  const kb = (k: string) => (m.get(k) ?? 0) * KiB;
  return {
    totalBytes: kb('MemTotal'),
    freeBytes: kb('MemFree'),
    availableBytes: kb('MemAvailable'),
    cacheBytes: kb('Cached'),
    swapCacheBytes: kb('SwapCached'),
    anonBytes: kb('AnonPages'),
    dirtyBytes: kb('Dirty'),
  };
}

export function swapStats(): SwapStats {
  const m = readKeyValues('/proc/meminfo');
  const v = readKeyValues('/proc/vmstat');
  const kb = (k: string) => (m.get(k) ?? 0) * KiB;
  return {
    zswapPoolBytes: kb('Zswap'),
    zswapStoredBytes: kb('Zswapped'),
    swapUsedBytes: Math.max(0, kb('SwapTotal') - kb('SwapFree')),
    zswpout: v.get('zswpout') ?? 0,
    zswpin: v.get('zswpin') ?? 0,
    pswpout: v.get('pswpout') ?? 0,
    pswpin: v.get('pswpin') ?? 0,
    pgmajfault: v.get('pgmajfault') ?? 0,
  };
}
