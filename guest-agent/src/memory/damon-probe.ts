import { existsSync, readdirSync } from 'node:fs';
import { HutchError } from '../protocol/errors.ts';
import { readKnob, writeKnob } from './knobs.ts';

/**
 * What DAMON sees in physical memory: a monitoring-only kdamond (DAMON sysfs, action
 * "stat") over the same range and intervals DAMON_RECLAIM uses, and the regions it
 * found with their access counts and ages. DAMON_RECLAIM keeps its own context private;
 * this shows whether regions ever look cold (nr_accesses 0 for min_age) to its scheme.
 */
const ADMIN = '/sys/kernel/mm/damon/admin';

export interface DamonRegion {
  start: number;
  end: number;
  nrAccesses: number;
  age: number;
}

export async function probeDamonRegions(span: { start: number; end: number }, ms: number, intervals = { sampleUs: 5000, aggrUs: 100000 }): Promise<DamonRegion[]> {
  if (!existsSync(`${ADMIN}/kdamonds/nr_kdamonds`)) throw new HutchError('unavailable', 'this kernel has no DAMON sysfs interface (CONFIG_DAMON_SYSFS)');
  if (readKnob(`${ADMIN}/kdamonds/nr_kdamonds`) !== '0') throw new HutchError('busy', 'a DAMON sysfs kdamond is already configured');
  const k = `${ADMIN}/kdamonds/0`;
  writeKnob(`${ADMIN}/kdamonds/nr_kdamonds`, '1');
  try {
    writeKnob(`${k}/contexts/nr_contexts`, '1');
    const c = `${k}/contexts/0`;
    writeKnob(`${c}/operations`, 'paddr');
    writeKnob(`${c}/monitoring_attrs/intervals/sample_us`, String(intervals.sampleUs));
    writeKnob(`${c}/monitoring_attrs/intervals/aggr_us`, String(intervals.aggrUs));
    writeKnob(`${c}/monitoring_attrs/nr_regions/min`, '10');
    writeKnob(`${c}/monitoring_attrs/nr_regions/max`, '1000');
    writeKnob(`${c}/targets/nr_targets`, '1');
    writeKnob(`${c}/targets/0/regions/nr_regions`, '1');
    writeKnob(`${c}/targets/0/regions/0/start`, String(span.start));
    writeKnob(`${c}/targets/0/regions/0/end`, String(span.end));
    writeKnob(`${c}/schemes/nr_schemes`, '1');
    writeKnob(`${c}/schemes/0/action`, 'stat');
    // A new scheme's access pattern is 0..0 for everything; the probe wants every region.
    const ap = `${c}/schemes/0/access_pattern`;
    writeKnob(`${ap}/sz/max`, '18446744073709551615');
    writeKnob(`${ap}/nr_accesses/max`, '4294967295');
    writeKnob(`${ap}/age/max`, '4294967295');
    writeKnob(`${k}/state`, 'on');
    await new Promise((r) => setTimeout(r, ms));
    writeKnob(`${k}/state`, 'update_schemes_tried_regions');
    const dir = `${c}/schemes/0/tried_regions`;
    const regions: DamonRegion[] = [];
    for (const e of readdirSync(dir)) {
      if (!/^\d+$/.test(e)) continue;
      const f = (n: string) => Number(readKnob(`${dir}/${e}/${n}`));
      regions.push({ start: f('start'), end: f('end'), nrAccesses: f('nr_accesses'), age: f('age') });
    }
    return regions.sort((a, b) => a.start - b.start);
  } finally {
    try {
      writeKnob(`${k}/state`, 'off');
    } catch {
      // not running
    }
    writeKnob(`${ADMIN}/kdamonds/nr_kdamonds`, '0');
  }
}
