/** Polls `pred` until it holds; fails with `what` after `timeoutMs`. */
export async function waitFor(pred: () => Promise<boolean>, timeoutMs = 120_000, what = 'condition'): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await pred())) {
    if (Date.now() > deadline) throw new Error(`${what} not reached within ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 100));
  }
}
