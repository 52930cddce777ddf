import { afterEach, describe, expect, it } from 'vitest';
import { Duplex } from 'node:stream';
import { mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Agent } from '../guest-agent/src/agent-server.ts';
import { noopLogger } from '../guest-agent/src/log.ts';
import { HutchError } from '../guest-agent/src/protocol/errors.ts';
import { AgentClient } from '../host-broker/src/agent-client.ts';
import { startAgent, type AgentProcess } from './helpers/agent-process.ts';

/**
 * A virtio-serial port as the guest and the host see it (drivers/char/virtio_console.c and
 * QEMU's chardev): one host attachment and one guest open at a time; bytes the host writes
 * while no guest has the port open wait in the host's socket until one opens it (QEMU stops
 * reading the chardev); a guest open that is replaced sees end-of-file. What a test does to
 * this port is what a snapshot restore does to a real one: the old host goes away without a
 * word, a new host attaches, and the guest notices late.
 */
class PortSim {
  private guest: Duplex | undefined;
  private host: Duplex | undefined;
  private pending: Buffer[] = [];

  /** A new host attachment (the broker's connect to the chardev socket); the old host is cut off. */
  attachHost(): Duplex {
    const port = this;
    const host: Duplex = new Duplex({
      read() {},
      write(chunk: Buffer, _enc, cb) {
        if (port.host === host) port.toGuest(chunk);
        cb();
      },
      final(cb) {
        cb();
      },
    });
    this.host = host;
    return host;
  }

  /** The guest (re)opens the port; a previous open gets end-of-file. */
  openGuest(): Duplex {
    const old = this.guest;
    const port = this;
    const guest: Duplex = new Duplex({
      read() {},
      write(chunk: Buffer, _enc, cb) {
        if (port.guest === guest) port.host?.push(chunk);
        cb();
      },
      final(cb) {
        cb();
      },
    });
    this.guest = guest;
    old?.push(null);
    const queued = this.pending;
    this.pending = [];
    for (const c of queued) guest.push(c);
    return guest;
  }

  /** The guest closes the port without reopening it yet: host bytes wait. */
  closeGuest(): void {
    const old = this.guest;
    this.guest = undefined;
    old?.push(null);
  }

  private toGuest(chunk: Buffer): void {
    if (this.guest) this.guest.push(chunk);
    else this.pending.push(Buffer.from(chunk));
  }
}

function makeAgent(): { agent: Agent; dir: string } {
  const dir = mkdtempSync(join(tmpdir(), 'hutch-handshake-'));
  mkdirSync(join(dir, 'w'));
  return { agent: new Agent({ root: join(dir, 'w'), exec: { baseEnv: { PATH: '/usr/bin:/bin' }, defaultTimeoutMs: 30_000, defaultMaxOutputBytes: 1 << 20 }, log: noopLogger }), dir };
}

async function codeOf(p: Promise<unknown>): Promise<string> {
  try {
    await p;
    return 'resolved';
  } catch (err) {
    return err instanceof HutchError ? err.code : `untyped: ${(err as Error).message}`;
  }
}

