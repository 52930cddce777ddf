import { performance } from 'node:perf_hooks';

/**
 * Watches the event loop with a 1 ms interval: `stop()` gives the longest the loop went
 * without a turn since the watch began (every session's calls wait that long).
 */
export function watchLoop(): { stop(): Promise<number> } {
  let last = performance.now();
  let gap = 0;
  const t = setInterval(() => {
    const now = performance.now();
    gap = Math.max(gap, now - last);
    last = now;
  }, 1);
  return {
    async stop() {
      // The interval's next turn closes the last gap (a block at the very end counts too).
      await new Promise((r) => setTimeout(r, 20));
      clearInterval(t);
      return gap;
    },
  };
}
