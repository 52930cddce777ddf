import { existsSync } from 'node:fs';
import { HutchError } from '../protocol/errors.ts';
import { readKnob, readKnobOr, writeKnob } from './knobs.ts';

/**
 * DAMON_RECLAIM's scheme, run through the DAMON sysfs interface (/sys/kernel/mm/damon):
 * physical address space, page out regions with no access for min_age, time/size quota
 * with age-weighted priority, free-memory-rate watermarks, anonymous pages filtered out.
 *
 * Why not the damon_reclaim module itself: in this 6.12 kernel (6.12.117, Debian's too)
 * damon_reclaim_apply_parameters() sets the attributes and the scheme on the running
 * context (mm/damon/reclaim.c:193,201: damon_set_attrs(ctx, ...), damon_set_schemes(ctx,
 * ...)) and then commits the parameter context, which has neither, over it
 * (damon_commit_ctx(ctx, param_ctx)): the scheme is deleted. kdamond monitors, no scheme
 * is ever applied, nothing is reclaimed and the stats stay 0 whatever the parameters.
 * DAMON_LRU_SORT in the same tree sets them on param_ctx (lru_sort.c:197,215). The sysfs
 * interface commits what it is given.
 */
const ADMIN = '/sys/kernel/mm/damon/admin';
const K = `${ADMIN}/kdamonds/0`;
const C = `${K}/contexts/0`;
const S = `${C}/schemes/0`;
const ULONG_MAX = '18446744073709551615';
const UINT_MAX = '4294967295';

export interface ReclaimScheme {
  minAgeUs: number;
  quotaMs: number;
  quotaBytes: number;
  quotaResetMs: number;
  wmarksHigh: number;
  wmarksMid: number;
  wmarksLow: number;
  wmarksIntervalUs: number;
  skipAnon: boolean;
  sampleUs: number;
  aggrUs: number;
  minRegions: number;
  maxRegions: number;
}

export function damonSysfsAvailable(): boolean {
  return existsSync(`${ADMIN}/kdamonds/nr_kdamonds`);
}

export function sysfsRunning(): boolean {
  return readKnobOr(`${ADMIN}/kdamonds/nr_kdamonds`) === '1' && readKnobOr(`${K}/state`) === 'on';
}

export function sysfsKdamondPid(): number | null {
  const pid = Number(readKnobOr(`${K}/pid`, '-1'));
  return pid > 0 ? pid : null;
}

export function stopSysfsScheme(): void {
  if (readKnobOr(`${ADMIN}/kdamonds/nr_kdamonds`, '0') === '0') return;
  if (readKnobOr(`${K}/state`) === 'on') writeKnob(`${K}/state`, 'off');
  writeKnob(`${ADMIN}/kdamonds/nr_kdamonds`, '0');
}

export function startSysfsScheme(s: ReclaimScheme, span: { start: number; end: number }): void {
  if (!damonSysfsAvailable()) throw new HutchError('unavailable', 'this kernel has no DAMON sysfs interface (CONFIG_DAMON_SYSFS)');
  stopSysfsScheme();
  writeKnob(`${ADMIN}/kdamonds/nr_kdamonds`, '1');
  try {
    writeKnob(`${K}/contexts/nr_contexts`, '1');
    writeKnob(`${C}/operations`, 'paddr');
    writeKnob(`${C}/monitoring_attrs/intervals/sample_us`, String(s.sampleUs));
    writeKnob(`${C}/monitoring_attrs/intervals/aggr_us`, String(s.aggrUs));
    writeKnob(`${C}/monitoring_attrs/nr_regions/min`, String(s.minRegions));
    writeKnob(`${C}/monitoring_attrs/nr_regions/max`, String(s.maxRegions));
    writeKnob(`${C}/targets/nr_targets`, '1');
    writeKnob(`${C}/targets/0/regions/nr_regions`, '1');
    writeKnob(`${C}/targets/0/regions/0/start`, String(span.start));
    writeKnob(`${C}/targets/0/regions/0/end`, String(span.end));
    writeKnob(`${C}/schemes/nr_schemes`, '1');
    writeKnob(`${S}/action`, 'pageout');
    // Regions of at least a page, with no access, for min_age (counted in aggregation intervals).
    writeKnob(`${S}/access_pattern/sz/min`, '4096');
    writeKnob(`${S}/access_pattern/sz/max`, ULONG_MAX);
    writeKnob(`${S}/access_pattern/nr_accesses/min`, '0');
    writeKnob(`${S}/access_pattern/nr_accesses/max`, '0');
    writeKnob(`${S}/access_pattern/age/min`, String(Math.floor(s.minAgeUs / s.aggrUs)));
    writeKnob(`${S}/access_pattern/age/max`, UINT_MAX);
    writeKnob(`${S}/quotas/ms`, String(s.quotaMs));
    writeKnob(`${S}/quotas/bytes`, String(s.quotaBytes));
    writeKnob(`${S}/quotas/reset_interval_ms`, String(s.quotaResetMs));
    // DAMON_RECLAIM's prioritisation within the quota: the oldest cold regions first.
    writeKnob(`${S}/quotas/weights/sz_permil`, '0');
    writeKnob(`${S}/quotas/weights/nr_accesses_permil`, '0');
    writeKnob(`${S}/quotas/weights/age_permil`, '1');
    writeKnob(`${S}/watermarks/metric`, 'free_mem_rate');
    writeKnob(`${S}/watermarks/interval_us`, String(s.wmarksIntervalUs));
    writeKnob(`${S}/watermarks/high`, String(s.wmarksHigh));
    writeKnob(`${S}/watermarks/mid`, String(s.wmarksMid));
    writeKnob(`${S}/watermarks/low`, String(s.wmarksLow));
    if (s.skipAnon) {
      writeKnob(`${S}/filters/nr_filters`, '1');
      writeKnob(`${S}/filters/0/type`, 'anon');
      writeKnob(`${S}/filters/0/matching`, 'Y');
    }
    writeKnob(`${K}/state`, 'on');
  } catch (err) {
    stopSysfsScheme();
    throw err;
  }
}

export interface SchemeStats {
  nrTried: number;
  bytesTried: number;
  nrApplied: number;
  bytesApplied: number;
  qtExceeds: number;
}

export function sysfsSchemeStats(): SchemeStats | null {
  if (!sysfsRunning()) return null;
  writeKnob(`${K}/state`, 'update_schemes_stats');
  const n = (f: string) => Number(readKnob(`${S}/stats/${f}`));
  return { nrTried: n('nr_tried'), bytesTried: n('sz_tried'), nrApplied: n('nr_applied'), bytesApplied: n('sz_applied'), qtExceeds: n('qt_exceeds') };
}
