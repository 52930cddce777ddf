import { existsSync, readFileSync } from 'node:fs';
import type { z } from 'zod';
import { HutchError } from '../protocol/errors.ts';
import type { DamonStateSchema } from '../protocol/methods-memory.ts';
import { damonSysfsAvailable, startSysfsScheme, stopSysfsScheme, sysfsKdamondPid, sysfsRunning, sysfsSchemeStats, type ReclaimScheme } from './damon-sysfs.ts';
import { dirtyFlushOn, setDirtyFlush } from './dirty-flush.ts';
import { parseBool, readKnob, readKnobOr, writeKnob } from './knobs.ts';

/**
 * DAMON_RECLAIM profiles: kdamond watches physical memory and pages out regions nobody
 * touched for min_age, within a time/size quota, while free memory sits between the
 * watermarks. Why it reclaimed nothing by hand here, in order of how much each mattered:
 *
 * 1. The damon_reclaim module of this 6.12 kernel never applies its scheme (see
 *    damon-sysfs.ts): whatever the parameters, kdamond only monitors. Profiles therefore
 *    run through DAMON sysfs by default (backend 'sysfs'), with the module's exact scheme.
 * 2. Parameters written to the module while it runs are ignored until commit_inputs=Y; a
 *    profile is applied with kdamond stopped, then started.
 * 3. The watermark metric is the free memory rate (per mille): active only once free memory
 *    falls below wmarks_mid, inactive above wmarks_high. The kernel default (500/400/200)
 *    leaves a mostly idle guest inactive; `tuned` (990/990/200) is active almost always.
 * 4. min_age (us) of the kernel default (120 s) and of `previous` (60 s): pages must stay
 *    untouched that long, longer than any short test.
 * 5. The monitored range defaults to the biggest "System RAM" block only; RAM above a hole
 *    (guests > 3 GiB) is never monitored. The range is set to min start / max end + 1 of
 *    all System RAM ranges in /proc/iomem.
 * skip_anon=Y leaves anonymous memory to memory.reclaim: DAMON here trims page cache.
 */

const DIR = '/sys/module/damon_reclaim/parameters';
type DamonState = z.infer<typeof DamonStateSchema>;
export type DamonProfileName = 'previous' | 'tuned' | 'off';
export type DamonBackend = 'sysfs' | 'module';

/** The two profiles of design.md, as damon_reclaim parameters (units as the kernel's docs). */
export const DAMON_PROFILE_PARAMS: Record<'previous' | 'tuned', Record<string, string>> = {
  previous: {
    min_age: '60000000',
    quota_ms: '100',
    quota_sz: '1073741824',
    quota_reset_interval_ms: '1000',
    wmarks_high: '900',
    wmarks_mid: '700',
    wmarks_low: '200',
    wmarks_interval: '5000000',
    skip_anon: 'Y',
  },
  tuned: {
    min_age: '100000',
    quota_ms: '20',
    quota_sz: '1073741824',
    quota_reset_interval_ms: '500',
    wmarks_high: '990',
    wmarks_mid: '990',
    wmarks_low: '200',
    wmarks_interval: '1000000',
    skip_anon: 'Y',
  },
};

/** damon_reclaim's monitoring defaults (sample 5 ms, aggregate 100 ms, 10..1000 regions). */
function schemeOf(p: Record<string, string>): ReclaimScheme {
  const n = (k: string) => Number(p[k]);
  return {
    minAgeUs: n('min_age'),
    quotaMs: n('quota_ms'),
    quotaBytes: n('quota_sz'),
    quotaResetMs: n('quota_reset_interval_ms'),
    wmarksHigh: n('wmarks_high'),
    wmarksMid: n('wmarks_mid'),
    wmarksLow: n('wmarks_low'),
    wmarksIntervalUs: n('wmarks_interval'),
    skipAnon: p['skip_anon'] === 'Y',
    sampleUs: 5000,
    aggrUs: 100000,
    minRegions: 10,
    maxRegions: 1000,
  };
}

const MODULE_READ_BACK = [
  'enabled', 'min_age', 'quota_ms', 'quota_sz', 'quota_reset_interval_ms', 'wmarks_high', 'wmarks_mid', 'wmarks_low',
  'wmarks_interval', 'skip_anon', 'sample_interval', 'aggr_interval', 'monitor_region_start', 'monitor_region_end',
];

/** What the agent started through sysfs (DAMON sysfs does not remember profile names). */
let sysfsProfile: { name: 'previous' | 'tuned'; span: { start: number; end: number } } | null = null;

/** [min start, max end + 1) over every "System RAM" range of /proc/iomem (needs root: others see zeros). */
export function systemRamSpan(iomem = readFileSync('/proc/iomem', 'utf8')): { start: number; end: number } | null {
  let start = Infinity;
  let end = -Infinity;
  for (const line of iomem.split('\n')) {
    const m = /^\s*([0-9a-f]+)-([0-9a-f]+) : System RAM$/.exec(line);
    if (!m) continue;
    start = Math.min(start, Number.parseInt(m[1] as string, 16));
    end = Math.max(end, Number.parseInt(m[2] as string, 16) + 1);
  }
  if (!Number.isFinite(start) || end <= start || end <= 1) return null;
  return { start, end };
}

