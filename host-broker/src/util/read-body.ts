import type { IncomingMessage } from 'node:http';

/**
 * A request's whole body, at most `limit` bytes: refused by its Content-Length before a byte
 * is read, else as soon as the read passes the limit. `tooLarge` makes the error the caller's
 * API answers with (an HTTP 413 of its own shape).
 */
export async function readBody(req: IncomingMessage, limit: number, tooLarge: (message: string) => Error): Promise<Buffer> {
  const declared = Number(req.headers['content-length'] ?? 0);
  if (declared > limit) throw tooLarge(`request body of ${declared} bytes is above the ${limit}-byte limit`);
  const parts: Buffer[] = [];
  let n = 0;
  for await (const c of req as AsyncIterable<Buffer>) {
    n += c.length;
    if (n > limit) throw tooLarge(`request body above the ${limit}-byte limit`);
    parts.push(c);
  }
  return Buffer.concat(parts);
}
