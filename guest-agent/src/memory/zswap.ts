import { existsSync, readFileSync } from 'node:fs';
import type { z } from 'zod';
import { HutchError } from '../protocol/errors.ts';
import type { ZswapParamsSchema, ZswapStateSchema } from '../protocol/methods-memory.ts';
import { parseBool, readKnob, readKnobOr, writeKnob } from './knobs.ts';
import { swapStats } from './stats.ts';

/** zswap's module parameters and the workload cgroup's zswap limits. */

const DIR = '/sys/module/zswap/parameters';
type ZswapParams = z.infer<typeof ZswapParamsSchema>;
type ZswapState = z.infer<typeof ZswapStateSchema>;

export function zswapAvailable(): boolean {
  return existsSync(`${DIR}/enabled`);
}

export function zswapState(cgroup: string | undefined): ZswapState {
  if (!zswapAvailable()) throw new HutchError('unavailable', 'this kernel has no zswap (CONFIG_ZSWAP)', { knob: DIR });
  const shrinker = readKnobOr(`${DIR}/shrinker_enabled`);
  const cgMax = cgroup ? readKnobOr(`${cgroup}/memory.zswap.max`) : null;
  const cgWb = cgroup ? readKnobOr(`${cgroup}/memory.zswap.writeback`) : null;
  return {
    enabled: parseBool(readKnob(`${DIR}/enabled`)),
    compressor: readKnob(`${DIR}/compressor`),
    zpool: readKnob(`${DIR}/zpool`),
    maxPoolPercent: Number(readKnob(`${DIR}/max_pool_percent`)),
    acceptThresholdPercent: Number(readKnob(`${DIR}/accept_threshold_percent`)),
    shrinkerEnabled: shrinker === null ? null : parseBool(shrinker),
    cgroupMax: cgMax === null ? null : cgMax === 'max' ? 'max' : Number(cgMax),
    cgroupWriteback: cgWb === null ? null : cgWb === '1',
    stats: swapStats(),
  };
}

/** Compressors the kernel's crypto API offers (what zswap's compressor knob accepts). */
function kernelCompressors(): string[] {
  try {
    const names = new Set<string>();
    let name = '';
    for (const line of readFileSync('/proc/crypto', 'utf8').split('\n')) {
      const n = /^name\s*:\s*(\S+)/.exec(line);
      if (n) name = n[1] as string;
      if (/^type\s*:\s*(scomp|acomp|compression)$/.test(line)) names.add(name);
    }
    return [...names].sort();
  } catch {
    return [];
  }
}

export function applyZswap(p: ZswapParams, cgroup: string | undefined): ZswapState {
  if (!zswapAvailable()) throw new HutchError('unavailable', 'this kernel has no zswap (CONFIG_ZSWAP)', { knob: DIR });
  if ((p.cgroupMax !== undefined || p.cgroupWriteback !== undefined) && !cgroup) {
    throw new HutchError('unavailable', 'no workload cgroup: cgroupMax and cgroupWriteback need the agent to run with --workload-cgroup');
  }
  if (p.compressor !== undefined) {
    const known = kernelCompressors();
    // The kernel answers an unknown compressor with a bare EINVAL (or loads nothing and keeps
    // the old one); say what it has instead.
    if (known.length > 0 && !known.includes(p.compressor)) {
      throw new HutchError('bad_request', `compressor ${p.compressor} is not in this kernel; it has: ${known.join(', ')}`, { compressor: p.compressor, available: known });
    }
    writeKnob(`${DIR}/compressor`, p.compressor);
  }
  if (p.zpool !== undefined) writeKnob(`${DIR}/zpool`, p.zpool);
  if (p.maxPoolPercent !== undefined) writeKnob(`${DIR}/max_pool_percent`, String(p.maxPoolPercent));
  if (p.acceptThresholdPercent !== undefined) writeKnob(`${DIR}/accept_threshold_percent`, String(p.acceptThresholdPercent));
  if (p.shrinkerEnabled !== undefined) writeKnob(`${DIR}/shrinker_enabled`, p.shrinkerEnabled ? 'Y' : 'N');
  if (p.enabled !== undefined) writeKnob(`${DIR}/enabled`, p.enabled ? 'Y' : 'N');
  if (cgroup && p.cgroupMax !== undefined) setCgroupZswapMax(cgroup, p.cgroupMax);
  if (cgroup && p.cgroupWriteback !== undefined) setCgroupZswapWriteback(cgroup, p.cgroupWriteback);
  const state = zswapState(cgroup);
  // Some knobs take any string and keep their old value (a zpool that failed to load).
  if (p.zpool !== undefined && state.zpool !== p.zpool) throw new HutchError('bad_request', `zpool ${p.zpool} is not available in this kernel (still ${state.zpool})`, { zpool: p.zpool });
  if (p.compressor !== undefined && state.compressor !== p.compressor) throw new HutchError('bad_request', `compressor ${p.compressor} could not be loaded (still ${state.compressor})`, { compressor: p.compressor });
  return state;
}

export function setCgroupZswapMax(cgroup: string, max: 'max' | number): void {
  writeKnob(`${cgroup}/memory.zswap.max`, String(max));
}

export function setCgroupZswapWriteback(cgroup: string, on: boolean): void {
  writeKnob(`${cgroup}/memory.zswap.writeback`, on ? '1' : '0');
}

/**
 * The pool's cap (max_pool_percent of guest RAM) for a guest of `totalBytes`. The pool must
 * hold what an idle guest keeps compressed in RAM (with hot set last, the activation set;
 * cold pages go to the swap disk) and stay small, since every byte of it is host memory
 * the idle VM keeps. Small guests need a larger share for the same working set: 20% up to
 * 2 GiB (>= 100 MiB at 512 MiB, about 3x the activation sets measured here), 15% up to
 * 8 GiB, 10% above. A full pool writes its coldest entries back to disk (shrinker on).
 */
export function zswapPoolPercentFor(totalBytes: number): number {
  const GiB = 1024 ** 3;
  if (totalBytes <= 2 * GiB) return 20;
  if (totalBytes <= 8 * GiB) return 15;
  return 10;
}
