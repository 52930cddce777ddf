/**
 * A token bucket of bytes per second, shared by one sandbox's proxied connections: each
 * chunk takes its bytes, and a connection whose chunk left the bucket in debt pauses for
 * the time the debt takes to earn back. A burst of one second's worth passes at once.
 */
export class RateLimiter {
  private tokens: number;
  private last = performance.now();

  constructor(readonly bytesPerSecond: number) {
    this.tokens = bytesPerSecond;
  }

  /** Takes `bytes`; returns how long the caller should pause (ms) before the next chunk. */
  take(bytes: number): number {
    const now = performance.now();
    this.tokens = Math.min(this.bytesPerSecond, this.tokens + ((now - this.last) / 1000) * this.bytesPerSecond);
    this.last = now;
    this.tokens -= bytes;
    return this.tokens >= 0 ? 0 : Math.ceil((-this.tokens / this.bytesPerSecond) * 1000);
  }
}
