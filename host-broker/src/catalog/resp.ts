/**
 * A small Redis client speaking RESP2 over one TCP connection.
 *
 * Why not the `redis` npm package: the catalog needs a handful of commands (SET with NX/PX,
 * GET, MGET, DEL, SADD/SREM/SMEMBERS, EVAL) on one connection with request/response
 * matching; no pub/sub, cluster mode, or RESP3. That is ~150 lines that we can read whole,
 * against a dependency tree whose install churn every helper would share. If the catalog
 * ever needs Sentinel/Cluster, switch to node-redis (v4+ runs on Node 20).
 *
 * `rediss://` speaks TLS (node:tls): the server's certificate is always verified, against
 * the system's CAs plus NODE_EXTRA_CA_CERTS (Node's own variable for a private CA), and its
 * name against the host in the address. There is deliberately no option to skip either.
 *
 * Semantics: commands are pipelined in order; replies are matched FIFO. A dropped
 * connection fails every pending command with `unavailable` and the next command
 * reconnects. Every command has a deadline, so a hung Redis cannot hold a caller forever.
 */
import { connect, isIP, type Socket } from 'node:net';
import { connect as tlsConnect, type SecureContextOptions } from 'node:tls';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';

export type RespValue = string | number | null | RespValue[];

interface Pending {
  resolve: (v: RespValue) => void;
  reject: (e: Error) => void;
  timer: NodeJS.Timeout;
}

/** Parsed `redis[s]://[:password@]host:port[/db]`. */
export interface RedisAddress {
  host: string;
  port: number;
  password?: string;
  username?: string;
  db?: number;
  /** rediss://: TLS, the server's certificate verified. */
  tls?: boolean;
}

export function parseRedisUrl(url: string): RedisAddress {
  let u: URL;
  try {
    u = new URL(url);
  } catch {
    throw new HutchError('bad_request', `catalog address ${JSON.stringify(url)}: expected redis://host:port or rediss://host:port`);
  }
  if (u.protocol !== 'redis:' && u.protocol !== 'rediss:') throw new HutchError('bad_request', `catalog address ${JSON.stringify(url)}: only redis:// and rediss:// (TLS) are supported`);
  const db = u.pathname.length > 1 ? Number(u.pathname.slice(1)) : undefined;
  if (db !== undefined && (!Number.isInteger(db) || db < 0)) throw new HutchError('bad_request', `catalog address ${JSON.stringify(url)}: bad database number`);
  return {
    host: u.hostname || '127.0.0.1',
    port: u.port ? Number(u.port) : 6379,
    ...(u.password ? { password: decodeURIComponent(u.password) } : {}),
    ...(u.username ? { username: decodeURIComponent(u.username) } : {}),
    ...(db !== undefined ? { db } : {}),
    ...(u.protocol === 'rediss:' ? { tls: true } : {}),
  };
}

/** How an address is shown in errors and logs: never with its password. */
function shown(a: RedisAddress): string {
  return `${a.tls ? 'rediss' : 'redis'}://${a.host}:${a.port}`;
}

/** Thrown for an error reply (`-ERR ...`): Redis understood and refused; not a transport failure. */
export class RedisReplyError extends Error {}

export class RespClient {
  private socket: Socket | undefined;
  private connecting: Promise<Socket> | undefined;
  private readonly pending: Pending[] = [];
  private buf: Buffer = Buffer.alloc(0);
  private closed = false;

  constructor(
    readonly address: RedisAddress,
    private readonly timeoutMs = 2000,
    /** For rediss://: CAs to trust instead of the system's (tests; operators use NODE_EXTRA_CA_CERTS). */
    private readonly tlsCa?: SecureContextOptions['ca'],
  ) {}

  /** Sends one command; resolves with its reply (error replies reject with RedisReplyError). */
  async command(...args: Array<string | number>): Promise<RespValue> {
    if (this.closed) throw new HutchError('unavailable', 'catalog client closed');
    const socket = await this.ensure();
    return this.send(socket, args);
  }

  close(): void {
    this.closed = true;
    this.socket?.destroy();
    this.fail(new HutchError('unavailable', 'catalog client closed'));
  }

  private send(socket: Socket, args: Array<string | number>): Promise<RespValue> {
    return new Promise<RespValue>((resolve, reject) => {
      const timer = setTimeout(() => {
        // Replies are matched by position: after a timeout the stream can no longer be
        // trusted, so the connection is dropped (failing the rest) and rebuilt on next use.
        socket.destroy(new Error(`no reply within ${this.timeoutMs} ms`));
      }, this.timeoutMs);
      this.pending.push({ resolve, reject, timer });
      socket.write(encode(args));
    });
  }

