import { z } from 'zod';

/**
 * Network methods of the agent protocol (net.*): a sandbox's TCP connections tunnelled
 * over its agent channel, so the guest needs no NIC and the broker decides every one.
 *
 * - `net.open` (agent -> broker): a tenant process connected to the agent's proxy port in
 *   the guest; the broker serves it as an HTTP proxy under the sandbox's egress policy.
 * - `net.dial` (broker -> agent): a harness reaches a port a tenant process listens on.
 *
 * Each request carries two streams (bytes each way) and is answered when the connection
 * ends, with what passed. Merged into METHODS in methods.ts.
 */
const streamId = z.number().int().positive().max(0xffffffff);
const bytes = z.number().int().nonnegative().max(Number.MAX_SAFE_INTEGER);

export const NetOpenParamsSchema = z.object({
  /** Bytes from the tenant's connection (agent -> broker). */
  up: streamId,
  /** Bytes back to it (broker -> agent). */
  down: streamId,
  /** How the tenant reached the agent: its proxy port, or a transparent redirect naming its destination. */
  via: z.enum(['proxy']).optional(),
});
export const NetOpenResultSchema = z.object({
  outcome: z.enum(['allowed', 'refused', 'failed']),
  bytesIn: bytes,
  bytesOut: bytes,
});

export const NetDialParamsSchema = z.object({
  /** A port on the guest's loopback. */
  port: z.number().int().min(1).max(65535),
  /** Bytes to the guest's listener (broker -> agent). */
  down: streamId,
  /** Bytes from it (agent -> broker). */
  up: streamId,
});
export const NetDialResultSchema = z.object({ bytesIn: bytes, bytesOut: bytes });

export const NET_METHODS = {
  'net.open': { params: NetOpenParamsSchema, result: NetOpenResultSchema },
  'net.dial': { params: NetDialParamsSchema, result: NetDialResultSchema },
} as const;

/** The port the agent's proxy listens on in the guest (loopback only); tenant env points at it. */
export const GUEST_PROXY_PORT = 3128;
