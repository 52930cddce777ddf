import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { Hutch } from '../../host-broker/src/sdk/index.ts';
import { MAX_CALL_TIMEOUT_MS } from '../../host-broker/src/sessions/session.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/** Issue 12 item 5: a caller's timeout has a ceiling (a call holds its session and a VM slot while it runs). */
describe('call timeouts have a ceiling', () => {
  let b: TestBroker;
  let hutch: Hutch;
  beforeAll(async () => {
    b = await startBroker();
    hutch = await b.connect();
  }, 120_000);
  afterAll(async () => b?.stop());

  it('a timeout above the ceiling is refused with a typed error naming the limit, on every route', async () => {
    const sb = await hutch.create({ workspace: { files: { 'a.txt': 'x\n' } } });
    for (const command of ['cat a.txt', 'sleep 1']) {
      await expect(sb.run(command, { timeoutMs: MAX_CALL_TIMEOUT_MS + 1 })).rejects.toMatchObject({ code: 'bad_request', context: { limit: MAX_CALL_TIMEOUT_MS } });
    }
    // At the ceiling it runs.
    expect((await sb.run('cat a.txt', { timeoutMs: MAX_CALL_TIMEOUT_MS })).stdout).toBe('x\n');
    await sb.close();
  }, 120_000);
});
