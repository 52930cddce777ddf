import { describe, expect, it, afterEach } from 'vitest';
import { connect, type Socket } from 'node:net';
import { randomBytes } from 'node:crypto';
import { encodeDataFrameHead, encodeFrame, FrameDecoder } from '../guest-agent/src/protocol/frame-codec.ts';
import { PROTOCOL_VERSION } from '../guest-agent/src/protocol/version.ts';
import { startAgent, type AgentProcess } from './helpers/agent-process.ts';


/** A raw peer that speaks frames by hand, to send what a well-behaved client never would. */
class RawPeer {
  private readonly decoder = new FrameDecoder(64 * 1024 * 1024);
  readonly received: unknown[] = [];
  closed = false;
  private waiters: Array<() => void> = [];

  constructor(readonly sock: Socket) {
    sock.on('data', (c: Buffer) => {
      for (const r of this.decoder.push(c)) if (r.ok) this.received.push(r.value);
      this.wake();
    });
    sock.on('close', () => {
      this.closed = true;
      this.wake();
    });
    sock.on('error', () => undefined);
  }

  static async open(path: string): Promise<RawPeer> {
    const s = connect(path);
    await new Promise((r) => s.once('connect', r));
    return new RawPeer(s);
  }

  /** Says hello with a fresh nonce; frames sent after the agent's answer carry its epoch. */
  hello(nonce = Math.floor(Math.random() * 0xffffffff)): number {
    this.epoch = undefined;
    this.nonce = nonce;
    this.frame({ t: 'hello', v: PROTOCOL_VERSION, role: 'broker', maxFrame: 1024 * 1024, window: 256 * 1024, caps: {}, nonce });
    return nonce;
  }

  private nonce: number | undefined;
  epoch: number | undefined;

  frame(v: unknown): void {
    const m = v as Record<string, unknown>;
    if (this.epoch === undefined && this.nonce !== undefined) {
      const answer = this.received.find((x) => (x as Record<string, unknown>)['t'] === 'hello' && (x as Record<string, unknown>)['echo'] === this.nonce) as Record<string, unknown> | undefined;
      if (answer) this.epoch = answer['ep'] as number;
    }
    const stamped = m && typeof m === 'object' && m['t'] !== 'hello' && !('ep' in m) && this.epoch !== undefined ? { ...m, ep: this.epoch } : v;
    this.sock.write(encodeFrame(stamped, 64 * 1024 * 1024));
  }

  async waitFor(pred: (m: Record<string, unknown>) => boolean, timeoutMs = 5000): Promise<Record<string, unknown>> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const m = this.received.find((x) => pred(x as Record<string, unknown>));
      if (m) return m as Record<string, unknown>;
      if (this.closed) throw new Error('peer closed while waiting');
      if (Date.now() > deadline) throw new Error(`timed out; got ${JSON.stringify(this.received.map((r) => (r as { t: string }).t))}`);
      await new Promise<void>((r) => {
        this.waiters.push(r);
        setTimeout(r, 50);
      });
    }
  }

  async waitClosed(timeoutMs = 5000): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    while (!this.closed) {
      if (Date.now() > deadline) throw new Error('connection stayed open');
      await new Promise((r) => setTimeout(r, 20));
    }
  }

  private wake(): void {
    const w = this.waiters;
    this.waiters = [];
    for (const f of w) f();
  }
}

describe('frame codec', () => {
  it('round-trips values split at every byte boundary', () => {
    const values = [{ t: 'req', id: 1, m: 'ping', p: {} }, { a: 'x'.repeat(70_000) }, { d: new Uint8Array([1, 2, 3]) }];
    const wire = Buffer.concat(values.map((v) => encodeFrame(v, 1 << 20)));
    for (const step of [1, 3, 4, 5, 1000, wire.length]) {
      const dec = new FrameDecoder(1 << 20);
      const out: unknown[] = [];
      for (let i = 0; i < wire.length; i += step) for (const r of dec.push(wire.subarray(i, i + step))) out.push(r.ok ? r.value : r.error);
      expect(out.length).toBe(3);
      expect(out[0]).toEqual(values[0]);
      expect((out[1] as { a: string }).a.length).toBe(70_000);
      expect(Array.from((out[2] as { d: Uint8Array }).d)).toEqual([1, 2, 3]);
      expect(dec.hasPartialFrame).toBe(false);
    }
  });

  it('hand-encoded data frames decode like packed ones', () => {
    const payload = randomBytes(1000);
    const frame = Buffer.concat([encodeDataFrameHead(77, payload.length), payload]);
    const [r] = [...new FrameDecoder(1 << 20).push(frame)];
    expect(r?.ok).toBe(true);
    const v = (r as { value: { t: string; s: number; d: Uint8Array } }).value;
    expect(v.t).toBe('data');
    expect(v.s).toBe(77);
    expect(Buffer.from(v.d).equals(payload)).toBe(true);
  });

  it('refuses to encode a frame above the limit', () => {
    expect(() => encodeFrame({ d: 'x'.repeat(5000) }, 4096)).toThrow(/exceeds the limit/);
  });

  it('rejects an oversized length before buffering the body (fatal)', () => {
    const dec = new FrameDecoder(1024);
    const hdr = Buffer.alloc(4);
    hdr.writeUInt32BE(10_000_000);
    const [r] = [...dec.push(hdr)];
    expect(r).toMatchObject({ ok: false, fatal: true });
    expect((r as { error: { code: string } }).error.code).toBe('too_large');
    expect(dec.bufferedBytes).toBe(0);
  });

  it('reports a body that is not one msgpack value without losing framing', () => {
    const dec = new FrameDecoder(1024);
    const bad = Buffer.from([0, 0, 0, 2, 0xc1, 0xc1]); // 0xc1 is never valid msgpack
    const two = Buffer.concat([Buffer.from([0, 0, 0, 2]), Buffer.from([0x01, 0x02])]);
    const good = encodeFrame({ ok: 1 }, 1024);
    const out = [...dec.push(Buffer.concat([bad, two, good]))];
    expect(out.map((r) => r.ok)).toEqual([false, false, true]);
    expect(out.every((r) => r.ok || !r.fatal)).toBe(true);
  });

  it('keeps a truncated frame as partial', () => {
    const dec = new FrameDecoder(1024);
    const f = encodeFrame({ hello: 'world' }, 1024);
    expect([...dec.push(f.subarray(0, f.length - 3))]).toEqual([]);
    expect(dec.hasPartialFrame).toBe(true);
  });
});

