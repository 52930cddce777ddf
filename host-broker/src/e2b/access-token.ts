/**
 * A sandbox's envd access token: `<principal>~<48 hex digits>`. The random part is the
 * secret the broker checks; the principal in front lets a gateway find the sandbox in a
 * catalog keyed by principal without knowing who asks (envd requests carry no API key). A
 * forged prefix only routes the request to a broker that then refuses the token.
 */
import { randomBytes } from 'node:crypto';

const SEPARATOR = '~';
/** Principal names hold letters, digits, '.', '_' and '-' (principals.ts): never the separator. */
const TOKEN = /^([A-Za-z0-9_.-]{1,64})~[0-9a-f]{48}$/;

export function newAccessToken(principal: string): string {
  return `${principal}${SEPARATOR}${randomBytes(24).toString('hex')}`;
}

/** The principal an access token names, or undefined when it is not one of ours. */
export function principalOfAccessToken(token: unknown): string | undefined {
  return typeof token === 'string' ? TOKEN.exec(token)?.[1] : undefined;
}
