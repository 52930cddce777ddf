import { describe, expect, it } from 'vitest';
import { OVERFLOW_FACTOR, SendBudget, type SendLimits } from '../host-broker/src/api/send-budget.ts';

/** What the broker holds for clients that have not taken it (the security tests drive it with real sockets). */
describe('SendBudget', () => {
  const limits: SendLimits = { connectionBytes: 100, principalBytes: 250, totalBytes: 1000, stallMs: 60_000 };

  /** A connection whose socket takes a write only when the test says so. */
  function connection(budget: SendBudget, principal: string) {
    const closed = new AbortController();
    const events: string[] = [];
    const socket: Array<{ label: string; take: () => void }> = [];
    const sender = budget.join(principal, {
      pause: () => events.push('pause'),
      resume: () => events.push('resume'),
      close: (why) => events.push(`close ${why}`),
      closed: closed.signal,
    });
    return {
      sender,
      events,
      socket,
      send: (label: string, bytes: number) => sender.send(bytes, (take) => socket.push({ label, take })),
      takeAll: () => {
        for (const w of socket.splice(0)) w.take();
      },
      close: () => {
        closed.abort(new Error('closed'));
        sender.leave();
      },
    };
  }

  it('writes in order what fits; past the bound frames wait in order and the connection pauses until its socket takes some', async () => {
    const budget = new SendBudget(limits);
    const c = connection(budget, 'alice');
    await c.send('a', 60);
    const b = c.send('b', 60); // 120 > 100: waits
    const tiny = c.send('c', 1); // fits, but not before b
    await new Promise((r) => setTimeout(r, 5));
    expect(c.socket.map((w) => w.label)).toEqual(['a']);
    expect(c.events).toEqual(['pause']);
    let started = false;
    const room = c.sender.room().then(() => (started = true));
    await new Promise((r) => setTimeout(r, 5));
    expect(started).toBe(false);
    c.takeAll();
    await Promise.all([b, tiny, room]);
    expect(c.socket.map((w) => w.label)).toEqual(['b', 'c']);
    expect(c.events).toEqual(['pause', 'resume']);
    c.takeAll();
    expect([c.sender.queued, budget.queuedBytes('alice'), budget.queuedBytes()]).toEqual([0, 0, 0]);
    c.close();
  });

  it("a principal past its bound pauses all its connections and its frames wait, not another principal's", async () => {
    const budget = new SendBudget(limits);
    const [a1, a2, a3, bob] = [connection(budget, 'alice'), connection(budget, 'alice'), connection(budget, 'alice'), connection(budget, 'bob')];
    await a1.send('x', 90);
    await a2.send('y', 90);
    const z = a3.send('z', 90); // alice 270 >= 250: waits, and every alice connection pauses
    await new Promise((r) => setTimeout(r, 5));
    expect([a1.events, a2.events, a3.events, a3.socket.length, bob.events]).toEqual([['pause'], ['pause'], ['pause'], 0, []]);
    await bob.send('w', 50);
    expect(bob.socket.map((w) => w.label)).toEqual(['w']);
    a1.takeAll();
    await z;
    expect([a1.events, a2.events, a3.events]).toEqual([['pause', 'resume'], ['pause', 'resume'], ['pause', 'resume']]);
    expect(budget.peak.get('alice')).toBe(270);
    for (const c of [a1, a2, a3, bob]) c.close();
    expect(budget.queuedBytes()).toBe(0);
  });

  it('a connection whose socket takes nothing for the stall time is told to close; one that closes gives back what it held and drops what waited', async () => {
    const budget = new SendBudget({ ...limits, stallMs: 50 });
    const c = connection(budget, 'alice');
    await c.send('a', 80);
    const waiting = c.send('b', 80);
    await new Promise((r) => setTimeout(r, 120));
    expect(c.events).toContain('close stalled');
    c.close();
    await expect(waiting).rejects.toThrow('closed');
    expect(budget.queuedBytes()).toBe(0);
    await expect(c.sender.room()).rejects.toThrow('closed');
  });

  it(`answers waiting past ${OVERFLOW_FACTOR} times the principal's bound close its connection holding the most`, async () => {
    const budget = new SendBudget(limits);
    const quiet = connection(budget, 'alice');
    const hog = connection(budget, 'alice');
    await quiet.send('q', 10);
    const waits: Array<Promise<void>> = [hog.send('first', 100).catch(() => undefined)];
    for (let i = 0; i < 9 && !hog.events.includes('close overflow'); i++) waits.push(hog.send(`w${i}`, 100).catch(() => undefined));
    expect(hog.events).toContain('close overflow');
    expect(quiet.events).not.toContain('close overflow');
    expect(budget.queuedBytes('alice')).toBeGreaterThan(OVERFLOW_FACTOR * limits.principalBytes);
    hog.close();
    await Promise.all(waits);
    expect(budget.queuedBytes('alice')).toBe(10);
    quiet.close();
  });
});
