import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import WebSocket from 'ws';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/**
 * Issue 12 item 10 (first half): the op table was checked with `in`, so `toString`,
 * `constructor` and `__proto__` (inherited from Object.prototype) were accepted as ops.
 */
describe('op names', () => {
  let b: TestBroker;
  beforeAll(async () => {
    b = await startBroker();
  });
  afterAll(async () => b?.stop());

  it('refuses names that are only inherited properties of the op table', async () => {
    const raw = new WebSocket(b.url, { headers: { authorization: `Bearer ${b.token}` } });
    const answers = new Map<number, { r?: unknown; e?: { code: string } }>();
    raw.on('message', (d) => {
      const m = JSON.parse(String(d)) as { t: string; id: number; r?: unknown; e?: { code: string } };
      if (m.t === 'res') answers.set(m.id, m);
    });
    await new Promise((r) => raw.once('open', r));
    const names = ['toString', 'constructor', '__proto__', 'hasOwnProperty', 'valueOf', '__defineGetter__', 'isPrototypeOf'];
    names.forEach((op, i) => raw.send(JSON.stringify({ t: 'req', id: i + 1, op, p: {} })));
    raw.send(JSON.stringify({ t: 'req', id: 100, op: 'sessions', p: {} }));
    while (answers.size < names.length + 1) await new Promise((r) => setTimeout(r, 20));
    for (let i = 0; i < names.length; i++) expect(answers.get(i + 1), names[i]).toMatchObject({ e: { code: 'not_found' } });
    expect(answers.get(100)?.e).toBeUndefined();
    raw.close();
  });

  it('says who the connection is and what is in force in its hello', async () => {
    const raw = new WebSocket(b.url, { headers: { authorization: `Bearer ${b.token}` } });
    const hello = await new Promise<Record<string, unknown>>((r) => raw.once('message', (d) => r(JSON.parse(String(d)) as Record<string, unknown>)));
    expect(hello).toMatchObject({ t: 'hello', principal: 'default', backend: 'unsafe-local', policy: { idleMs: expect.anything() }, versions: { api: 1 } });
    expect((hello['limits'] as Record<string, number>)['maxPayloadBytes']).toBeLessThanOrEqual(64 * 1024 * 1024);
    raw.close();
  });
});
