import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { release } from 'node:os';

/**
 * What this agent's machine can do, announced in the protocol hello so the broker knows
 * which memory features it may use (idle page tracking needs CONFIG_IDLE_PAGE_TRACKING,
 * which Debian's generic kernel lacks).
 */
export function probeCapabilities(): Record<string, unknown> {
  return {
    kernel: release(),
    node: process.versions.node,
    idlePageTracking: existsSync('/sys/kernel/mm/page_idle/bitmap'),
    damonReclaim: existsSync('/sys/module/damon_reclaim/parameters'),
    mglru: readText('/sys/kernel/mm/lru_gen/enabled'),
    zswap: readParams('/sys/module/zswap/parameters'),
    cgroup2: existsSync('/sys/fs/cgroup/cgroup.controllers') ? readText('/sys/fs/cgroup/cgroup.controllers') : null,
  };
}

function readText(p: string): string | null {
  try {
    return readFileSync(p, 'utf8').trim();
  } catch {
    return null;
  }
}

function readParams(dir: string): Record<string, string> | null {
  try {
    const out: Record<string, string> = {};
    for (const f of readdirSync(dir)) {
      const v = readText(`${dir}/${f}`);
      if (v !== null) out[f] = v;
    }
    return out;
  } catch {
    return null;
  }
}
