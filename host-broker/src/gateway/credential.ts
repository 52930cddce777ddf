import { createHash, timingSafeEqual } from 'node:crypto';
import type { IncomingMessage } from 'node:http';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';

/**
 * The header a gateway names the principal it acts for in. A broker honours it only on a
 * connection that presents the gateway credential; with a tenant's token it is ignored (the
 * connection stays that tenant's), so a tenant cannot impersonate another principal.
 */
export const PRINCIPAL_HEADER = 'x-hutch-principal';

const MIN_CHARS = 32;

/**
 * The gateway-to-broker credential: a shared secret (HUTCH_GATEWAY_TOKEN, from a Secret in
 * Kubernetes) distinct from every tenant token. Compared as SHA-256 digests in constant time,
 * like principals' tokens.
 */
export class GatewayCredential {
  private readonly digest: Buffer;

  constructor(readonly token: string) {
    if (token.length < MIN_CHARS || /\s/.test(token)) throw new HutchError('bad_request', `the gateway credential must be at least ${MIN_CHARS} characters without spaces`);
    this.digest = sha256(token);
  }

  matches(given: string | undefined): boolean {
    return given !== undefined && timingSafeEqual(sha256(given), this.digest);
  }
}

/** The principal a request claims to act for (only meaningful with the gateway credential). */
export function claimedPrincipal(req: IncomingMessage): string | undefined {
  const v = req.headers[PRINCIPAL_HEADER];
  return typeof v === 'string' ? v : undefined;
}

function sha256(s: string): Buffer {
  return createHash('sha256').update(s).digest();
}
