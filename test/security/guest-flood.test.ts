import { afterEach, describe, expect, it } from 'vitest';
import { GUEST_LOOP_SHARE, LoopShare } from '../../guest-agent/src/protocol/loop-share.ts';
import { encodeFrame } from '../../guest-agent/src/protocol/frame-codec.ts';
import { OUTPUT_BACKLOG_BYTES } from '../../guest-agent/src/protocol/connection.ts';
import type { Logger } from '../../guest-agent/src/log.ts';
import { flood, guestPair, type GuestPair } from '../helpers/hostile-guest.ts';
import { waitFor } from '../helpers/wait-for.ts';

/**
 * A guest that is no longer ours (a tenant with root in it) writes whatever it likes to the
 * agent channel, and the broker decodes it on the loop every session shares. The cheapest
 * way to hurt: answers to requests nobody made, each a 1 MiB frame of the costliest
 * content (helpers/hostile-guest.ts). Unguarded, the broker did nothing else while the
 * flood lasted, ~180 ms per frame.
 */

const cleanups: Array<() => void> = [];
afterEach(() => {
  while (cleanups.length) cleanups.pop()?.();
});

async function guest(opts: { guarded: boolean; log?: Logger }): Promise<GuestPair> {
  const g = await guestPair(opts);
  cleanups.push(g.close);
  return g;
}

describe('a guest flooding the broker with costly frames', () => {
  it('frames past the shape limits are refused unread, and a guest that keeps sending them loses its channel', async () => {
    const lines: Array<Record<string, unknown>> = [];
    const log = {
      debug: () => undefined,
      info: () => undefined,
      warn: (msg: string, fields: Record<string, unknown> = {}) => void (msg === 'protocol.bad_frame' && lines.push(fields)),
      error: () => undefined,
      child: () => log,
    } as unknown as Logger;
    const hostile = await guest({ guarded: true, log });
    const honest = await guest({ guarded: true });
    const f = flood(hostile, 'empty-maps');
    const closed = await hostile.client.connection.closed;
    f.stop();
    expect(closed).toMatchObject({ code: 'bad_request', message: expect.stringContaining('more than 1000 bad frames') });
    expect(lines.length).toBeGreaterThan(1000);
    expect(lines[0]).toMatchObject({ code: 'too_large', error: expect.stringContaining('maps, arrays, binaries and extensions') });
    // The other guest on the same loop is untouched.
    expect(typeof (await honest.client.connection.request('ping', {})).now).toBe('number');
    expect(honest.client.connection.isOpen).toBe(true);
  });

  it('the costliest frames the limits let through are paced to its share of the loop, while another guest on the same loop is answered', async () => {
    const hostile = await guest({ guarded: true });
    const honest = await guest({ guarded: true });
    const f = flood(hostile, 'within-limits');
    // The honest guest's calls keep completing while the flood goes on.
    const answered: number[] = [];
    for (let i = 0; i < 5; i++) {
      await new Promise((r) => setTimeout(r, 300));
      answered.push((await honest.client.connection.request('ping', {})).now);
    }
    f.stop();
    const pacing = hostile.client.connection.pacing;
    // Reading the hostile guest stopped (the bound this gives is the LoopShare test below;
    // what it is worth in loop time, bench/guest-flood.ts).
    expect(pacing.paused).toBeGreaterThan(0);
    expect(pacing.pausedMs).toBeGreaterThan(0);
    expect(honest.client.connection.pacing.paused).toBe(0);
    expect(answered).toHaveLength(5);
    // The hostile guest still has its session: pacing is not a punishment, only a budget.
    expect(hostile.client.connection.isOpen).toBe(true);
  });
});

describe('a guest that sends requests and never reads the answers', () => {
  it("stops being read once the broker's answers to it pass the backlog limit, and the broker's queue stays bounded", async () => {
    const hostile = await guest({ guarded: true });
    const honest = await guest({ guarded: true });
    const epoch = (hostile.client.connection.peer as { ep: number }).ep;
    // The guest's side stops reading (its kernel buffer fills, then the broker's queue would).
    hostile.agentSocket.pause();
    // 400,000 requests for a method nobody serves: each answered not_found, none a protocol error.
    const frames = Buffer.concat(Array.from({ length: 400_000 }, (_, i) => encodeFrame({ t: 'req', id: i + 1, m: 'no.such.method', p: null, ep: epoch }, 1024)));
    let sent = false;
    hostile.agentSocket.write(frames, () => void (sent = true));
    const conn = hostile.client.connection;
    // Generous: answering 16 MiB of not_found at a fifth of the loop takes a while on a loaded host.
    await waitFor(async () => conn.backlogPauses > 0, 120_000, 'the broker stopping reading the guest');
    const queued = () => (conn as unknown as { socket: { writableLength: number } }).socket.writableLength;
    const atPause = queued();
    await new Promise((r) => setTimeout(r, 500));
    // Reading stopped: nothing more was answered, and the guest could not hand over all it wrote.
    expect(queued()).toBe(atPause);
    expect(atPause).toBeLessThan(OUTPUT_BACKLOG_BYTES + 1024 * 1024);
    expect(sent).toBe(false);
    expect(typeof (await honest.client.connection.request('ping', {})).now).toBe('number');
    // Once the guest reads again, the broker reads it again, and answers everything.
    hostile.agentSocket.resume();
    await waitFor(async () => sent, 120_000, 'every request answered and read');
    expect(conn.isOpen).toBe(true);
  }, 300_000);
});

