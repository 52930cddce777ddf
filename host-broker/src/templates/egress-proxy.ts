/**
 * The template build VM's only way out: hutch's egress proxy (network/proxy-connection.ts)
 * on a Unix socket, which QEMU's restricted user network relays each guest connection to
 * (qemu-driver.ts, egressNicArgs).
 *
 * A template's --run steps are not trusted. They get "the network the build host has",
 * but not the host itself: the `public` egress policy, which refuses loopback, this host's
 * own addresses, link-local and metadata services, multicast and reserved ranges, and the
 * private networks (a build host's LAN is where its fleet's Redis and brokers live) unless
 * the operator opens a range (`--egress-allow CIDR`, say a LAN package mirror).
 *
 * Bounded: at most 64 connections at once (more are answered 503); each connection's
 * bounds are the proxy's (head size and time, idle time).
 */
import { rmSync } from 'node:fs';
import { createServer, type Server, type Socket } from 'node:net';
import { ownAddresses, parseCidr as parseRange } from '../network/addresses.ts';
import { parseRule, type EgressPolicy } from '../network/egress-policy.ts';
import { answerRefusal, serveProxyConnection } from '../network/proxy-connection.ts';

export { parseProxyRequest } from '../network/proxy-connection.ts';

export interface EgressProxyOptions {
  socketPath: string;
  /** Private ranges (CIDR) steps may reach, such as a LAN mirror. */
  allow?: readonly string[];
  log: (line: string) => void;
  maxConnections?: number;
  headTimeoutMs?: number;
  idleTimeoutMs?: number;
}

export interface EgressStats {
  allowed: number;
  refused: number;
  failed: number;
  bytesIn: number;
  bytesOut: number;
}

export interface EgressProxy {
  readonly socketPath: string;
  readonly stats: EgressStats;
  close(): Promise<void>;
}

/** Lines logged per build: a step that opens thousands of connections must not flood the log. */
const MAX_LOG_LINES = 200;

/** An --egress-allow range; `bad_request` naming the option for anything else. */
export function parseCidr(text: string): ReturnType<typeof parseRange> {
  return parseRange(text, '--egress-allow');
}

/** The build steps' policy: the internet, plus the private ranges the operator opened. */
export function buildPolicy(allow: readonly string[]): EgressPolicy {
  for (const c of allow) parseCidr(c);
  return { mode: 'public', allow: allow.map(parseRule), deny: [] };
}

export async function startEgressProxy(o: EgressProxyOptions): Promise<EgressProxy> {
  const maxConnections = o.maxConnections ?? 64;
  const policy = buildPolicy(o.allow ?? []);
  const own = ownAddresses();
  const stats: EgressStats = { allowed: 0, refused: 0, failed: 0, bytesIn: 0, bytesOut: 0 };
  const sockets = new Set<Socket>();
  let logged = 0;
  const note = (line: string) => {
    if (logged < MAX_LOG_LINES) o.log(`egress: ${line}`);
    else if (logged === MAX_LOG_LINES) o.log(`egress: (further connections not logged; see the totals at the end)`);
    logged++;
  };

  const server: Server = createServer((client) => {
    sockets.add(client);
    client.once('close', () => sockets.delete(client));
    client.on('error', () => undefined);
    if (sockets.size > maxConnections) {
      stats.refused++;
      answerRefusal(client, 503, `more than ${maxConnections} connections at once`);
      return;
    }
    void serveProxyConnection(client, {
      policy: () => policy,
      own: () => own,
      ...(o.headTimeoutMs !== undefined ? { headTimeoutMs: o.headTimeoutMs } : {}),
      ...(o.idleTimeoutMs !== undefined ? { idleTimeoutMs: o.idleTimeoutMs } : {}),
      onBytes: (i, out) => {
        stats.bytesIn += i;
        stats.bytesOut += out;
      },
      onEvent: (e) => {
        stats[e.outcome]++;
        note(e.outcome === 'allowed' ? `${e.host}:${e.port} via ${e.address}` : `${e.status ?? ''} ${e.reason ?? ''}`);
      },
    });
  });
  rmSync(o.socketPath, { force: true });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(o.socketPath, () => (server.off('error', reject), resolve()));
  });
  return {
    socketPath: o.socketPath,
    stats,
    async close() {
      for (const s of sockets) s.destroy();
      await new Promise<void>((r) => server.close(() => r()));
      rmSync(o.socketPath, { force: true });
      if (stats.allowed + stats.refused + stats.failed > 0) {
        o.log(`egress: ${stats.allowed} connection(s) allowed, ${stats.refused} refused, ${stats.failed} failed; ${stats.bytesIn} bytes in, ${stats.bytesOut} out`);
      }
    },
  };
}