  private ensure(): Promise<Socket> {
    if (this.socket && !this.socket.destroyed) return Promise.resolve(this.socket);
    this.connecting ??= this.open().finally(() => (this.connecting = undefined));
    return this.connecting;
  }

  private async open(): Promise<Socket> {
    const { host, port } = this.address;
    const where = shown(this.address);
    const socket = await new Promise<Socket>((resolve, reject) => {
      // The connect deadline covers the TLS handshake too: a server that accepts and never answers is down.
      const s = this.address.tls
        ? tlsConnect({ host, port, ...(isIP(host) ? {} : { servername: host }), minVersion: 'TLSv1.2', ...(this.tlsCa ? { ca: this.tlsCa } : {}) })
        : connect({ host, port });
      const timer = setTimeout(() => s.destroy(new Error(`connect timed out after ${this.timeoutMs} ms`)), this.timeoutMs);
      s.once(this.address.tls ? 'secureConnect' : 'connect', () => {
        clearTimeout(timer);
        resolve(s);
      });
      s.once('error', (err) => {
        clearTimeout(timer);
        const code = (err as NodeJS.ErrnoException).code;
        const why = code && !err.message.includes(code) ? `${err.message} (${code})` : err.message;
        reject(new HutchError('unavailable', `catalog ${where} unreachable: ${why}`, { catalog: `${host}:${port}` }));
      });
    });
    socket.setNoDelay(true);
    this.buf = Buffer.alloc(0);
    socket.on('data', (d: Buffer) => this.onData(d));
    socket.on('error', () => undefined); // 'close' follows and fails what is pending
    socket.on('close', () => {
      if (this.socket === socket) this.socket = undefined;
      this.fail(new HutchError('unavailable', `catalog ${where}: connection lost`, { catalog: `${host}:${port}` }));
    });
    this.socket = socket;
    if (this.address.password !== undefined) await this.send(socket, this.address.username ? ['AUTH', this.address.username, this.address.password] : ['AUTH', this.address.password]);
    if (this.address.db !== undefined) await this.send(socket, ['SELECT', this.address.db]);
    return socket;
  }

  private fail(err: Error): void {
    for (const p of this.pending.splice(0)) {
      clearTimeout(p.timer);
      p.reject(err);
    }
  }

  private onData(d: Buffer): void {
    this.buf = this.buf.length ? Buffer.concat([this.buf, d]) : d;
    for (;;) {
      let r: Parsed | undefined;
      try {
        r = parseReply(this.buf, 0);
      } catch (err) {
        this.socket?.destroy(err as Error); // a stream we cannot read: fail what is pending, reconnect next time
        return;
      }
      if (r === undefined) return;
      this.buf = this.buf.subarray(r.end);
      const p = this.pending.shift();
      if (!p) continue; // a reply nobody waits for (cannot happen with FIFO matching)
      clearTimeout(p.timer);
      if (r.value instanceof RedisReplyError) p.reject(r.value);
      else p.resolve(r.value);
    }
  }
}

function encode(args: Array<string | number>): Buffer {
  const parts: Buffer[] = [Buffer.from(`*${args.length}\r\n`)];
  for (const a of args) {
    const b = Buffer.from(String(a), 'utf8');
    parts.push(Buffer.from(`$${b.length}\r\n`), b, Buffer.from('\r\n'));
  }
  return Buffer.concat(parts);
}

type Parsed = { value: RespValue | RedisReplyError; end: number };

/** One reply starting at `at`, or undefined when the buffer does not hold all of it yet. */
function parseReply(buf: Buffer, at: number): Parsed | undefined {
  const nl = buf.indexOf('\r\n', at);
  if (nl < 0) return undefined;
  const line = buf.toString('utf8', at + 1, nl);
  const next = nl + 2;
  switch (buf[at]) {
    case 0x2b: // +
      return { value: line, end: next };
    case 0x2d: // -
      return { value: new RedisReplyError(line), end: next };
    case 0x3a: // :
      return { value: Number(line), end: next };
    case 0x24: {
      // $
      const n = Number(line);
      if (n < 0) return { value: null, end: next };
      if (buf.length < next + n + 2) return undefined;
      return { value: buf.toString('utf8', next, next + n), end: next + n + 2 };
    }
    case 0x2a: {
      // *
      const n = Number(line);
      if (n < 0) return { value: null, end: next };
      const items: RespValue[] = [];
      let pos = next;
      for (let i = 0; i < n; i++) {
        const r = parseReply(buf, pos);
        if (r === undefined) return undefined;
        // An error inside an array (EXEC) surfaces as its message; the catalog uses none.
        items.push(r.value instanceof RedisReplyError ? r.value.message : r.value);
        pos = r.end;
      }
      return { value: items, end: pos };
    }
    default:
      throw new HutchError('internal', `catalog: unexpected RESP type byte ${buf[at]}`);
  }
}