describe('bad frames against the real agent process', () => {
  let agent: AgentProcess;
  afterEach(async () => agent?.stop());

  it('answers malformed bodies with notices and keeps serving', async () => {
    agent = await startAgent();
    const peer = await RawPeer.open(agent.socket);
    peer.hello();
    await peer.waitFor((m) => m['t'] === 'hello');
    peer.sock.write(Buffer.from([0, 0, 0, 3, 0xc1, 0xc1, 0xc1]));
    await peer.waitFor((m) => m['t'] === 'notice' && (m['e'] as { code: string }).code === 'bad_request');
    peer.frame({ t: 'bogus', x: 1 });
    peer.frame({ t: 'req', id: 9, m: 'fs.read', p: { path: 42 } });
    const res = await peer.waitFor((m) => m['t'] === 'res' && m['id'] === 9);
    expect((res['e'] as { code: string }).code).toBe('bad_request');
    peer.frame({ t: 'req', id: 10, m: 'no.such.method', p: {} });
    expect(((await peer.waitFor((m) => m['id'] === 10))['e'] as { code: string }).code).toBe('not_found');
    peer.frame({ t: 'req', id: 11, m: 'ping', p: {} });
    const pong = await peer.waitFor((m) => m['t'] === 'res' && m['id'] === 11);
    expect(pong['r']).toHaveProperty('uptimeMs');
    peer.sock.destroy();
  });

  it('closes the connection after an oversized frame, and stays up for the next client', async () => {
    agent = await startAgent();
    const peer = await RawPeer.open(agent.socket);
    peer.hello();
    await peer.waitFor((m) => m['t'] === 'hello');
    const hdr = Buffer.alloc(4);
    hdr.writeUInt32BE(512 * 1024 * 1024);
    peer.sock.write(hdr);
    const notice = await peer.waitFor((m) => m['t'] === 'notice');
    expect((notice['e'] as { code: string }).code).toBe('too_large');
    await peer.waitClosed();
    expect((await agent.client.call('ping', {})).uptimeMs).toBeGreaterThan(0);
  });

  it('requires hello first and rejects a protocol version it does not speak', async () => {
    agent = await startAgent();
    const p1 = await RawPeer.open(agent.socket);
    p1.frame({ t: 'req', id: 1, m: 'ping', p: {} });
    expect(((await p1.waitFor((m) => m['t'] === 'notice'))['e'] as { message: string }).message).toMatch(/expected hello/);
    await p1.waitClosed();
    const p2 = await RawPeer.open(agent.socket);
    p2.frame({ t: 'hello', v: PROTOCOL_VERSION + 1, role: 'broker', maxFrame: 65536, window: 65536, caps: {} });
    expect(((await p2.waitFor((m) => m['t'] === 'notice'))['e'] as { code: string }).code).toBe('unsupported_version');
    await p2.waitClosed();
  });

  it('survives a truncated frame followed by the client vanishing', async () => {
    agent = await startAgent();
    const p = await RawPeer.open(agent.socket);
    p.hello();
    const f = encodeFrame({ t: 'req', id: 1, m: 'ping', p: {} }, 1 << 20);
    p.sock.end(f.subarray(0, 7));
    await p.waitClosed();
    expect((await agent.client.call('ping', {})).now).toBeGreaterThan(0);
  });

  it('10,000 random frames cause no crash', async () => {
    agent = await startAgent();
    const peer = await RawPeer.open(agent.socket);
    peer.hello();
    await peer.waitFor((m) => m['t'] === 'hello');
    const kinds = ['hello', 'req', 'res', 'cancel', 'evt', 'data', 'credit', 'end', 'stop', 'notice', 'zzz'];
    const rnd = (n: number) => Math.floor(Math.random() * n);
    const randomValue = (depth = 0): unknown => {
      switch (rnd(depth > 2 ? 5 : 8)) {
        case 0: return rnd(1 << 30) - (1 << 29);
        case 1: return randomBytes(rnd(16)).toString('base64');
        case 2: return null;
        case 3: return randomBytes(rnd(32));
        case 4: return Math.random() < 0.5;
        case 5: return Array.from({ length: rnd(4) }, () => randomValue(depth + 1));
        default: return Object.fromEntries(Array.from({ length: rnd(4) }, () => [['t', 'id', 's', 'm', 'p', 'd', 'n', 'e'][rnd(8)] as string, randomValue(depth + 1)]));
      }
    };
    const chunks: Buffer[] = [];
    for (let i = 0; i < 10_000; i++) {
      const r = Math.random();
      if (r < 0.3) {
        const body = randomBytes(1 + rnd(64));
        const h = Buffer.alloc(4);
        h.writeUInt32BE(body.length);
        chunks.push(h, body);
      } else {
        const v = { ...(randomValue() as object), t: kinds[rnd(kinds.length)] };
        chunks.push(encodeFrame(v, 1 << 20));
      }
    }
    peer.sock.write(Buffer.concat(chunks));
    // The agent may decide this peer is broken and drop it; it must not crash.
    await new Promise((r) => setTimeout(r, 1500));
    expect(agent.proc.exitCode).toBeNull();
    expect((await agent.client.call('ping', {})).uptimeMs).toBeGreaterThan(0);
    expect(agent.stderr()).not.toMatch(/agent\.fatal|TypeError|RangeError/);
    peer.sock.destroy();
  });
});


