/**
 * The template build VM's only way out: an HTTP proxy (CONNECT for HTTPS, absolute-URI
 * requests for plain HTTP) on a Unix socket, which QEMU's restricted user network relays
 * each guest connection to (qemu-driver.ts, egressNicArgs).
 *
 * A template's --run steps are not trusted. They get "the network the build host has",
 * but not the host itself: QEMU's unrestricted user network maps 10.0.2.2 to the host's
 * loopback, where the broker's API and the catalog's Redis listen, and a cloud host's
 * metadata service (169.254.169.254) hands out its credentials. So every destination is
 * resolved here, and a name with any address on loopback, link-local, multicast, the
 * unspecified network or one of this host's own interfaces is refused; the connection
 * then goes to the address that was checked, never to a second lookup of the name.
 * Private networks (RFC 1918, CGNAT, IPv6 ULA) are refused too unless the operator allows
 * a range (`--egress-allow CIDR`, say a LAN package mirror): a build host's LAN is where
 * its fleet's Redis and brokers live.
 *
 * Bounded: a request head of at most 32 KiB read within 30 s, at most 64 connections at
 * once, idle connections dropped after 5 minutes; one request per plain-HTTP connection
 * (Connection: close), which every client handles by reconnecting.
 */
import { lookup } from 'node:dns/promises';
import { isIP, createConnection, createServer, type Server, type Socket } from 'node:net';
import { networkInterfaces } from 'node:os';
import { rmSync } from 'node:fs';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';

