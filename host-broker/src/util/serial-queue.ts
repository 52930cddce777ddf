/**
 * Runs tasks one at a time in submission order: calls of one session execute in order
 * while sessions run concurrently. A failing task does not stop the queue.
 */
export class SerialQueue {
  private tail: Promise<unknown> = Promise.resolve();
  private pending = 0;

  get length(): number {
    return this.pending;
  }

  run<T>(task: () => Promise<T>): Promise<T> {
    this.pending++;
    const p = this.tail.then(task).finally(() => {
      this.pending--;
    });
    this.tail = p.catch(() => undefined);
    return p;
  }

  /** Resolves when everything queued so far has finished. */
  idle(): Promise<void> {
    return this.tail.then(() => undefined);
  }
}
