import { readFileSync, writeFileSync } from 'node:fs';
import { HutchError } from '../protocol/errors.ts';

/**
 * Reading and writing kernel knobs (sysfs, procfs, cgroupfs) with errors a caller can act
 * on: a knob that does not exist means this kernel lacks the feature (`unavailable`), a
 * value the kernel refuses is the caller's (`bad_request`), anything else is `internal`.
 */

export function readKnob(path: string): string {
  try {
    return readFileSync(path, 'utf8').trim();
  } catch (err) {
    throw knobError(err, path, undefined);
  }
}

export function readKnobOr(path: string, fallback: string | null = null): string | null {
  try {
    return readFileSync(path, 'utf8').trim();
  } catch {
    return fallback;
  }
}

export function writeKnob(path: string, value: string): void {
  try {
    writeFileSync(path, value);
  } catch (err) {
    throw knobError(err, path, value);
  }
}

/** Y/N, 1/0 knobs as booleans. */
export function parseBool(s: string): boolean {
  return s === 'Y' || s === 'y' || s === '1' || s === 'true';
}

/** "key value" lines (/proc/vmstat, memory.stat) or "Key: value kB" lines (/proc/meminfo). */
export function readKeyValues(path: string): Map<string, number> {
  const out = new Map<string, number>();
  for (const line of readKnob(path).split('\n')) {
    const m = /^([\w()]+):?\s+(\d+)/.exec(line);
    if (m) out.set(m[1] as string, Number(m[2]));
  }
  return out;
}

function knobError(err: unknown, path: string, value: string | undefined): HutchError {
  const code = (err as NodeJS.ErrnoException).code;
  const ctx = { knob: path, ...(value !== undefined ? { value } : {}), errno: code };
  if (code === 'ENOENT') return new HutchError('unavailable', `this kernel has no ${path}`, ctx);
  // EBUSY: e.g. zswap's zpool cannot change while the pool is in use.
  if (code === 'EINVAL' || code === 'ENODEV' || code === 'EBUSY' || code === 'ERANGE') {
    return new HutchError('bad_request', `the kernel refused ${JSON.stringify(value)} for ${path} (${code})`, ctx);
  }
  if (code === 'EACCES' || code === 'EPERM' || code === 'EROFS') return new HutchError('permission_denied', `cannot ${value === undefined ? 'read' : 'write'} ${path}: ${code} (the agent must run as root in the guest)`, ctx);
  return new HutchError('internal', `${value === undefined ? 'reading' : 'writing'} ${path} failed: ${(err as Error).message}`, ctx, { cause: err });
}