export function damonAvailable(): boolean {
  return existsSync(`${DIR}/enabled`) || damonSysfsAvailable();
}

function moduleEnabled(): boolean {
  return parseBool(readKnobOr(`${DIR}/enabled`, 'N') ?? 'N');
}

export function damonState(): DamonState {
  if (!damonAvailable()) throw new HutchError('unavailable', 'this kernel has no DAMON_RECLAIM nor DAMON sysfs (CONFIG_DAMON_RECLAIM, CONFIG_DAMON_SYSFS)');
  if (sysfsProfile && sysfsRunning()) {
    const st = sysfsSchemeStats();
    return {
      profile: sysfsProfile.name,
      backend: 'sysfs',
      enabled: true,
      kdamondPid: sysfsKdamondPid(),
      params: DAMON_PROFILE_PARAMS[sysfsProfile.name],
      monitorRegion: sysfsProfile.span,
      stats: {
        nrReclaimTriedRegions: st?.nrTried ?? 0,
        bytesReclaimTriedRegions: st?.bytesTried ?? 0,
        nrReclaimedRegions: st?.nrApplied ?? 0,
        bytesReclaimedRegions: st?.bytesApplied ?? 0,
        nrQuotaExceeds: st?.qtExceeds ?? 0,
      },
      dirtyFlush: dirtyFlushOn(),
    };
  }
  const params: Record<string, string> = {};
  for (const k of MODULE_READ_BACK) {
    const v = readKnobOr(`${DIR}/${k}`);
    if (v !== null) params[k] = v;
  }
  const enabled = moduleEnabled();
  const pid = Number(readKnobOr(`${DIR}/kdamond_pid`, '-1'));
  const stat = (k: string) => Number(readKnobOr(`${DIR}/${k}`, '0'));
  const start = Number(params['monitor_region_start'] ?? 0);
  const end = Number(params['monitor_region_end'] ?? 0);
  return {
    profile: enabled ? matchProfile(params) : 'off',
    backend: enabled ? 'module' : null,
    enabled,
    kdamondPid: pid > 0 ? pid : null,
    params,
    monitorRegion: end > start ? { start, end } : null,
    stats: {
      nrReclaimTriedRegions: stat('nr_reclaim_tried_regions'),
      bytesReclaimTriedRegions: stat('bytes_reclaim_tried_regions'),
      nrReclaimedRegions: stat('nr_reclaimed_regions'),
      bytesReclaimedRegions: stat('bytes_reclaimed_regions'),
      nrQuotaExceeds: stat('nr_quota_exceeds'),
    },
    dirtyFlush: dirtyFlushOn(),
  };
}

function matchProfile(params: Record<string, string>): 'previous' | 'tuned' | 'custom' {
  for (const name of ['previous', 'tuned'] as const) {
    if (Object.entries(DAMON_PROFILE_PARAMS[name]).every(([k, v]) => params[k] === v)) return name;
  }
  return 'custom';
}

export function applyDamon(profile: DamonProfileName, dirtyFlush: boolean | undefined, backend: DamonBackend = 'sysfs'): DamonState {
  if (!damonAvailable()) throw new HutchError('unavailable', 'this kernel has no DAMON_RECLAIM nor DAMON sysfs (CONFIG_DAMON_RECLAIM, CONFIG_DAMON_SYSFS)');
  if (backend === 'module' && !existsSync(`${DIR}/enabled`)) throw new HutchError('unavailable', 'this kernel has no damon_reclaim module (CONFIG_DAMON_RECLAIM)', { knob: DIR });
  // Both stopped first: one kdamond at a time, and module parameters only apply at start.
  if (moduleEnabled()) writeKnob(`${DIR}/enabled`, 'N');
  if (damonSysfsAvailable()) stopSysfsScheme();
  sysfsProfile = null;
  if (profile !== 'off') {
    const span = systemRamSpan();
    if (!span) throw new HutchError('internal', 'no "System RAM" range in /proc/iomem (is the agent root?)');
    if (backend === 'sysfs') {
      startSysfsScheme(schemeOf(DAMON_PROFILE_PARAMS[profile]), span);
      sysfsProfile = { name: profile, span };
    } else {
      for (const [k, v] of Object.entries(DAMON_PROFILE_PARAMS[profile])) writeKnob(`${DIR}/${k}`, v);
      writeKnob(`${DIR}/monitor_region_start`, String(span.start));
      writeKnob(`${DIR}/monitor_region_end`, String(span.end));
      writeKnob(`${DIR}/enabled`, 'Y');
    }
  }
  if (dirtyFlush !== undefined) setDirtyFlush(dirtyFlush);
  const state = damonState();
  if (profile !== 'off' && !state.enabled) throw new HutchError('internal', `DAMON did not start with profile ${profile} (${backend})`, { params: state.params });
  return state;
}
