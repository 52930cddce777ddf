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

/**
 * The connection epoch: the identity of one logical session between a broker and an agent.
 * The agent picks a new one for every session it starts (a new connection, a reopened
 * device port, a new broker hello) and both sides stamp it on every frame after the
 * handshake; a frame of another epoch is never acted on. This is what makes a
 * half-dead connection visible: after a snapshot restore, a request that reached an agent
 * session other than the one the broker shook hands with is refused (`stale_epoch`)
 * instead of being silently dropped, and the broker re-handshakes.
 */
const epoch = z.number().int().nonnegative().max(0xffffffff);
const ep = epoch.optional();

export const HelloSchema = z.object({
  t: z.literal('hello'),
  v: z.number().int().positive(),
  role: z.enum(['agent', 'broker']),
  /** Largest frame this side accepts. */
  maxFrame: z.number().int().min(4096).max(64 * 1024 * 1024),
  /** Bytes this side will buffer per inbound stream before it grants more credit. */
  window: z.number().int().min(4096).max(64 * 1024 * 1024),
  caps: CapabilitiesSchema,
  /** Broker: a random number naming this handshake attempt; the agent echoes it. */
  nonce: z.number().int().nonnegative().max(0xffffffff).optional(),
  /** Agent: the nonce of the broker hello this answers. */
  echo: z.number().int().nonnegative().max(0xffffffff).optional(),
  /** Agent: the epoch of the session this hello starts. */
  ep,
});

export const RequestSchema = z.object({
  t: z.literal('req'),
  id,
  m: z.string().min(1).max(64),
  p: z.unknown(),
  s: z.array(streamId).max(16).optional(),
  ep,
});

/** Exactly one of `r` (result) and `e` (error) is present; the connection checks that. */
export const ResponseSchema = z.object({ t: z.literal('res'), id, r: z.unknown().optional(), e: WireErrorSchema.optional(), ep });
export const CancelSchema = z.object({ t: z.literal('cancel'), id, ep });
export const EventSchema = z.object({ t: z.literal('evt'), n: z.string().min(1).max(64), d: z.unknown(), ep });
export const DataSchema = z.object({ t: z.literal('data'), s: streamId, d: bytes, ep });
export const CreditSchema = z.object({ t: z.literal('credit'), s: streamId, n: z.number().int().positive(), ep });
export const EndSchema = z.object({ t: z.literal('end'), s: streamId, e: WireErrorSchema.optional(), ep });
export const StopSchema = z.object({ t: z.literal('stop'), s: streamId, ep });
/** A connection-level complaint about a frame that could not be tied to a request. */
export const NoticeSchema = z.object({ t: z.literal('notice'), e: WireErrorSchema, ep });
/**
 * Liveness: the broker pings while it waits on the agent; the agent's connection answers
 * at once, whatever its handlers are doing. No pong means the guest is gone or frozen; a
 * `stale_epoch` notice in answer means the agent's side of the channel started over.
 */
export const PingSchema = z.object({ t: z.literal('ping'), n: z.number().int().nonnegative(), ep });
export const PongSchema = z.object({ t: z.literal('pong'), n: z.number().int().nonnegative(), ep });

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
  PingSchema,
  PongSchema,
]);

export type Hello = z.infer<typeof HelloSchema>;
export type Message = z.infer<typeof MessageSchema>;
export type Capabilities = z.infer<typeof CapabilitiesSchema>;
