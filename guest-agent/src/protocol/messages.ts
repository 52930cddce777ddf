import { z } from 'zod';
import { WireErrorSchema } from './errors.ts';

/**
 * The envelope of every frame. Short keys keep per-frame overhead small: a data frame
 * costs ~12 bytes on top of its payload.
 *
 * Streams are identified by numbers the requester allocates (odd for the broker side,
 * even for the agent side, so both may open streams without colliding) and are bound to
 * one request, listed in `req.s`; they live until both ends are done or the request ends.
 */
const id = z.number().int().nonnegative().max(Number.MAX_SAFE_INTEGER);
const streamId = z.number().int().positive().max(0xffffffff);
/** Binary data; typed as a plain Uint8Array so Buffers (which msgpack decodes to) fit. */
const bytes = z.custom<Uint8Array>((v) => v instanceof Uint8Array, 'expected binary data');

export const CapabilitiesSchema = z.record(z.string(), z.unknown());

export const HelloSchema = z.object({
  t: z.literal('hello'),
  v: z.number().int().positive(),
  role: z.enum(['agent', 'broker']),
  /** Largest frame this side accepts. */
  maxFrame: z.number().int().min(4096).max(64 * 1024 * 1024),
  /** Bytes this side will buffer per inbound stream before it grants more credit. */
  window: z.number().int().min(4096).max(64 * 1024 * 1024),
  caps: CapabilitiesSchema,
});

export const RequestSchema = z.object({
  t: z.literal('req'),
  id,
  m: z.string().min(1).max(64),
  p: z.unknown(),
  s: z.array(streamId).max(16).optional(),
});

/** Exactly one of `r` (result) and `e` (error) is present; the connection checks that. */
export const ResponseSchema = z.object({ t: z.literal('res'), id, r: z.unknown().optional(), e: WireErrorSchema.optional() });
export const CancelSchema = z.object({ t: z.literal('cancel'), id });
export const EventSchema = z.object({ t: z.literal('evt'), n: z.string().min(1).max(64), d: z.unknown() });
export const DataSchema = z.object({ t: z.literal('data'), s: streamId, d: bytes });
export const CreditSchema = z.object({ t: z.literal('credit'), s: streamId, n: z.number().int().positive() });
export const EndSchema = z.object({ t: z.literal('end'), s: streamId, e: WireErrorSchema.optional() });
export const StopSchema = z.object({ t: z.literal('stop'), s: streamId });
/** A connection-level complaint about a frame that could not be tied to a request. */
export const NoticeSchema = z.object({ t: z.literal('notice'), e: WireErrorSchema });

export const MessageSchema = z.discriminatedUnion('t', [
  HelloSchema,
  RequestSchema,
  ResponseSchema,
  CancelSchema,
  EventSchema,
  DataSchema,
  CreditSchema,
  EndSchema,
  StopSchema,
  NoticeSchema,
]);

export type Hello = z.infer<typeof HelloSchema>;
export type Message = z.infer<typeof MessageSchema>;
export type Capabilities = z.infer<typeof CapabilitiesSchema>;
