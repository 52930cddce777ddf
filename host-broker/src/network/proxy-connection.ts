/**
 * One proxied connection: an HTTP/1.x proxy request (CONNECT host:port, or an absolute-URI
 * request for plain HTTP) read from any byte duplex (a sandbox's tunnel over its agent
 * channel, or a build VM's connection on a Unix socket), decided by an egress policy, and
 * piped to the destination. HTTPS goes through as a CONNECT tunnel, never decrypted.
 *
 * Bounded: the request head is at most 32 KiB and must arrive within 30 s; an idle
 * connection is dropped after 5 minutes; bytes both ways pass a rate limiter the caller
 * shares between a sandbox's connections. One request per plain-HTTP connection
 * (Connection: close), which every client handles by reconnecting. A refusal is an HTTP
 * answer the client reports (403 with a body naming the rule, for CONNECT too).
 */
import { lookup as dnsLookup } from 'node:dns/promises';
import { createConnection, isIP, type Socket } from 'node:net';
import type { Duplex } from 'node:stream';
import { decide, decideByName, type EgressPolicy } from './egress-policy.ts';
import type { RangeSet } from './addresses.ts';
import type { RateLimiter } from './rate-limiter.ts';

const MAX_HEAD = 32 * 1024;

export interface ProxyTarget {
  host: string;
  port: number;
  /** For plain HTTP: the head to send upstream (origin-form request line, Connection: close). */
  head?: Buffer;
}

export class ProxyRefusal extends Error {
  constructor(
    readonly status: number,
    message: string,
    readonly rule?: string,
  ) {
    super(message);
  }
}

function checkPort(p: number): number {
  if (!Number.isInteger(p) || p < 1 || p > 65535) throw new ProxyRefusal(400, `port ${p} is out of range`);
  return p;
}

