import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';

/**
 * The VM sizes (memory, vCPUs) a session may ask for. Each distinct size a session wakes
 * with costs a pristine snapshot of its own, built once and kept in the cache: a cold boot
 * of the guest (seconds on KVM, about ten under TCG) and its memory image on disk. Any size
 * a tenant named used to be built, so a token holder creating sessions of 513, 514, 515...
 * MiB made the broker boot guests and fill its cache without end, and one asking for 64
 * vCPUs or a terabyte of RAM got a QEMU of that size. The operator lists the sizes instead.
 */
export interface SessionSizes {
  memoryMiB: readonly number[];
  cpus: readonly number[];
}

/** Powers of two around the default: at most eight pristine snapshots per template. */
export const DEFAULT_SESSION_SIZES: SessionSizes = { memoryMiB: [256, 512, 1024, 2048], cpus: [1, 2] };

/** The size of a session that names none, when the broker allows it (else the smallest allowed). */
const PREFERRED = { memoryMiB: 512, cpus: 1 };

/** Protocol bounds (harness-protocol CreateParams): a listed size outside them could never be asked. */
const BOUNDS = { memoryMiB: [64, 1024 * 1024], cpus: [1, 64] } as const;

/** Checks an operator's list (flags, options): whole numbers within the protocol's bounds, at least one. */
export function validateSessionSizes(s: SessionSizes): SessionSizes {
  for (const k of ['memoryMiB', 'cpus'] as const) {
    const [lo, hi] = BOUNDS[k];
    if (s[k].length === 0) throw new HutchError('bad_request', `session sizes: no ${k} listed`);
    for (const n of s[k]) {
      if (!Number.isInteger(n) || n < lo || n > hi) throw new HutchError('bad_request', `session sizes: ${k} ${n} is not a whole number from ${lo} to ${hi}`);
    }
  }
  return { memoryMiB: [...new Set(s.memoryMiB)].sort((a, b) => a - b), cpus: [...new Set(s.cpus)].sort((a, b) => a - b) };
}

/** Parses a flag's comma-separated list ("256,512,1024"). */
export function parseSizeList(flag: string, value: string): number[] {
  const parts = value.split(',').map((p) => p.trim());
  const out = parts.map(Number);
  if (parts.some((p) => p === '') || out.some((n) => !Number.isInteger(n) || n <= 0)) {
    throw new HutchError('bad_request', `${flag} takes whole numbers separated by commas, got ${JSON.stringify(value)}`);
  }
  return out;
}

/** The size a create gets: what it asked, if listed (bad_request naming the list if not), else the default. */
export function sessionSize(sizes: SessionSizes, asked: { memoryMiB?: number | undefined; cpus?: number | undefined }): { memoryMiB: number; cpus: number } {
  const pick = (k: 'memoryMiB' | 'cpus', flag: string): number => {
    const list = sizes[k];
    const a = asked[k];
    if (a === undefined) return list.includes(PREFERRED[k]) ? PREFERRED[k] : (list[0] as number);
    if (!list.includes(a)) {
      throw new HutchError('bad_request', `${k} ${a} is not a size this broker offers: one of ${list.join(', ')} (the operator's ${flag})`, { [k]: a, allowed: [...list] });
    }
    return a;
  };
  return { memoryMiB: pick('memoryMiB', '--session-memory-mib'), cpus: pick('cpus', '--session-cpus') };
}