describe('device channel mode (virtio-serial semantics)', () => {
  it('waits for the broker to speak first, answers a new hello as a new session, and refuses what belonged to the old one', async () => {
    const { createServer } = await import('node:net');
    const { mkdtempSync, mkdirSync } = await import('node:fs');
    const { join } = await import('node:path');
    const { tmpdir } = await import('node:os');
    const { Agent } = await import('../guest-agent/src/agent-server.ts');
    const { noopLogger } = await import('../guest-agent/src/log.ts');
    const dir = mkdtempSync(join(tmpdir(), 'hutch-chan-'));
    mkdirSync(join(dir, 'w'));
    const agent = new Agent({ root: join(dir, 'w'), exec: { baseEnv: {}, defaultTimeoutMs: 10_000, defaultMaxOutputBytes: 1 << 20 }, log: noopLogger });
    const srv = createServer((s) => agent.serve(s, { channel: true }));
    const path = join(dir, 'chan.sock');
    await new Promise<void>((r) => srv.listen(path, () => r()));
    const peer = await RawPeer.open(path);
    await new Promise((r) => setTimeout(r, 200));
    expect(peer.received).toEqual([]); // silent until spoken to
    // A frame before any hello is refused, not fatal: the channel stays usable.
    peer.frame({ t: 'req', id: 7, m: 'ping', p: {} });
    const refused = await peer.waitFor((m) => m['t'] === 'res' && m['id'] === 7);
    expect((refused['e'] as { code: string }).code).toBe('stale_epoch');
    const n1 = peer.hello();
    const h1 = await peer.waitFor((m) => m['t'] === 'hello' && m['echo'] === n1);
    const ep1 = h1['ep'] as number;
    // A long call in flight, then a new broker says hello on the same channel.
    peer.frame({ t: 'req', id: 1, m: 'exec', p: { command: 'sleep 30', stdout: 1, stderr: 3 }, s: [1, 3] });
    await new Promise((r) => setTimeout(r, 200));
    peer.received.length = 0;
    const n2 = peer.hello();
    const h2 = await peer.waitFor((m) => m['t'] === 'hello' && m['echo'] === n2);
    expect(h2['ep']).not.toBe(ep1);
    // A frame of the old epoch is refused; the new epoch's request is served.
    peer.frame({ t: 'req', id: 2, m: 'ping', p: {}, ep: ep1 });
    expect(((await peer.waitFor((m) => m['t'] === 'res' && m['id'] === 2))['e'] as { code: string }).code).toBe('stale_epoch');
    peer.frame({ t: 'req', id: 1, m: 'ping', p: {} });
    const pong = await peer.waitFor((m) => m['t'] === 'res' && m['id'] === 1);
    expect(pong['r']).toHaveProperty('uptimeMs'); // the answer is the ping's, not the old exec's
    expect(pong['ep']).toBe(h2['ep']);
    await new Promise((r) => setTimeout(r, 300));
    expect(peer.received.filter((m) => (m as { t: string }).t === 'res' && (m as { id: number }).id === 1)).toHaveLength(1);
    peer.sock.destroy();
    srv.close();
  });
});
