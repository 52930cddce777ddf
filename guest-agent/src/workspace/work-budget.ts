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
  private sliceStart = performance.now();

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
    const now = performance.now();
    if (now - this.sliceStart < SLICE_MS) return;
    if (now >= this.deadline) throw this.timeout();
    await yieldToLoop();
    this.sliceStart = performance.now();
  }

  timeout(detail?: string): HutchError {
    return new HutchError('timeout', `${this.tool} did not finish within ${this.ms} ms${detail ? `; ${detail}` : ''}`, { tool: this.tool, timeoutMs: this.ms });
  }
}
