import { Packr } from 'msgpackr';
import { HutchError } from './errors.ts';
import { checkMsgpackShape, type ShapeLimits } from './value-shape.ts';

/**
 * Frames are a 4-byte big-endian body length followed by one msgpack value.
 * The length is checked against the limit *before* any body byte is buffered, so an
 * oversized or garbage length costs nothing; because the stream cannot be re-synchronised
 * after a bad length, that error is fatal. A body that does not decode is not fatal:
 * the frame boundary is intact and the next frame can be read.
 */
export const FRAME_HEADER_BYTES = 4;

// useRecords:false keeps the encoding plain msgpack (maps), readable by any peer;
// bin values decode as Buffers that reference the input chunk instead of copying.
const packr = new Packr({ useRecords: false, moreTypes: false, int64AsType: 'number' });

export function encodeFrame(value: unknown, maxFrameBytes: number): Buffer {
  const body = packr.pack(value);
  if (body.length > maxFrameBytes) {
    throw new HutchError('too_large', `frame of ${body.length} bytes exceeds the limit of ${maxFrameBytes}`, {
      bytes: body.length,
      limit: maxFrameBytes,
    });
  }
  const frame = Buffer.allocUnsafe(FRAME_HEADER_BYTES + body.length);
  frame.writeUInt32BE(body.length, 0);
  body.copy(frame, FRAME_HEADER_BYTES);
  return frame;
}

/**
 * The hot path: a `{t:'data', s, ep, d}` frame encoded by hand as the same msgpack a Packr
 * would produce (fixmap 4, keys as fixstr, s and ep as uint32, d as bin32), returned as a
 * small head plus the caller's payload so the payload is written with writev and never copied.
 */
const DATA_HEAD_BYTES = 1 + 2 + 5 + 2 + 5 + 3 + 5 + 2 + 5;
export function encodeDataFrameHead(stream: number, payloadBytes: number, epoch = 0): Buffer {
  const bodyLen = DATA_HEAD_BYTES + payloadBytes;
  const h = Buffer.allocUnsafe(FRAME_HEADER_BYTES + DATA_HEAD_BYTES);
  let o = h.writeUInt32BE(bodyLen, 0);
  h[o++] = 0x84; // fixmap, 4 entries
  h[o++] = 0xa1; h[o++] = 0x74; // "t"
  h[o++] = 0xa4; o += h.write('data', o, 'latin1');
  h[o++] = 0xa1; h[o++] = 0x73; // "s"
  h[o++] = 0xce; o = h.writeUInt32BE(stream, o);
  h[o++] = 0xa2; h[o++] = 0x65; h[o++] = 0x70; // "ep"
  h[o++] = 0xce; o = h.writeUInt32BE(epoch >>> 0, o);
  h[o++] = 0xa1; h[o++] = 0x64; // "d"
  h[o++] = 0xc6; h.writeUInt32BE(payloadBytes, o);
  return h;
}
export const DATA_FRAME_OVERHEAD = FRAME_HEADER_BYTES + DATA_HEAD_BYTES;

export type DecodeResult =
  | { ok: true; value: unknown }
  | { ok: false; fatal: boolean; error: HutchError };

export class FrameDecoder {
  private chunks: Buffer[] = [];
  private buffered = 0;
  private expected = -1; // body length of the frame being read, -1 while reading a header
  private failed = false;

  /** `shape`: checked on each body before it is decoded (for a peer that picks costly content). */
  constructor(
    private readonly maxFrameBytes: number,
    private readonly shape?: ShapeLimits,
  ) {}

  /** Bytes held for a partial frame; bounded by the frame limit. */
  get bufferedBytes(): number {
    return this.buffered;
  }

  /** True when the input stopped mid-frame (the connection ended with a truncated frame). */
  get hasPartialFrame(): boolean {
    return this.buffered > 0 || this.expected >= 0;
  }

  *push(chunk: Buffer): Generator<DecodeResult> {
    if (this.failed) return;
    this.chunks.push(chunk);
    this.buffered += chunk.length;
    for (;;) {
      if (this.expected < 0) {
        if (this.buffered < FRAME_HEADER_BYTES) return;
        const len = this.take(FRAME_HEADER_BYTES).readUInt32BE(0);
        if (len > this.maxFrameBytes) {
          this.failed = true;
          this.chunks = [];
          this.buffered = 0;
          yield {
            ok: false,
            fatal: true,
            error: new HutchError('too_large', `frame length ${len} exceeds the limit of ${this.maxFrameBytes}`, {
              bytes: len,
              limit: this.maxFrameBytes,
            }),
          };
          return;
        }
        if (len === 0) {
          yield { ok: false, fatal: false, error: new HutchError('bad_request', 'empty frame') };
          continue;
        }
        this.expected = len;
      }
      if (this.buffered < this.expected) return;
      const body = this.take(this.expected);
      this.expected = -1;
      yield decodeBody(body, this.shape);
    }
  }

  /** Removes n bytes from the front, copying only when they span chunks. */
  private take(n: number): Buffer {
    this.buffered -= n;
    const first = this.chunks[0] as Buffer;
    if (first.length === n) {
      this.chunks.shift();
      return first;
    }
    if (first.length > n) {
      this.chunks[0] = first.subarray(n);
      return first.subarray(0, n);
    }
    const out = Buffer.allocUnsafe(n);
    let off = 0;
    while (off < n) {
      const c = this.chunks[0] as Buffer;
      const m = Math.min(c.length, n - off);
      c.copy(out, off, 0, m);
      off += m;
      if (m === c.length) this.chunks.shift();
      else this.chunks[0] = c.subarray(m);
    }
    return out;
  }
}

function decodeBody(body: Buffer, shape: ShapeLimits | undefined): DecodeResult {
  try {
    if (shape) checkMsgpackShape(body, shape);
  } catch (err) {
    return { ok: false, fatal: false, error: err as HutchError };
  }
  try {
    // unpackMultiple would accept trailing garbage silently; a frame holds exactly one value.
    const values = packr.unpackMultiple(body) as unknown[];
    if (values.length !== 1) {
      return { ok: false, fatal: false, error: new HutchError('bad_request', `frame holds ${values.length} msgpack values, expected 1`) };
    }
    return { ok: true, value: values[0] };
  } catch (err) {
    return {
      ok: false,
      fatal: false,
      error: new HutchError('bad_request', `frame body is not valid msgpack: ${(err as Error).message}`, { bytes: body.length }),
    };
  }
}
