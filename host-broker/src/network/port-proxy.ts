/**
 * Ports in: a harness reaches a TCP port a process in a sandbox listens on (a dev server,
 * a notebook, a WebSocket service), through the broker's own port and with the harness's
 * token. Two URL forms reach the same thing:
 *
 *   http://BROKER/sandboxes/<session>/ports/<port>/<path>   (the path form; the prefix is
 *                                                            removed before forwarding)
 *   http://<port>-<session>.<domain>/<path>                  (the host form E2B's getHost()
 *                                                            builds; any domain that reaches
 *                                                            the broker: *.localhost, a
 *                                                            wildcard DNS name)
 *
 * HTTP requests are forwarded one per tunnel (a fresh connection to the guest's loopback
 * for each); a WebSocket upgrade becomes a raw byte pipe. A request to a released sandbox
 * wakes it; while a connection is open, the sandbox is not released for idleness.
 *
 * Who may: a principal's token (`X-Hutch-Token: T`, or `Authorization: Bearer T`, which
 * is then not forwarded), and only to its own sandboxes; an E2B sandbox's traffic access
 * token (`e2b-traffic-access-token`), to that sandbox; a port its sandbox's creator made
 * public (`publicPorts`) without a token. Everything else answers 404 exactly like a
 * sandbox that does not exist, or 401 without any credential.
 */
import { request as httpRequest, type IncomingMessage, type ServerResponse } from 'node:http';
import type { Duplex } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';

export interface PortTarget {
  session: string;
  port: number;
  /** The path (and query) to ask of the sandbox's server. */
  path: string;
  form: 'path' | 'host';
}

const SESSION = '[A-Za-z0-9][A-Za-z0-9_-]{0,127}';
const PATH_FORM = new RegExp(`^/sandboxes/(${SESSION})/ports/(\\d{1,5})(/[^?#]*)?(\\?.*)?$`);
const HOST_FORM = new RegExp(`^(\\d{1,5})-(${SESSION})\\.[A-Za-z0-9.-]+(?::\\d{1,5})?$`);

function validPort(text: string): number | undefined {
  const n = Number(text);
  return Number.isInteger(n) && n >= 1 && n <= 65535 ? n : undefined;
}

/** The sandbox port a request names, by its path or its Host header; undefined for any other request. */
export function portTarget(req: Pick<IncomingMessage, 'url' | 'headers'>): PortTarget | undefined {
  const url = req.url ?? '/';
  const p = PATH_FORM.exec(url);
  if (p) {
    const port = validPort(p[2]!);
    if (port !== undefined) return { session: p[1]!, port, path: `${p[3] || '/'}${p[4] ?? ''}`, form: 'path' };
  }
  const h = HOST_FORM.exec(req.headers.host ?? '');
  if (h) {
    const port = validPort(h[1]!);
    if (port !== undefined) return { session: h[2]!, port, path: url, form: 'host' };
  }
  return undefined;
}

/** What the port proxy needs of the broker: who a token is, and a connection into a sandbox it may reach. */
export interface PortAccess {
  /** The principal a credential names, or undefined. */
  authenticate(token: string | undefined): string | undefined;
  /** The principal of `session` when `token` is its E2B traffic access token, or undefined. */
  trafficPrincipal(session: string, token: string): string | undefined;
  /**
   * A connection to the sandbox's port, for `principal` (undefined: no credential, only a
   * public port); `not_found` for a sandbox this caller may not see.
   */
  open(session: string, port: number, principal: string | undefined): Promise<{ socket: Duplex; done: Promise<unknown> }>;
}

/** Request headers that belong to this hop (RFC 9110 7.6.1) or carry hutch's own credential. */
const HOP = new Set(['connection', 'keep-alive', 'proxy-connection', 'proxy-authorization', 'te', 'trailer', 'transfer-encoding', 'upgrade', 'x-hutch-token', 'e2b-traffic-access-token']);

/** The credential a port request carries, and the headers to forward without it. */
export function credentialOf(req: Pick<IncomingMessage, 'headers'>): { token: string | undefined; traffic: string | undefined; forward: Record<string, string | string[]> } {
  const h = req.headers;
  const own = typeof h['x-hutch-token'] === 'string' ? h['x-hutch-token'] : undefined;
  const traffic = typeof h['e2b-traffic-access-token'] === 'string' ? h['e2b-traffic-access-token'] : undefined;
  const bearer = /^Bearer\s+(\S+)$/i.exec(typeof h.authorization === 'string' ? h.authorization : '')?.[1];
  const forward: Record<string, string | string[]> = {};
  for (const [k, v] of Object.entries(h)) {
    if (v === undefined || HOP.has(k)) continue;
    // Authorization is the app's own unless it is the hutch credential used for this request.
    if (k === 'authorization' && own === undefined && bearer !== undefined) continue;
    forward[k] = v;
  }
  return { token: own ?? bearer, traffic, forward };
}

/** After one end of an upgraded connection finishes, how long the other gets before both are closed. */
const UPGRADE_CLOSE_GRACE_MS = 5_000;

export class PortProxy {
  constructor(
    private readonly access: PortAccess,
    private readonly log: Logger,
  ) {}