export interface EgressProxyOptions {
  socketPath: string;
  /** Private ranges (CIDR) steps may reach, such as a LAN mirror; see parseCidr. */
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

const MAX_HEAD = 32 * 1024;
/** Lines logged per build: a step that opens thousands of connections must not flood the log. */
const MAX_LOG_LINES = 200;

/** fd00:ec2::254, EC2's metadata service over IPv6 (outside link-local, so named here). */
const METADATA_V6 = 'fd000ec2000000000000000000000254';

/** An address range: `bits` leading bits of `prefix` (32 for IPv4, 128 for IPv6). */
export interface Cidr {
  readonly family: 4 | 6;
  readonly prefix: bigint;
  readonly bits: number;
  readonly text: string;
}

/** The address as an integer of its family's width, or undefined if it is not one. */
function addressBits(address: string): { family: 4 | 6; value: bigint } | undefined {
  const family = isIP(address);
  if (family === 4) return { family, value: address.split('.').reduce((v, o) => (v << 8n) | BigInt(Number(o)), 0n) };
  if (family === 6) {
    const hex = expandV6(address.toLowerCase());
    return hex === undefined ? undefined : { family, value: BigInt(`0x${hex}`) };
  }
  return undefined;
}

/** "10.1.0.0/16", "fd12::/16", or a bare address (a /32 or /128). Throws on anything else. */
export function parseCidr(text: string): Cidr {
  const [addr = '', len, extra] = text.split('/');
  const a = addressBits(addr);
  const width = a?.family === 4 ? 32 : 128;
  const bits = len === undefined ? width : /^\d{1,3}$/.test(len) ? Number(len) : NaN;
  if (!a || extra !== undefined || !(bits >= 0 && bits <= width)) {
    throw new HutchError('bad_request', `--egress-allow ${JSON.stringify(text)}: expected an address range such as 10.1.0.0/16 or fd12::/16`);
  }
  const mask = ((1n << BigInt(bits)) - 1n) << BigInt(width - bits);
  return { family: a.family, prefix: a.value & mask, bits, text };
}

function inCidr(address: string, c: Cidr): boolean {
  const a = addressBits(address);
  if (!a || a.family !== c.family) return false;
  const width = c.family === 4 ? 32 : 128;
  return a.value >> BigInt(width - c.bits) === c.prefix >> BigInt(width - c.bits);
}

const PRIVATE: readonly Cidr[] = ['10.0.0.0/8', '172.16.0.0/12', '192.168.0.0/16', '100.64.0.0/10', 'fc00::/7'].map(parseCidr);

/** Why a destination address is refused, or undefined when it may be reached. */
export function refusalFor(address: string, own: ReadonlySet<string> = ownAddresses(), allow: readonly Cidr[] = []): string | undefined {
  const hard = hardRefusal(address, own);
  if (hard) return hard;
  const bare = unmapped(address);
  if (PRIVATE.some((c) => inCidr(bare, c)) && !allow.some((c) => inCidr(bare, c))) return 'on a private network (allow a range with --egress-allow CIDR)';
  return undefined;
}

/** An IPv4-mapped IPv6 address (::ffff:10.0.0.1 or ::ffff:a00:1) as the IPv4 it maps; others as given. */
function unmapped(address: string): string {
  if (isIP(address) !== 6) return address;
  const dotted = /^::ffff:(\d+\.\d+\.\d+\.\d+)$/i.exec(address);
  if (dotted) return dotted[1]!;
  const hex = expandV6(address.toLowerCase());
  if (hex === undefined || !/^0{20}ffff/.test(hex)) return address;
  return hex.slice(24).match(/../g)!.map((h) => parseInt(h, 16)).join('.');
}

/** What no --egress-allow opens: this host, link-local and metadata, multicast, reserved. */
function hardRefusal(address: string, own: ReadonlySet<string>): string | undefined {
  const family = isIP(address);
  if (family === 0) return 'not an IP address';
  let a = address.toLowerCase();
  if (family === 6) {
    // An IPv4-mapped address (::ffff:127.0.0.1, ::ffff:7f00:1) is the IPv4 address it maps.
    const v4 = unmapped(a);
    if (v4 !== a) return hardRefusal(v4, own);
    const v6 = expandV6(a);
    if (v6 === undefined) return 'not an IP address';
    if (/^0{28}0{3}[01]$/.test(v6)) return v6.endsWith('1') ? 'loopback' : 'unspecified address';
    if (/^fe[89ab]/.test(v6)) return 'link-local';
    if (v6 === METADATA_V6) return 'a cloud metadata service (EC2 over IPv6)';
    if (v6.startsWith('ff')) return 'multicast';
    a = v6;
  } else {
    const o = a.split('.').map(Number);
    const [x, y] = [o[0]!, o[1]!];
    if (x === 0) return 'unspecified address';
    if (x === 127) return 'loopback';
    if (x === 169 && y === 254) return 'link-local (cloud metadata lives here)';
    if (a === '100.100.100.200') return 'a cloud metadata service (Alibaba Cloud)';
    if (x >= 224) return x < 240 ? 'multicast' : 'reserved or broadcast';
  }
  if (own.has(a)) return "one of this host's own addresses";
  return undefined;
}

/** This host's interface addresses, normalised as refusalFor compares them. */
export function ownAddresses(): Set<string> {
  const out = new Set<string>();
  for (const list of Object.values(networkInterfaces())) {
    for (const i of list ?? []) {
      const addr = i.address.toLowerCase().split('%')[0]!;
      out.add(i.family === 'IPv6' ? (expandV6(addr) ?? addr) : addr);
    }
  }
  return out;
}

/** 32 hex digits, or undefined for a malformed address. */
function expandV6(a: string): string | undefined {
  const [head, tail, extra] = a.split('::');
  if (extra !== undefined) return undefined;
  const parts = (s: string | undefined) => (s ? s.split(':') : []);
  const h = parts(head);
  const t = parts(tail);
  const missing = 8 - h.length - t.length;
  if (tail === undefined ? missing !== 0 : missing < 1) return undefined;
  const groups = [...h, ...Array<string>(tail === undefined ? 0 : missing).fill('0'), ...t];
  if (groups.some((g) => !/^[0-9a-f]{1,4}$/.test(g))) return undefined;
  return groups.map((g) => g.padStart(4, '0')).join('');
}

interface Target {
  host: string;
  port: number;
  /** For plain HTTP: the head to send upstream (origin-form request line, Connection: close). */
  head?: Buffer;
}

class ProxyRefusal extends Error {
  constructor(readonly status: number, message: string) {
    super(message);
  }
}

/** Parses a proxy request head (up to and including the blank line). */
export function parseProxyRequest(head: string): Target {
  const lines = head.split('\r\n');
  const m = /^([A-Z]+) (\S+) HTTP\/1\.[01]$/.exec(lines[0] ?? '');
  if (!m) throw new ProxyRefusal(400, 'not an HTTP/1.x proxy request');
  const [, method, target] = m as unknown as [string, string, string];
  if (method === 'CONNECT') {
    const hp = /^(?:\[([0-9a-fA-F:.]+)\]|([A-Za-z0-9.-]+)):(\d{1,5})$/.exec(target);
    if (!hp) throw new ProxyRefusal(400, `CONNECT target ${JSON.stringify(target.slice(0, 200))} is not host:port`);
    return { host: hp[1] ?? hp[2]!, port: checkPort(Number(hp[3])) };
  }
  let url: URL;
  try {
    url = new URL(target);
  } catch {
    throw new ProxyRefusal(400, `request target ${JSON.stringify(target.slice(0, 200))} is not an absolute http:// URL (this is a proxy)`);
  }
  if (url.protocol !== 'http:') throw new ProxyRefusal(400, `${url.protocol} is not proxied as a plain request (use CONNECT for https)`);
  if (url.username || url.password) throw new ProxyRefusal(400, 'credentials in the URL are not forwarded');
  const host = url.hostname.replace(/^\[|\]$/g, '');
  const port = checkPort(url.port ? Number(url.port) : 80);
  // Hop-by-hop and proxy headers stay here; the upstream gets one request and closes.
  const kept = lines.slice(1).filter((l) => l !== '' && !/^(proxy-connection|proxy-authorization|connection|keep-alive)\s*:/i.test(l));
  const upstream = [`${method} ${url.pathname}${url.search} HTTP/1.1`, ...kept, 'Connection: close', '', ''].join('\r\n');
  return { host, port, head: Buffer.from(upstream, 'latin1') };
}

function checkPort(p: number): number {
  if (!Number.isInteger(p) || p < 1 || p > 65535) throw new ProxyRefusal(400, `port ${p} is out of range`);
  return p;
}

export async function startEgressProxy(o: EgressProxyOptions): Promise<EgressProxy> {
  const maxConnections = o.maxConnections ?? 64;
  const headTimeoutMs = o.headTimeoutMs ?? 30_000;
  const idleTimeoutMs = o.idleTimeoutMs ?? 5 * 60_000;
  const allow = (o.allow ?? []).map(parseCidr);
  const stats: EgressStats = { allowed: 0, refused: 0, failed: 0, bytesIn: 0, bytesOut: 0 };
  const sockets = new Set<Socket>();
  let logged = 0;
  const note = (line: string) => {
    if (logged < MAX_LOG_LINES) o.log(`egress: ${line}`);
    else if (logged === MAX_LOG_LINES) o.log(`egress: (further connections not logged; see the totals at the end)`);
    logged++;
  };

  const answer = (client: Socket, status: number, why: string) => {
    const reason = { 400: 'Bad Request', 403: 'Forbidden', 502: 'Bad Gateway', 503: 'Service Unavailable', 504: 'Gateway Timeout' }[status] ?? 'Error';
    const body = `hutch egress proxy: ${why}\n`;
    client.end(`HTTP/1.1 ${status} ${reason}\r\nContent-Type: text/plain\r\nContent-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`);
  };

  async function route(client: Socket, head: string, rest: Buffer): Promise<void> {
    const target = parseProxyRequest(head);
    const literal = isIP(target.host) !== 0;
    let addresses: string[];
    try {
      addresses = literal ? [target.host] : (await lookup(target.host, { all: true, verbatim: true })).map((r) => r.address);
    } catch (err) {
      throw new ProxyRefusal(502, `cannot resolve ${target.host}: ${(err as NodeJS.ErrnoException).code ?? (err as Error).message}`);
    }
    const own = ownAddresses();
    for (const addr of addresses) {
      const why = refusalFor(addr, own, allow);
      if (why) throw new ProxyRefusal(403, `${target.host}:${target.port} is refused: ${addr} is ${why}`);
    }
    const address = addresses[0];
    if (address === undefined) throw new ProxyRefusal(502, `${target.host} has no address`);
    const upstream = createConnection({ host: address, port: target.port });
    sockets.add(upstream);
    upstream.once('close', () => sockets.delete(upstream));
    await new Promise<void>((resolve, reject) => {
      const timer = setTimeout(() => reject(new ProxyRefusal(504, `connecting to ${target.host}:${target.port} timed out`)), 30_000);
      upstream.once('connect', () => (clearTimeout(timer), resolve()));
      upstream.once('error', (err) => (clearTimeout(timer), reject(new ProxyRefusal(502, `cannot connect to ${target.host}:${target.port} (${address}): ${(err as NodeJS.ErrnoException).code ?? err.message}`))));
    }).catch((err: unknown) => {
      upstream.destroy();
      throw err;
    });
    // A hang-up while the client is paused only shows once it resumes (and then closes the
    // upstream below); a client destroyed by an error meanwhile would leave this upstream open.
    if (client.destroyed) {
      upstream.destroy();
      return;
    }
    stats.allowed++;
    note(`${target.head ? 'GET-style' : 'CONNECT'} ${target.host}:${target.port} via ${address}`);
    if (target.head) {
      upstream.write(target.head);
      stats.bytesOut += target.head.length;
    }
    else client.write('HTTP/1.1 200 Connection Established\r\n\r\n');
    if (rest.length > 0) upstream.write(rest);
    for (const s of [client, upstream]) {
      s.setTimeout(idleTimeoutMs, () => s.destroy());
      s.on('error', () => undefined);
    }
    client.on('data', (d: Buffer) => (stats.bytesOut += d.length));
    upstream.on('data', (d: Buffer) => (stats.bytesIn += d.length));
    client.pipe(upstream);
    upstream.pipe(client);
    client.once('close', () => upstream.destroy());
    upstream.once('close', () => client.destroy());
  }

  const server: Server = createServer((client) => {
    sockets.add(client);
    client.once('close', () => sockets.delete(client));
    client.on('error', () => undefined);
    if (sockets.size > maxConnections) {
      stats.refused++;
      answer(client, 503, `more than ${maxConnections} connections at once`);
      return;
    }
    let buf = Buffer.alloc(0);
    client.setTimeout(headTimeoutMs, () => {
      stats.refused++;
      answer(client, 400, `no complete request head within ${headTimeoutMs / 1000} s`);
    });
    const onData = (d: Buffer) => {
      buf = Buffer.concat([buf, d]);
      const end = buf.indexOf('\r\n\r\n');
      if (end < 0) {
        if (buf.length > MAX_HEAD) {
          client.off('data', onData);
          stats.refused++;
          answer(client, 400, `request head over ${MAX_HEAD} bytes`);
        }
        return;
      }
      client.off('data', onData);
      client.pause();
      client.setTimeout(0);
      const head = buf.subarray(0, end + 4).toString('latin1');
      const rest = buf.subarray(end + 4);
      route(client, head, rest)
        .then(() => client.resume())
        .catch((err: unknown) => {
          const status = err instanceof ProxyRefusal ? err.status : 502;
          if (status === 403 || status === 400) stats.refused++;
          else stats.failed++;
          note(`${status} ${(err as Error).message}`);
          answer(client, status, (err as Error).message);
        });
    };
    client.on('data', onData);
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