describe('the epoch handshake on a device channel', () => {
  const dirs: string[] = [];
  afterEach(() => {
    for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
  });

  it("a restore's lost call: the old guest session answers the new broker's hello, then the port is reopened; the next call is still answered", async () => {
    const { agent, dir } = makeAgent();
    dirs.push(dir);
    const port = new PortSim();
    agent.serve(port.openGuest(), { channel: true });
    // The broker that was attached when the snapshot was taken.
    const before = new AgentClient(port.attachHost(), { resendHelloMs: 50 });
    await before.ready();
    // Restore: a new broker attaches; the guest's old session reads its hello before it
    // sees the old host gone, and answers it.
    const broker = new AgentClient(port.attachHost(), { resendHelloMs: 50, handshakeTimeoutMs: 5000 });
    await broker.ready();
    // Now the guest notices: its open ends, it reopens the port and serves whatever comes.
    port.closeGuest();
    const call = broker.call('ping', {});
    await new Promise((r) => setTimeout(r, 50));
    agent.serve(port.openGuest(), { channel: true });
    // Before epochs, the new session got a request before any hello, closed the port, and
    // this call was never answered.
    const r = await call;
    expect(r.uptimeMs).toBeGreaterThanOrEqual(0);
    expect(broker.connection.stats().epoch).not.toBe(before.connection.stats().epoch);
    // And the channel keeps working.
    expect((await broker.call('ping', {})).now).toBeGreaterThan(0);
    broker.close();
  }, 20_000);

  it('a call that reached the old session fails as interrupted (it may have run) and is not sent twice; one that never started is sent again', async () => {
    const { agent, dir } = makeAgent();
    dirs.push(dir);
    const port = new PortSim();
    agent.serve(port.openGuest(), { channel: true });
    const broker = new AgentClient(port.attachHost(), { resendHelloMs: 50, handshakeTimeoutMs: 5000 });
    await broker.ready();
    const marker = join(dir, 'w', 'ran');
    const started = broker.exec({ command: `echo x >> ${marker}; sleep 20`, timeoutMs: 30_000 }).result;
    await new Promise((r) => setTimeout(r, 300));
    port.closeGuest(); // the session that runs it is gone
    const later = broker.call('ping', {}); // waits in the port: reaches the next session
    await new Promise((r) => setTimeout(r, 50));
    agent.serve(port.openGuest(), { channel: true });
    expect(await codeOf(started)).toBe('interrupted');
    expect((await later).uptimeMs).toBeGreaterThanOrEqual(0);
    broker.close();
  }, 20_000);

  it('a guest that goes silent fails every waiting call with guest_unresponsive instead of hanging', async () => {
    const port = new PortSim();
    const { agent, dir } = makeAgent();
    dirs.push(dir);
    agent.serve(port.openGuest(), { channel: true });
    const broker = new AgentClient(port.attachHost(), { resendHelloMs: 50, handshakeTimeoutMs: 5000, deadlines: { scale: 1 }, heartbeatMs: 100, deadAfterMs: 600 });
    await broker.ready();
    port.closeGuest(); // nothing answers from now on, not even pings
    const codes = await Promise.all([codeOf(broker.call('ping', {})), codeOf(broker.exec({ command: 'true' }).result)]);
    expect(codes).toEqual(['guest_unresponsive', 'guest_unresponsive']);
  }, 20_000);
});

describe('deadlines on guest RPCs against a real agent process', () => {
  let agent: AgentProcess | undefined;
  afterEach(async () => {
    if (agent?.proc.signalCode === null && agent.proc.exitCode === null) agent.proc.kill('SIGCONT');
    await agent?.stop();
    agent = undefined;
  });

  it('a frozen agent (SIGSTOP) fails the call with guest_unresponsive naming the RPC', async () => {
    agent = await startAgent({ client: { deadlines: { scale: 0.05 }, heartbeatMs: 5_000 } });
    expect((await agent.client.call('ping', {})).uptimeMs).toBeGreaterThanOrEqual(0);
    agent.proc.kill('SIGSTOP');
    const err = await agent.client.call('agent.state', {}).then(
      () => undefined,
      (e: unknown) => e as HutchError,
    );
    expect(err?.code).toBe('guest_unresponsive');
    expect(err?.context?.['method']).toBe('agent.state');
    expect(err?.message).toMatch(/agent\.state/);
    agent.proc.kill('SIGCONT');
  }, 20_000);

  it('an exec past its own timeout plus the grace fails as guest_unresponsive; within it, the agent answers timedOut', async () => {
    agent = await startAgent({ client: { deadlines: { scale: 0.1 }, heartbeatMs: 60_000 } });
    const ok = await agent.client.run({ command: 'sleep 5', timeoutMs: 300 });
    expect(ok.timedOut).toBe(true);
    agent.proc.kill('SIGSTOP');
    const err = await agent.client.run({ command: 'true', timeoutMs: 300 }).then(
      () => undefined,
      (e: unknown) => e as HutchError,
    );
    expect(err?.code).toBe('guest_unresponsive');
    expect(err?.context?.['method']).toBe('exec');
    agent.proc.kill('SIGCONT');
  }, 20_000);
});
