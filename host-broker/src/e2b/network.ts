/**
 * E2B's network settings (POST /sandboxes `allow_internet_access` and `network`, PUT
 * /sandboxes/{id}/network) as a hutch network spec, with E2B's semantics: internet unless
 * `allow_internet_access: false` or a catch-all `denyOut` (0.0.0.0/0); `allowOut` (domains,
 * `*.domain`, CIDRs) beats `denyOut` (CIDRs). Without either, the broker's default applies
 * (an operator's allowlist, not E2B's open internet: README "Network").
 *
 * Port traffic: E2B lets anyone reach a sandbox's ports unless `allowPublicTraffic: false`;
 * hutch asks for a credential unless the creator says `allowPublicTraffic: true` (then any
 * port is public), and takes E2B's `e2b-traffic-access-token` as that credential.
 */
import type { NetworkSpec } from '../api/harness-protocol.ts';
import { ApiError } from './api-error.ts';

export interface E2bNetwork {
  /** What hutch enforces (undefined: the broker's default). */
  spec: NetworkSpec | undefined;
  /** Every port public (E2B's allowPublicTraffic: true). */
  publicTraffic: boolean;
  /** As E2B reports it back in the sandbox's info. */
  echo: Record<string, unknown>;
}

const CATCH_ALL = new Set(['0.0.0.0/0', '::/0', '0.0.0.0']);

function stringList(v: unknown, what: string): string[] | undefined {
  if (v === undefined || v === null) return undefined;
  if (!Array.isArray(v) || v.some((x) => typeof x !== 'string') || v.length > 1000) throw new ApiError(400, `${what} must be a list of at most 1000 strings`);
  return v as string[];
}

export function e2bNetwork(body: Record<string, unknown>): E2bNetwork {
  const internet = body['allow_internet_access'] ?? body['allowInternetAccess'];
  if (internet !== undefined && typeof internet !== 'boolean') throw new ApiError(400, 'allow_internet_access must be a boolean');
  const raw = body['network'];
  if (raw !== undefined && raw !== null && (typeof raw !== 'object' || Array.isArray(raw))) throw new ApiError(400, 'network must be an object');
  const n = (raw ?? {}) as Record<string, unknown>;
  const allowOut = stringList(n['allowOut'], 'network.allowOut');
  const denyOut = stringList(n['denyOut'], 'network.denyOut');
  for (const k of ['egressProxy', 'rules', 'maskRequestHost']) {
    if (n[k] !== undefined && n[k] !== null) throw new ApiError(400, `network.${k} is not supported by hutch (README "Network")`);
  }
  const publicTraffic = n['allowPublicTraffic'] === true;
  const closed = internet === false || (denyOut ?? []).some((d) => CATCH_ALL.has(d));
  const deny = (denyOut ?? []).filter((d) => !CATCH_ALL.has(d));
  const echo: Record<string, unknown> = {
    ...(internet !== undefined ? { allowInternetAccess: internet } : {}),
    ...(raw !== undefined && raw !== null ? { network: { ...(allowOut ? { allowOut } : {}), ...(denyOut ? { denyOut } : {}), allowPublicTraffic: publicTraffic } } : {}),
  };
  if (internet === undefined && allowOut === undefined && denyOut === undefined) return { spec: undefined, publicTraffic, echo };
  const spec: NetworkSpec = {
    base: closed ? 'none' : internet === true ? 'public' : 'default',
    ...(allowOut?.length ? { allow: allowOut } : {}),
    ...(deny.length ? { deny } : {}),
    precedence: 'allow',
  };
  return { spec, publicTraffic, echo };
}
