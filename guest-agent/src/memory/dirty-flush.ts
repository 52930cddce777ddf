import { readKnobOr, writeKnob } from './knobs.ts';

/**
 * The opt-in dirty-flush profile (design.md): small vm.dirty_* thresholds and a 100 ms
 * writeback tick keep little dirty page cache around (average Dirty ~77 -> ~5 MiB on a
 * Parquet job) at the price of 2.1-2.5x slower write-heavy work. Off restores the kernel's
 * defaults (ratios, not byte limits: writing a ratio clears the matching *_bytes knob).
 */
const VM = '/proc/sys/vm';
const FLUSH: Record<string, string> = {
  dirty_background_bytes: '16777216',
  dirty_bytes: '33554432',
  dirty_writeback_centisecs: '10',
  dirty_expire_centisecs: '100',
};
const DEFAULTS: Record<string, string> = {
  dirty_background_ratio: '10',
  dirty_ratio: '20',
  dirty_writeback_centisecs: '500',
  dirty_expire_centisecs: '3000',
};

export function setDirtyFlush(on: boolean): void {
  for (const [k, v] of Object.entries(on ? FLUSH : DEFAULTS)) writeKnob(`${VM}/${k}`, v);
}

export function dirtyFlushOn(): boolean {
  return readKnobOr(`${VM}/dirty_bytes`) === FLUSH['dirty_bytes'] && readKnobOr(`${VM}/dirty_writeback_centisecs`) === FLUSH['dirty_writeback_centisecs'];
}