/** Parses a proxy request head (up to and including the blank line). */
export function parseProxyRequest(head: string): ProxyTarget {
  const lines = head.split('\r\n');
  const m = /^([A-Z]+) (\S+) HTTP\/1\.[01]$/.exec(lines[0] ?? '');
  if (!m) throw new ProxyRefusal(400, 'not an HTTP/1.x proxy request');
  const [, method, target] = m as unknown as [string, string, string];
  if (method === 'CONNECT') {
    const hp = /^(?:\[([0-9a-fA-F:.]+)\]|([A-Za-z0-9._-]+)):(\d{1,5})$/.exec(target);
    if (!hp) throw new ProxyRefusal(400, `CONNECT target ${JSON.stringify(target.slice(0, 200))} is not host:port`);
    return { host: hp[1] ?? hp[2]!, port: checkPort(Number(hp[3])) };
  }
  let url: URL;
  try {
    url = new URL(target);
  } catch {
    throw new ProxyRefusal(400, `request target ${JSON.stringify(target.slice(0, 200))} is not an absolute http:// URL (this is a proxy: set http_proxy, or use CONNECT)`);
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

export interface ProxyEvent {
  outcome: 'allowed' | 'refused' | 'failed';
  host: string;
  port: number;
  /** The address connected to (allowed) or the reason (refused, failed). */
  address?: string;
  reason?: string;
  rule?: string;
  status?: number;
}

export interface ProxyConnectionOptions {
  /** Read at each connection, so a policy change applies to the next one. */
  policy: () => EgressPolicy;
  own: () => RangeSet;
  /** Shared by one sandbox's connections; undefined: unlimited. */
  rate?: RateLimiter;
  onEvent?: (e: ProxyEvent) => void;
  /** Counted as they pass: bytes from the destination (in) and to it (out). */
  onBytes?: (inBytes: number, outBytes: number) => void;
  headTimeoutMs?: number;
  idleTimeoutMs?: number;
  connectTimeoutMs?: number;
  /** Name resolution (the host's resolver); tests inject one that rebinds. */
  lookup?: (host: string) => Promise<string[]>;
  /** How the destination is reached; tests inject one. */
  connect?: (address: string, port: number) => Socket;
}

const STATUS_TEXT: Record<number, string> = { 400: 'Bad Request', 403: 'Forbidden', 429: 'Too Many Requests', 502: 'Bad Gateway', 503: 'Service Unavailable', 504: 'Gateway Timeout' };

/** An HTTP answer the client shows its user, then the end of the connection. */
export function answerRefusal(client: Duplex, status: number, why: string): void {
  const body = `hutch egress proxy: ${why}\n`;
  client.end(`HTTP/1.1 ${status} ${STATUS_TEXT[status] ?? 'Error'}\r\nContent-Type: text/plain\r\nContent-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\nX-Hutch-Egress: refused\r\n\r\n${body}`);
}

async function defaultLookup(host: string): Promise<string[]> {
  return (await dnsLookup(host, { all: true, verbatim: true })).map((r) => r.address);
}

/** Reads the request head, bounded in size and time; undefined if the client went away first. */
function readHead(client: Duplex, timeoutMs: number): Promise<{ head: string; rest: Buffer }> {
  return new Promise((resolve, reject) => {
    let buf: Buffer = Buffer.alloc(0);
    const timer = setTimeout(() => done(new ProxyRefusal(400, `no complete request head within ${timeoutMs / 1000} s`)), timeoutMs);
    const onData = (d: Buffer) => {
      buf = buf.length === 0 ? d : Buffer.concat([buf, d]);
      const end = buf.indexOf('\r\n\r\n');
      if (end + 4 > MAX_HEAD || (end < 0 && buf.length > MAX_HEAD)) done(new ProxyRefusal(400, `request head over ${MAX_HEAD} bytes`));
      else if (end >= 0) done(undefined, { head: buf.subarray(0, end + 4).toString('latin1'), rest: buf.subarray(end + 4) });
    };
    const onEnd = () => done(new ProxyRefusal(400, 'the client closed before its request head was complete'));
    const done = (err?: Error, r?: { head: string; rest: Buffer }) => {
      clearTimeout(timer);
      client.off('data', onData);
      client.off('end', onEnd);
      client.off('error', onEnd);
      client.pause();
      if (err) reject(err);
      else resolve(r!);
    };
    client.on('data', onData);
    client.once('end', onEnd);
    client.once('error', onEnd);
  });
}

/**
 * Serves one proxy connection to its end. Resolves with what happened (never rejects):
 * the caller counts it and keeps its connection slot until then.
 */
export async function serveProxyConnection(client: Duplex, o: ProxyConnectionOptions): Promise<ProxyEvent> {
  client.on('error', () => undefined);
  let target: ProxyTarget | undefined;
  const event = (e: ProxyEvent): ProxyEvent => {
    o.onEvent?.(e);
    return e;
  };
  try {
    const { head, rest } = await readHead(client, o.headTimeoutMs ?? 30_000);
    target = parseProxyRequest(head);
    const policy = o.policy();
    const early = decideByName(policy, target.host, target.port);
    if (early && !early.allowed) throw new ProxyRefusal(403, early.reason, early.rule);
    const literal = isIP(target.host) !== 0;
    let addresses: string[];
    try {
      addresses = literal ? [target.host] : await (o.lookup ?? defaultLookup)(target.host);
    } catch (err) {
      throw new ProxyRefusal(502, `cannot resolve ${target.host}: ${(err as NodeJS.ErrnoException).code ?? (err as Error).message}`);
    }
    const d = decide(policy, { host: target.host, port: target.port, addresses }, o.own());
    if (!d.allowed) throw new ProxyRefusal(403, d.reason, d.rule);
    const upstream = await dial(d.address, target, o);
    if (client.destroyed) {
      upstream.destroy();
      return event({ outcome: 'failed', host: target.host, port: target.port, reason: 'the client went away while connecting' });
    }
    if (target.head) {
      upstream.write(target.head);
      o.onBytes?.(0, target.head.length);
    } else client.write('HTTP/1.1 200 Connection Established\r\n\r\n');
    if (rest.length > 0) {
      upstream.write(rest);
      o.onBytes?.(0, rest.length);
    }
    const allowed = event({ outcome: 'allowed', host: target.host, port: target.port, address: d.address, ...(d.rule ? { rule: d.rule } : {}) });
    await splice(client, upstream, o);
    return allowed;
  } catch (err) {
    const status = err instanceof ProxyRefusal ? err.status : 502;
    const reason = (err as Error).message;
    if (!client.destroyed) answerRefusal(client, status, reason);
    return event({
      outcome: status === 403 || status === 400 ? 'refused' : 'failed',
      host: target?.host ?? '',
      port: target?.port ?? 0,
      reason,
      status,
      ...(err instanceof ProxyRefusal && err.rule ? { rule: err.rule } : {}),
    });
  }
}

function dial(address: string, target: ProxyTarget, o: ProxyConnectionOptions): Promise<Socket> {
  const upstream = (o.connect ?? ((a, p) => createConnection({ host: a, port: p })))(address, target.port);
  const timeoutMs = o.connectTimeoutMs ?? 30_000;
  return new Promise<Socket>((resolve, reject) => {
    const timer = setTimeout(() => fail(new ProxyRefusal(504, `connecting to ${target.host}:${target.port} timed out after ${timeoutMs / 1000} s`)), timeoutMs);
    const fail = (e: Error) => {
      clearTimeout(timer);
      upstream.destroy();
      reject(e);
    };
    upstream.once('connect', () => {
      clearTimeout(timer);
      upstream.removeAllListeners('error');
      resolve(upstream);
    });
    upstream.once('error', (err: NodeJS.ErrnoException) => fail(new ProxyRefusal(502, `cannot connect to ${target.host}:${target.port} (${address}): ${err.code ?? err.message}`)));
  });
}

/** Pipes both ways through the rate limiter until either side closes; resolves then. */
function splice(client: Duplex, upstream: Socket, o: ProxyConnectionOptions): Promise<void> {
  const idleMs = o.idleTimeoutMs ?? 5 * 60_000;
  return new Promise<void>((resolve) => {
    let idle = setTimeout(() => close(), idleMs);
    const touch = () => {
      clearTimeout(idle);
      idle = setTimeout(() => close(), idleMs);
    };
    let closed = false;
    const close = () => {
      if (closed) return;
      closed = true;
      clearTimeout(idle);
      client.destroy();
      upstream.destroy();
      resolve();
    };
    upstream.on('error', () => close());
    client.on('error', () => close());
    const pump = (from: Duplex, to: Duplex, count: (n: number) => void) => {
      from.on('data', (chunk: Buffer) => {
        touch();
        count(chunk.length);
        const wait = o.rate?.take(chunk.length) ?? 0;
        const room = to.write(chunk);
        // Pause for the writer's room and for the rate limiter's debt, whichever is longer.
        if (!room || wait > 0) {
          from.pause();
          let pending = 2;
          const go = () => {
            if (--pending === 0 && !closed) from.resume();
          };
          if (room) go();
          else to.once('drain', go);
          if (wait > 0) setTimeout(go, wait).unref();
          else go();
        }
      });
      // Half-close passes through (a client that ends its request still reads the answer).
      from.once('end', () => to.end());
    };
    pump(client, upstream, (n) => o.onBytes?.(0, n));
    pump(upstream, client, (n) => o.onBytes?.(n, 0));
    let ends = 0;
    const ended = () => {
      if (++ends === 2) close();
    };
    client.once('close', close);
    upstream.once('close', close);
    client.once('end', ended);
    upstream.once('end', ended);
    client.resume();
  });
}