describe('a guest flooding the broker with notices', () => {
  it("logs the first few, then every 1,000th with the count, each cut to 1 KiB: the guest cannot fill the broker's disk", async () => {
    const lines: Array<{ msg: string; fields: Record<string, unknown> }> = [];
    const log = {
      debug: () => undefined,
      info: () => undefined,
      warn: (msg: string, fields: Record<string, unknown> = {}) => void lines.push({ msg, fields }),
      error: () => undefined,
      child: () => log,
    } as unknown as Logger;
    const hostile = await guest({ guarded: true, log });
    const epoch = (hostile.client.connection.peer as { ep: number }).ep;
    const notice = encodeFrame({ t: 'notice', e: { code: 'internal', message: 'x'.repeat(8 * 1024) }, ep: epoch }, 1024 * 1024);
    const N = 3000;
    await new Promise<void>((resolve) => hostile.agentSocket.write(Buffer.concat(Array.from({ length: N }, () => notice)), () => resolve()));
    // Every notice has been read once the ping sent after them is answered.
    await hostile.client.connection.request('ping', {});
    const notices = lines.filter((l) => l.msg === 'protocol.peer_notice');
    expect(notices.length).toBe(20 + Math.floor(N / 1000));
    expect(notices.at(-1)?.fields['notices']).toBe(3000);
    for (const l of notices) expect(String(l.fields['error']).length).toBeLessThan(1100);
    expect(hostile.client.connection.isOpen).toBe(true);
  });
});

describe('LoopShare', () => {
  it('allows the burst, then asks for a pause that earns the debt back at the share', () => {
    let now = 0;
    const s = new LoopShare({ share: 0.2, burstMs: 250, now: () => now });
    expect(s.charge(200)).toBe(0);
    now += 10; // +2 ms earned: 52 left
    expect(s.charge(150)).toBeCloseTo(98 / 0.2, 6);
    // After waiting exactly that long the debt is gone.
    now += 98 / 0.2;
    expect(s.charge(0)).toBe(0);
    expect(s.paused).toBe(1);
  });

  it('a peer that spends whatever it may, and waits only as told, gets at most the burst plus its share of the time plus one charge', () => {
    let now = 0;
    const opts = { share: GUEST_LOOP_SHARE.share, burstMs: GUEST_LOOP_SHARE.burstMs, now: () => now };
    const s = new LoopShare(opts);
    // A deterministic spread of costs: small frames and 200 ms ones, as a flood mixes them.
    let seed = 7;
    for (let i = 0; i < 10_000; i++) {
      seed = (seed * 1103515245 + 12345) % 2 ** 31;
      const ms = seed % 5 === 0 ? 200 : seed % 7;
      now += ms; // the work itself takes the loop's time
      const wait = s.charge(ms);
      now += wait; // reading stopped for as long as asked
      // On this fake clock: what it has been allowed so far, less what it took, is never below zero.
      const slack = opts.burstMs + opts.share * now + s.maxChargeMs - s.chargedMs;
      expect(slack).toBeGreaterThanOrEqual(-1e-6);
    }
    expect(s.paused).toBeGreaterThan(100);
    // Over a long run the share is what it takes.
    expect(s.chargedMs / now).toBeCloseTo(opts.share, 1);
  });

  it('never holds more than the burst, however long the peer was quiet', () => {
    let now = 0;
    const s = new LoopShare({ share: 0.5, burstMs: 100, now: () => now });
    now += 1_000_000;
    expect(s.charge(100)).toBe(0);
    expect(s.charge(1)).toBeCloseTo(2, 6);
  });

  it('refuses a share outside (0, 1] and a negative burst', () => {
    expect(() => new LoopShare({ share: 0, burstMs: 1 })).toThrow(RangeError);
    expect(() => new LoopShare({ share: 1.5, burstMs: 1 })).toThrow(RangeError);
    expect(() => new LoopShare({ share: 0.5, burstMs: -1 })).toThrow(RangeError);
  });
});
