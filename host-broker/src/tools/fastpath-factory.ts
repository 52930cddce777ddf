import type { Logger } from '../../../guest-agent/src/log.ts';
import { FastPath } from '../fastpath/index.ts';
import type { FastPathRunner } from './fastpath-runner.ts';

/**
 * The broker's fast path: bubblewrap + seccomp on the host workspace, with limits. Created
 * early in the broker's life because it forks its spawn helper while the heap is small.
 */
export async function createFastPath(log: Logger): Promise<FastPath & FastPathRunner> {
  const fp = await FastPath.create({ log: log.child({ part: 'fastpath' }) });
  log.info('fastpath.ready', { limits: fp.describe().limits.mechanism });
  return fp;
}
