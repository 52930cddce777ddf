import { createHash, timingSafeEqual } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';

/** The principal a single `--token` (or HUTCH_TOKEN) stands for, and owner of sessions made before principals existed. */
export const DEFAULT_PRINCIPAL = 'default';

const NAME = /^[A-Za-z0-9_.-]{1,64}$/;
/** Shorter tokens are guessable over a fast loopback; refuse them rather than warn. */
export const MIN_TOKEN_CHARS = 16;

/**
 * Named bearer tokens. A principal owns the sessions it creates; another principal's
 * sessions are invisible to it (they answer not_found, like missing ones).
 *
 * Tokens are compared as SHA-256 digests with timingSafeEqual, against every entry without
 * stopping at a match, so neither a token's length nor its position leaks through timing.
 */
export class Principals {
  private readonly entries: Array<{ name: string; digest: Buffer }> = [];

  constructor(tokens: Record<string, string>) {
    const seen = new Set<string>();
    for (const [name, token] of Object.entries(tokens)) {
      if (!NAME.test(name)) throw new HutchError('bad_request', `principal name ${JSON.stringify(name)}: use 1-64 letters, digits, '.', '_' or '-'`);
      if (token.length < MIN_TOKEN_CHARS || /\s/.test(token)) throw new HutchError('bad_request', `the token of principal ${name} must be at least ${MIN_TOKEN_CHARS} characters without spaces`);
      const digest = sha256(token);
      const key = digest.toString('hex');
      if (seen.has(key)) throw new HutchError('bad_request', `principal ${name} reuses another principal's token`);
      seen.add(key);
      this.entries.push({ name, digest });
    }
    if (this.entries.length === 0) throw new HutchError('bad_request', 'no tokens: give --token or --tokens-file');
  }

  /** The simple case: one token, one principal. */
  static single(token: string, name = DEFAULT_PRINCIPAL): Principals {
    return new Principals({ [name]: token });
  }

  /**
   * A tokens file: a JSON object `{ "alice": "<token>", ... }`, or lines `name:token`
   * (blank lines and `#` comments ignored).
   */
  static fromFile(path: string): Principals {
    let text: string;
    try {
      text = readFileSync(path, 'utf8');
    } catch (err) {
      throw new HutchError('not_found', `cannot read the tokens file ${path}: ${(err as Error).message}`);
    }
    return new Principals(parseTokens(text, path));
  }

  /** A gateway's credential (host-broker/src/gateway/credential.ts), when brokers sit behind gateways. */
  private gateway: { matches(token: string | undefined): boolean } | undefined;

  /** Trust a gateway: a connection presenting its credential acts for the principal it names. */
  trustGateway(credential: { matches(token: string | undefined): boolean }): void {
    this.gateway = credential;
  }

  /**
   * The principal this token belongs to, or undefined. `onBehalfOf` (the gateway's principal
   * header) counts only with the gateway credential: a tenant's own token always stays its own.
   */
  authenticate(given: string | undefined, onBehalfOf?: string): string | undefined {
    return this.identify(given, onBehalfOf)?.principal;
  }

  /** As authenticate, and whether the caller is a gateway acting for the principal (it alone may name a new session's id). */
  identify(given: string | undefined, onBehalfOf?: string): { principal: string; viaGateway: boolean } | undefined {
    if (given === undefined) return undefined;
    const d = sha256(given);
    let found: string | undefined;
    for (const e of this.entries) if (timingSafeEqual(d, e.digest) && found === undefined) found = e.name;
    if (found === undefined && onBehalfOf !== undefined && NAME.test(onBehalfOf) && this.gateway?.matches(given)) return { principal: onBehalfOf, viaGateway: true };
    return found === undefined ? undefined : { principal: found, viaGateway: false };
  }

  get names(): string[] {
    return this.entries.map((e) => e.name);
  }
}

export function parseTokens(text: string, source = 'tokens'): Record<string, string> {
  const trimmed = text.trim();
  if (trimmed.startsWith('{')) {
    let obj: unknown;
    try {
      obj = JSON.parse(trimmed);
    } catch (err) {
      throw new HutchError('bad_request', `${source}: invalid JSON: ${(err as Error).message}`);
    }
    const out: Record<string, string> = {};
    for (const [k, v] of Object.entries(obj as Record<string, unknown>)) {
      if (typeof v !== 'string') throw new HutchError('bad_request', `${source}: the token of ${k} must be a string`);
      out[k] = v;
    }
    return out;
  }
  const out: Record<string, string> = {};
  for (const [i, raw] of text.split('\n').entries()) {
    const line = raw.trim();
    if (!line || line.startsWith('#')) continue;
    const colon = line.indexOf(':');
    if (colon <= 0) throw new HutchError('bad_request', `${source}:${i + 1}: expected name:token`);
    const name = line.slice(0, colon).trim();
    if (Object.hasOwn(out, name)) throw new HutchError('bad_request', `${source}:${i + 1}: principal ${name} given twice`);
    out[name] = line.slice(colon + 1).trim();
  }
  return out;
}

function sha256(s: string): Buffer {
  return createHash('sha256').update(s).digest();
}
