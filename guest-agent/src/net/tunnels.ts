/**
 * The guest's network, as the agent serves it: the VM has no NIC, only loopback. Tenant
 * tools reach the outside through the agent's HTTP proxy port on the guest's loopback
 * (GUEST_PROXY_PORT; `http_proxy`/`https_proxy` point there); each connection becomes a
 * `net.open` request to the broker, which decides it under the sandbox's egress policy
 * and connects. The other way, `net.dial` connects a harness to a port a tenant process
 * listens on.
 *
 * The agent decides nothing about where traffic may go (a tenant with root could replace
 * it): it only carries bytes, a bounded number of connections at once.
 */
import { createConnection, createServer, type Server, type Socket } from 'node:net';
import { pipeline } from 'node:stream/promises';
import type { Connection, Handler } from '../protocol/connection.ts';
import { HutchError } from '../protocol/errors.ts';
import { GUEST_PROXY_PORT } from '../protocol/methods-net.ts';
import { streamDuplex } from '../protocol/stream-duplex.ts';
import type { Logger } from '../log.ts';

/** Tunnels at once, each way: past it a tenant connection is answered 503 at once. */
const MAX_TUNNELS = 256;

const refusal = (status: number, why: string) => {
  const body = `hutch: ${why}\n`;
  return `HTTP/1.1 ${status} ${status === 503 ? 'Service Unavailable' : 'Bad Gateway'}\r\nContent-Type: text/plain\r\nContent-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`;
};

export class GuestNetwork {
  private server: Server | undefined;
  private broker: Connection | undefined;
  private open = 0;
  private dialed = 0;

  constructor(private readonly log: Logger) {}

  /** The broker connection tunnels go through (the latest one that completed its handshake). */
  attach(conn: Connection): void {
    this.broker = conn;
    conn.once('close', () => {
      if (this.broker === conn) this.broker = undefined;
    });
  }

  /** Starts the proxy port (before the pristine snapshot, so every restored VM has it listening). */
  async listen(port = GUEST_PROXY_PORT): Promise<void> {
    const server = createServer({ pauseOnConnect: true, allowHalfOpen: true }, (s) => this.onTenantConnection(s));
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject);
      server.listen({ host: '127.0.0.1', port }, () => (server.off('error', reject), resolve()));
    });
    this.server = server;
  }

  close(): void {
    this.server?.close();
  }

  private onTenantConnection(socket: Socket): void {
    socket.on('error', () => undefined);
    const conn = this.broker;
    if (!conn || !conn.isOpen) {
      socket.end(refusal(503, 'the sandbox is not connected to its broker right now'));
      return;
    }
    if (this.open >= MAX_TUNNELS) {
      socket.end(refusal(503, `more than ${MAX_TUNNELS} connections through the proxy at once`));
      return;
    }
    this.open++;
    const down = conn.openInbound();
    const up = conn.openOutbound();
    const tunnel = streamDuplex(down, up);
    // The request releases `up` once it is sent: no byte may precede the request that declares it.
    const call = conn.request('net.open', { up: up.id, down: down.id, via: 'proxy' }, { streams: [up.id, down.id] });
    socket.resume();
    void Promise.allSettled([pipeline(socket, tunnel), pipeline(tunnel, socket), call])
      .then(([, , r]) => {
        if (r.status === 'rejected') this.log.debug('net.open_failed', { error: (r.reason as Error).message });
      })
      .finally(() => {
        this.open--;
        socket.destroy();
        tunnel.destroy();
      });
  }

  /** `net.dial`: connects to a port on the guest's loopback and carries bytes both ways until either side ends. */
  readonly dial: Handler<'net.dial'> = async (p, ctx) => {
    if (this.dialed >= MAX_TUNNELS) throw new HutchError('busy', `more than ${MAX_TUNNELS} connections into the sandbox at once`, { limit: MAX_TUNNELS });
    const socket = await connectLoopback(p.port, ctx.signal);
    this.dialed++;
    const tunnel = streamDuplex(ctx.inbound(p.down), ctx.outbound(p.up));
    let bytesIn = 0;
    let bytesOut = 0;
    socket.on('data', (d: Buffer) => (bytesOut += d.length));
    tunnel.on('data', (d: Buffer) => (bytesIn += d.length));
    const abort = () => socket.destroy();
    ctx.signal.addEventListener('abort', abort, { once: true });
    try {
      await Promise.allSettled([pipeline(socket, tunnel), pipeline(tunnel, socket)]);
    } finally {
      ctx.signal.removeEventListener('abort', abort);
      this.dialed--;
      socket.destroy();
      tunnel.destroy();
    }
    return { bytesIn, bytesOut };
  };
}

/** A connection to 127.0.0.1:port (then ::1), or `connection_refused` naming the port. */
async function connectLoopback(port: number, signal: AbortSignal): Promise<Socket> {
  let last: NodeJS.ErrnoException | undefined;
  let refused = false;
  for (const host of ['127.0.0.1', '::1']) {
    try {
      return await new Promise<Socket>((resolve, reject) => {
        const s = createConnection({ host, port, signal, allowHalfOpen: true });
        s.once('connect', () => (s.removeAllListeners('error'), resolve(s)));
        s.once('error', reject);
      });
    } catch (err) {
      last = err as NodeJS.ErrnoException;
      refused ||= last.code === 'ECONNREFUSED';
    }
  }
  // A guest without IPv6 answers ::1 with another error: a refusal on either address is the answer.
  if (refused) throw new HutchError('connection_refused', `nothing listens on port ${port} in the sandbox`, { port });
  throw new HutchError('unavailable', `cannot connect to port ${port} in the sandbox: ${last?.code ?? last?.message}`, { port });
}
