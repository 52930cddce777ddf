/**
 * MCP over Streamable HTTP at /mcp on the broker's own HTTP server.
 *
 * A request whose Origin is not allowed (any, by default) or whose Host is not one of the
 * server's names is refused with 403 first (DNS rebinding: http-origin.ts). Authentication
 * is the WebSocket API's: a bearer token in the Authorization header (never the query
 * string) names a principal (no token or a wrong one: 401). Each MCP session belongs to the principal that opened it (another
 * principal's session id answers 404, like a missing one) and reaches the broker through
 * the SDK over loopback with the caller's own token, so it sees that principal's sandboxes
 * and nothing else, with the same routing and limits as any harness.
 */
import { randomUUID } from 'node:crypto';
import type { IncomingMessage, ServerResponse } from 'node:http';
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js';
import type { McpServer } from '@modelcontextprotocol/sdk/server/mcp.js';
import type { Logger } from '../../../guest-agent/src/log.ts';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { parseJsonBounded } from '../../../guest-agent/src/protocol/value-shape.ts';
import { readBody } from '../util/read-body.ts';
import { Hutch } from '../sdk/index.ts';
import { createMcpServer, HutchLink } from './server.ts';
import { refusedOrigin, type McpOriginPolicy } from './http-origin.ts';

export interface McpHttpLimits {
  /** Largest request body; a bigger one is refused with 413 (by Content-Length without reading it, else when the read passes it). */
  maxBodyBytes: number;
  /** Open MCP sessions per principal (each holds one broker connection); more answer 429. */
  maxSessionsPerPrincipal: number;
  /** An MCP session without a request for this long is closed (its sandboxes stay). */
  idleMs: number;
}

/** 8 MiB: a write_file of a few MiB of text fits (JSON escaping grows it), a flood of them does not pile up in memory. */
export const DEFAULT_MCP_HTTP_LIMITS: McpHttpLimits = { maxBodyBytes: 8 * 1024 * 1024, maxSessionsPerPrincipal: 16, idleMs: 30 * 60_000 };

interface Session {
  principal: string;
  transport: StreamableHTTPServerTransport;
  server: McpServer;
  link: HutchLink;
  timer: NodeJS.Timeout;
  inflight: number;
  closed: boolean;
}

/** The ws:// address a broker listening on host:port is reached at from its own process. */
export function loopbackUrl(host: string | undefined, port: number): string {
  const h = !host || host === '0.0.0.0' ? '127.0.0.1' : host === '::' ? '::1' : host;
  return `ws://${h.includes(':') ? `[${h}]` : h}:${port}`;
}

function jsonRpcError(res: ServerResponse, status: number, message: string, headers: Record<string, string> = {}): void {
  res.writeHead(status, { 'content-type': 'application/json', ...headers }).end(JSON.stringify({ jsonrpc: '2.0', error: { code: -32000, message }, id: null }));
}

export class McpHttpEndpoint {
  private readonly sessions = new Map<string, Session>();
  readonly limits: McpHttpLimits;

  constructor(
    private readonly o: {
      /** Where this broker's WebSocket API is reached from inside its own process. */
      brokerUrl: () => string;
      log: Logger;
      limits?: Partial<McpHttpLimits>;
      /** Origins and Host names served (http-origin.ts: ownHostNames for the server's own). */
      origins: McpOriginPolicy;
    },
  ) {
    this.limits = { ...DEFAULT_MCP_HTTP_LIMITS, ...o.limits };
  }

  /** True for the paths this endpoint serves. */
  static matches(url: string | undefined): boolean {
    return url === '/mcp' || url?.startsWith('/mcp?') === true;
  }

