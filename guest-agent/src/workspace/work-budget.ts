import { setImmediate as yieldToLoop } from 'node:timers/promises';
import { HutchError } from '../protocol/errors.ts';

/** How long a tree walk may keep the event loop before letting other calls run. */
const SLICE_MS = 8;

/**
 * The time a search tool (grep, glob, list) may take, and its manners on the event loop.
 * Glob matching is linear per name, but a long pattern over a big tree still adds up; so
 * walks call tick() per entry: every few milliseconds it yields to the loop (other
 * sessions' calls, /healthz, pings are served in between), and past the deadline it
 * throws a typed `timeout` instead of running on.
 */
export class WorkBudget {
  readonly deadline: number;
  private readonly slice = new LoopSlicer();

  constructor(
    readonly tool: string,
    readonly ms: number,
  ) {
    this.deadline = performance.now() + ms;
  }

  left(): number {
    return this.deadline - performance.now();
  }

  async tick(): Promise<void> {
    await this.slice.tick((now) => {
      if (now >= this.deadline) throw this.timeout();
    });
  }

  timeout(detail?: string): HutchError {
    return new HutchError('timeout', `${this.tool} did not finish within ${this.ms} ms${detail ? `; ${detail}` : ''}`, { tool: this.tool, timeoutMs: this.ms });
  }
}

/**
 * Manners on the event loop for work whose size a tenant decides (a pull of 100,000 small
 * files, an lstat per entry): call tick() per unit of work; every few milliseconds it
 * yields, so other sessions' calls, pings and /healthz are served in between.
 */
export class LoopSlicer {
  private sliceStart = performance.now();

  constructor(private readonly sliceMs = SLICE_MS) {}

  /** `atYield` runs when the slice is used up, before yielding (it may throw to stop the work). */
  async tick(atYield?: (now: number) => void): Promise<void> {
    const now = performance.now();
    if (now - this.sliceStart < this.sliceMs) return;
    atYield?.(now);
    await yieldToLoop();
    this.sliceStart = performance.now();
  }
}
