import type { z } from 'zod';
import type { MglruResultSchema } from '../protocol/methods-memory.ts';
import { readKnob, writeKnob } from './knobs.ts';

/**
 * The multi-generational LRU switch. `enabled` holds a bit mask of its components (0x0007
 * when fully on); writing y/n turns all of them on or off.
 */
const KNOB = '/sys/kernel/mm/lru_gen/enabled';

export function mglruState(): z.infer<typeof MglruResultSchema> {
  const raw = readKnob(KNOB);
  return { enabled: Number.parseInt(raw, 16) !== 0, raw };
}

export function setMglru(enabled: boolean): z.infer<typeof MglruResultSchema> {
  writeKnob(KNOB, enabled ? 'y' : 'n');
  return mglruState();
}