  async handle(req: IncomingMessage, res: ServerResponse, principal: string | undefined, token: string | undefined): Promise<void> {
    const refused = refusedOrigin(req, this.o.origins);
    if (refused !== undefined) {
      this.o.log.warn('mcp.origin_refused', { origin: req.headers['origin'], host: req.headers['host'], remote: req.socket.remoteAddress });
      jsonRpcError(res, 403, `permission_denied: ${refused}`, { connection: 'close' });
      return;
    }
    if (principal === undefined || token === undefined) {
      jsonRpcError(res, 401, 'unauthorized: /mcp needs a bearer token (Authorization: Bearer <hutch token>)', { 'www-authenticate': 'Bearer' });
      return;
    }
    // Refuse an announced oversized body before reading a byte of it; the connection then
    // closes, so the unread body is not drained either. Bodies without a length are cut
    // off by the transport's own bounded reader at the same limit.
    const declared = Number(req.headers['content-length'] ?? 0);
    if (declared > this.limits.maxBodyBytes) {
      jsonRpcError(res, 413, `too_large: request body of ${declared} bytes is above the ${this.limits.maxBodyBytes}-byte limit`, { connection: 'close' });
      return;
    }
    // The body is read and parsed here, not by the transport, so its shape is checked before
    // JSON.parse builds it on the broker's loop (guest-agent/src/protocol/value-shape.ts).
    let body: unknown;
    if (req.method === 'POST') {
      let raw: Buffer;
      try {
        raw = await readBody(req, this.limits.maxBodyBytes, (m) => new HutchError('too_large', m));
      } catch (err) {
        // Past the limit: 413; anything else is the client going away mid-body.
        if (err instanceof HutchError) jsonRpcError(res, 413, `too_large: ${err.message}`, { connection: 'close' });
        else res.destroy();
        return;
      }
      try {
        body = parseJsonBounded(raw.toString('utf8'));
      } catch (err) {
        jsonRpcError(res, 400, `parse error: ${(err as Error).message}`);
        return;
      }
    }
    const sid = req.headers['mcp-session-id'];
    if (typeof sid === 'string') {
      const s = this.sessions.get(sid);
      // Another principal's session is answered exactly like a missing one.
      if (!s || s.principal !== principal) {
        jsonRpcError(res, 404, 'not_found: no such MCP session');
        return;
      }
      await this.run(s, req, res, body);
      return;
    }
    if (req.method !== 'POST') {
      jsonRpcError(res, 400, 'bad_request: without an Mcp-Session-Id header only an initialize POST is accepted', { allow: 'POST' });
      return;
    }
    if (this.count(principal) >= this.limits.maxSessionsPerPrincipal) {
      jsonRpcError(res, 429, `busy: principal ${principal} already holds ${this.limits.maxSessionsPerPrincipal} MCP sessions (close one with DELETE /mcp)`);
      return;
    }
    const s = this.open(principal, token);
    await this.run(s, req, res, body);
    // Not an initialize request (the transport answered it with an error): nothing to keep.
    if (s.transport.sessionId === undefined) await this.dispose(s);
  }

  private open(principal: string, token: string): Session {
    const link = new HutchLink(() => Hutch.connect(this.o.brokerUrl(), { token }));
    const server = createMcpServer(link);
    const transport: StreamableHTTPServerTransport = new StreamableHTTPServerTransport({
      sessionIdGenerator: () => randomUUID(),
      maxRequestBodySize: this.limits.maxBodyBytes,
      onsessioninitialized: (id) => {
        this.sessions.set(id, s);
        this.o.log.info('mcp.session_opened', { principal, session: id });
      },
    });
    const timer = setTimeout(() => this.expire(s), this.limits.idleMs);
    timer.unref();
    const s: Session = { principal, transport, server, link, timer, inflight: 0, closed: false };
    // A DELETE from the client (or close()) ends the session and its broker connection.
    transport.onclose = () => void this.dispose(s);
    void server.connect(transport);
    return s;
  }

  private async run(s: Session, req: IncomingMessage, res: ServerResponse, body: unknown): Promise<void> {
    s.inflight++;
    s.timer.refresh();
    try {
      await s.transport.handleRequest(req, res, body);
    } finally {
      s.inflight--;
      s.timer.refresh();
    }
  }

  /** Idle past the limit: closed, unless a request (a long command, an SSE stream) is still open. */
  private expire(s: Session): void {
    if (s.inflight > 0) {
      s.timer.refresh();
      return;
    }
    this.o.log.info('mcp.session_idle', { principal: s.principal, session: s.transport.sessionId });
    void s.transport.close();
  }

  private async dispose(s: Session): Promise<void> {
    // Closing the server closes its transport, whose onclose comes back here.
    if (s.closed) return;
    s.closed = true;
    clearTimeout(s.timer);
    const id = s.transport.sessionId;
    if (id !== undefined && this.sessions.get(id) === s) {
      this.sessions.delete(id);
      this.o.log.info('mcp.session_closed', { principal: s.principal, session: id });
    }
    await s.link.close();
    await s.server.close().catch(() => undefined);
  }

  private count(principal: string): number {
    let n = 0;
    for (const s of this.sessions.values()) if (s.principal === principal) n++;
    return n;
  }

  async close(): Promise<void> {
    await Promise.all([...this.sessions.values()].map((s) => s.transport.close().catch(() => undefined)));
  }
}
