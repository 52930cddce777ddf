/**
 * The Connect protocol's JSON flavour, server side, as small as the E2B SDK needs it
 * (connect-web with `useBinaryFormat: false`): unary calls are a plain JSON body and answer;
 * server-streaming calls carry enveloped messages (1 flag byte, 4-byte big-endian length,
 * JSON) both ways, and end with an end-stream envelope (flag 0x02) holding `{}` or
 * `{"error":{code,message}}`. Messages are written in protobuf's JSON mapping by hand
 * (camelCase names, bytes as base64, int64 as strings, enums by name), which is all the
 * E2B envd messages use. Spec: https://connectrpc.com/docs/protocol
 */
import type { IncomingMessage, ServerResponse } from 'node:http';
import { HutchError, type ErrorCode } from '../../../guest-agent/src/protocol/errors.ts';
import { parseJsonBounded } from '../../../guest-agent/src/protocol/value-shape.ts';
import type { Sender } from '../api/send-budget.ts';

const END_STREAM = 0x02;
const COMPRESSED = 0x01;

/** Connect error codes with the HTTP status a unary error carries. */
const CONNECT_STATUS: Record<string, number> = {
  invalid_argument: 400,
  unauthenticated: 401,
  permission_denied: 403,
  not_found: 404,
  already_exists: 409,
  failed_precondition: 412,
  resource_exhausted: 429,
  canceled: 499,
  unimplemented: 501,
  unavailable: 503,
  deadline_exceeded: 504,
  internal: 500,
};

/** hutch's typed errors as Connect codes (the SDK keys on not_found / already_exists). */
export function connectCode(code: ErrorCode): string {
  switch (code) {
    case 'not_found':
      return 'not_found';
    case 'already_exists':
      return 'already_exists';
    case 'bad_request':
    case 'outside_workspace':
    case 'not_a_directory':
    case 'is_a_directory':
    case 'not_empty':
    case 'binary_file':
    case 'invalid_name':
    case 'unsupported_file_type':
      return 'invalid_argument';
    case 'permission_denied':
      return 'permission_denied';
    case 'quota_exceeded':
    case 'no_space':
    case 'too_large':
    case 'busy':
      return 'resource_exhausted';
    case 'timeout':
      return 'deadline_exceeded';
    case 'cancelled':
      return 'canceled';
    case 'unauthorized':
      return 'unauthenticated';
    default:
      return 'internal';
  }
}

export class ConnectError extends Error {
  constructor(
    readonly code: string,
    message: string,
  ) {
    super(message);
  }

  static from(err: unknown): ConnectError {
    if (err instanceof ConnectError) return err;
    if (err instanceof HutchError) return new ConnectError(connectCode(err.code), `${err.code}: ${err.message}`);
    return new ConnectError('internal', (err as Error).message ?? String(err));
  }
}

export function unaryReply(res: ServerResponse, msg: unknown): void {
  res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify(msg));
}

export function unaryError(res: ServerResponse, err: unknown): void {
  const e = ConnectError.from(err);
  res.writeHead(CONNECT_STATUS[e.code] ?? 500, { 'content-type': 'application/json' }).end(JSON.stringify({ code: e.code, message: e.message }));
}

/** The one request message of a unary (plain JSON) or server-streaming (enveloped) call. */
export function requestMessage(req: IncomingMessage, body: Buffer): Record<string, unknown> {
  const streaming = (req.headers['content-type'] ?? '').startsWith('application/connect+json');
  let json = body;
  if (streaming) {
    if (body.length < 5) throw new ConnectError('invalid_argument', 'missing request envelope');
    if ((body[0] as number) & COMPRESSED) throw new ConnectError('unimplemented', 'compressed request messages are not supported');
    const len = body.readUInt32BE(1);
    if (body.length < 5 + len) throw new ConnectError('invalid_argument', 'truncated request envelope');
    json = body.subarray(5, 5 + len);
  }
  if (json.length === 0) return {};
  try {
    const v = parseJsonBounded(json.toString('utf8'));
    if (v === null || typeof v !== 'object' || Array.isArray(v)) throw new Error('not an object');
    return v as Record<string, unknown>;
  } catch (err) {
    throw new ConnectError('invalid_argument', `request is not a JSON message: ${(err as Error).message}`);
  }
}

function envelope(flags: number, msg: unknown): Buffer {
  const json = Buffer.from(JSON.stringify(msg), 'utf8');
  const head = Buffer.alloc(5);
  head[0] = flags;
  head.writeUInt32BE(json.length, 1);
  return Buffer.concat([head, json]);
}

/**
 * A server stream: messages as they come, then exactly one end-stream envelope. Every
 * envelope goes through the client's send budget (api/send-budget.ts), in order: `send`
 * resolves once the socket took its message's bytes into its queue, so a producer that
 * awaits it (a command's output) waits for a client that reads slowly.
 */
export class ServerStream {
  private ended = false;

  constructor(
    private readonly res: ServerResponse,
    private readonly sender?: Sender,
  ) {
    res.writeHead(200, { 'content-type': 'application/connect+json' });
    res.flushHeaders();
  }

  /** Sends a message once it fits; rejects if the client went away first. */
  async send(msg: unknown): Promise<void> {
    if (this.ended || this.res.destroyed) return;
    await this.write(envelope(0, msg), false);
  }

  /**
   * A message nothing waits on (a keepalive, a directory event): when the client has its
   * whole bound queued already, it is not reading, and the stream is dropped instead.
   */
  post(msg: unknown, full: () => void): void {
    if (this.sender && this.sender.queued >= this.sender.limit) {
      full();
      this.res.destroy();
      return;
    }
    this.send(msg).catch(() => undefined);
  }

  end(err?: unknown): void {
    if (this.ended) return;
    this.ended = true;
    if (this.res.destroyed) return;
    const e = err === undefined ? undefined : ConnectError.from(err);
    this.write(envelope(END_STREAM, e ? { error: { code: e.code, message: e.message } } : {}), true).catch(() => undefined);
  }

  private async write(data: Buffer, last: boolean): Promise<void> {
    const res = this.res;
    const put = (taken?: () => void) => {
      if (res.destroyed) taken?.();
      else if (last) res.end(data, taken);
      else res.write(data, taken);
    };
    if (this.sender) await this.sender.send(data.length, put);
    else put();
  }
}
