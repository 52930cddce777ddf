/**
 * Seeded randomness for the density bench: a run with the same --seed replays the same
 * tenants picking the same sessions after the same away times, so two levels (or two
 * commits) are compared on identical arrival patterns.
 */
export type Rng = () => number;

/** mulberry32: tiny, fast, and good enough for workload generation (not for secrets). */
export function seededRng(seed: number): Rng {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** A stream per (step, tenant), so adding a tenant does not reshuffle the others' draws. */
export function streamSeed(seed: number, ...parts: Array<number | string>): number {
  let h = (seed ^ 0x811c9dc5) >>> 0;
  for (const p of parts.join('/')) h = Math.imul(h ^ p.charCodeAt(0), 0x01000193) >>> 0;
  return h;
}

function standardNormal(rng: Rng): number {
  // Box-Muller; 1 - u keeps log() away from 0.
  const u = 1 - rng();
  const v = rng();
  return Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * v);
}

/**
 * Log-normal with the given arithmetic mean. sigma is the spread of the underlying
 * normal; mu is chosen so the mean (not the median) comes out as asked, which is how
 * the published method states the away time ("mean 2 minutes").
 */
export function logNormal(rng: Rng, mean: number, sigma: number): number {
  const mu = Math.log(mean) - (sigma * sigma) / 2;
  return Math.exp(mu + sigma * standardNormal(rng));
}

export function pick<T>(rng: Rng, items: readonly T[]): T {
  if (items.length === 0) throw new Error('pick from an empty list');
  return items[Math.min(items.length - 1, Math.floor(rng() * items.length))] as T;
}