  private refuse(res: ServerResponse, err: unknown, t: PortTarget): void {
    const e = err instanceof HutchError ? err : new HutchError('internal', (err as Error).message);
    const status = e.code === 'unauthorized' ? 401 : e.code === 'not_found' ? 404 : e.code === 'connection_refused' ? 502 : e.code === 'busy' || e.code === 'quota_exceeded' ? 429 : e.code === 'unavailable' ? 503 : 502;
    if (!res.headersSent) res.writeHead(status, { 'content-type': 'text/plain', 'x-hutch-error': e.code, ...(status === 401 ? { 'www-authenticate': 'Bearer' } : {}) });
    res.end(`hutch: ${e.code}: ${e.message}\n`);
    this.log.debug('ports.refused', { session: t.session, port: t.port, code: e.code });
  }

  private async connect(req: IncomingMessage, t: PortTarget): Promise<{ socket: Duplex; done: Promise<unknown>; forward: Record<string, string | string[]> }> {
    const { token, traffic, forward } = credentialOf(req);
    const principal = token !== undefined ? this.access.authenticate(token) : traffic !== undefined ? this.access.trafficPrincipal(t.session, traffic) : undefined;
    if ((token !== undefined || traffic !== undefined) && principal === undefined) throw new HutchError('unauthorized', 'the token is not valid here');
    const { socket, done } = await this.access.open(t.session, t.port, principal);
    // The server in the sandbox sees itself addressed as on its own machine (dev servers check Host).
    forward['host'] = `localhost:${t.port}`;
    const origHost = req.headers.host;
    if (origHost) forward['x-forwarded-host'] = origHost;
    forward['x-forwarded-proto'] = 'http';
    if (t.form === 'path') forward['x-forwarded-prefix'] = `/sandboxes/${t.session}/ports/${t.port}`;
    return { socket, done, forward };
  }

  /** Serves an HTTP request to a sandbox port (one tunnel per request). */
  async handleHttp(req: IncomingMessage, res: ServerResponse, t: PortTarget): Promise<void> {
    let conn: Awaited<ReturnType<PortProxy['connect']>>;
    try {
      conn = await this.connect(req, t);
    } catch (err) {
      req.resume();
      this.refuse(res, err, t);
      return;
    }
    const { socket, done, forward } = conn;
    const upstream = httpRequest({ createConnection: () => socket as never, method: req.method, path: t.path, headers: { ...forward, connection: 'close' } });
    // The guest refused or dropped the connection before answering.
    done.catch((err: unknown) => {
      upstream.destroy();
      if (res.headersSent) res.destroy();
      else this.refuse(res, err, t);
    });
    upstream.on('error', () => undefined);
    upstream.on('response', (r) => {
      const headers: Record<string, string | string[]> = {};
      for (const [k, v] of Object.entries(r.headers)) if (v !== undefined && k !== 'connection' && k !== 'keep-alive' && k !== 'transfer-encoding') headers[k] = v;
      res.writeHead(r.statusCode ?? 502, r.statusMessage, headers);
      void pipeline(r, res).catch(() => socket.destroy());
    });
    res.once('close', () => {
      if (!res.writableFinished) socket.destroy();
    });
    void pipeline(req, upstream).catch(() => socket.destroy());
  }

  /** Serves a WebSocket (or any) upgrade to a sandbox port: the request head goes on, then bytes both ways. */
  async handleUpgrade(req: IncomingMessage, client: Duplex, head: Buffer, t: PortTarget): Promise<void> {
    client.on('error', () => undefined);
    let conn: Awaited<ReturnType<PortProxy['connect']>>;
    try {
      conn = await this.connect(req, t);
    } catch (err) {
      const e = err instanceof HutchError ? err : new HutchError('internal', (err as Error).message);
      const status = e.code === 'unauthorized' ? '401 Unauthorized' : e.code === 'not_found' ? '404 Not Found' : '502 Bad Gateway';
      const body = `hutch: ${e.code}: ${e.message}\n`;
      client.end(`HTTP/1.1 ${status}\r\nContent-Type: text/plain\r\nContent-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`);
      return;
    }
    const { socket, done, forward } = conn;
    const lines = [`${req.method} ${t.path} HTTP/1.1`];
    for (const [k, v] of Object.entries(forward)) for (const one of Array.isArray(v) ? v : [v]) lines.push(`${k}: ${one.replace(/[\r\n]/g, ' ')}`);
    lines.push('connection: Upgrade', `upgrade: ${String(req.headers.upgrade ?? 'websocket').replace(/[\r\n]/g, ' ')}`, '', '');
    socket.write(Buffer.from(lines.join('\r\n'), 'latin1'));
    if (head.length) socket.write(head);
    // An upgraded connection has no half-close worth keeping: once either end is done, both
    // are (a server in the sandbox that never closes must not hold the tunnel, and with it
    // the sandbox's VM, after its client left).
    await new Promise<void>((resolve) => {
      let grace: NodeJS.Timeout | undefined;
      const teardown = () => {
        clearTimeout(grace);
        client.destroy();
        socket.destroy();
        resolve();
      };
      // One end finished: what it sent is flushed to the other, which gets a few seconds to finish too.
      const ended = (other: Duplex) => () => {
        other.end();
        grace ??= setTimeout(teardown, UPGRADE_CLOSE_GRACE_MS);
      };
      client.once('end', ended(socket));
      socket.once('end', ended(client));
      for (const s of [client, socket]) {
        s.once('close', teardown);
        s.once('error', teardown);
      }
      done.then(teardown, teardown);
      client.pipe(socket, { end: false });
      socket.pipe(client, { end: false });
    });
  }
}
