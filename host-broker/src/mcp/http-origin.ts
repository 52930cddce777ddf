/**
 * Which requests /mcp serves by where they say they come from and whom they say they reach.
 *
 * A DNS rebinding attack: a page on evil.example re-points that name at the broker's address
 * (loopback, a LAN address), and the browser then sends the page's requests to the broker as
 * same-origin ones, with `Origin: https://evil.example` and `Host: evil.example`. The MCP
 * specification's Streamable HTTP transport says servers must validate Origin on every
 * connection and answer 403 when it is present and not allowed. Non-browser clients (Claude
 * Code, opencode, the SDKs) send no Origin, so none is allowed unless the operator lists it
 * (`--allowed-origin`). Host is checked too, against the names the broker is reached by: a
 * rebound request names the attacker's domain there, whatever Origin it carries.
 *
 * The MCP SDK's own guard (`enableDnsRebindingProtection` on its transport) does not fit: an
 * empty origin list there means any origin, its Host list is matched with the port as
 * written, and it runs inside the transport, after the body was read and a session looked up.
 */
import { UsageError } from '../../../guest-agent/src/cli-options.ts';
import { isIP } from 'node:net';
import { hostname, networkInterfaces } from 'node:os';
import type { IncomingMessage } from 'node:http';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';

export interface McpOriginPolicy {
  /** Origins (scheme://host[:port]) a browser page may call /mcp from; none by default. */
  allowedOrigins: readonly string[];
  /** Names (host names or IP addresses, without a port) the Host header may give. */
  allowedHosts: readonly string[];
}

/** What the operator adds: `--allowed-origin` and `--allowed-host`, each parsed by the functions below. */
export interface McpHttpAllowed {
  allowedOrigins?: string[];
  allowedHosts?: string[];
}

const LOOPBACK_NAMES = ['localhost', '127.0.0.1', '[::1]'];
/** A DNS name: labels of letters, digits and inner dashes. */
const HOST_NAME = /^(?=.{1,253}$)[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*\.?$/;

/** `--allowed-origin`: an origin as a browser sends it (http or https, no path, query or user). */
export function parseAllowedOrigin(v: string): string {
  let u: URL;
  try {
    u = new URL(v);
  } catch {
    throw new HutchError('bad_request', `--allowed-origin ${JSON.stringify(v)}: not a URL; give an origin such as https://app.example.com`);
  }
  if ((u.protocol !== 'http:' && u.protocol !== 'https:') || u.username || u.password || u.search || u.hash || (u.pathname !== '/' && u.pathname !== '')) {
    throw new HutchError('bad_request', `--allowed-origin ${JSON.stringify(v)}: give an origin only (http:// or https://, a host, maybe a port), such as https://app.example.com`);
  }
  return u.origin;
}

/** `--allowed-host`: a host name or IP address, matched without the port. */
export function parseAllowedHost(v: string): string {
  const name = normalHost(v);
  if (name === undefined) throw new HutchError('bad_request', `--allowed-host ${JSON.stringify(v)}: give a host name or an IP address without a port or scheme, such as hutch.internal or 10.0.0.5`);
  return name;
}

/** The two lists as options of `hutch serve` and `hutch gateway` (cli-options.ts), each entry checked as it is parsed. */
export const MCP_HTTP_OPTIONS = {
  'allowed-origin': {
    arg: 'O',
    help: 'a browser origin that may call /mcp (repeatable; default none: any Origin is refused 403)',
    multiple: true,
    parse: (t: string) => usage(() => parseAllowedOrigin(t), '--allowed-origin'),
  },
  'allowed-host': {
    arg: 'H',
    help: "a Host name /mcp answers besides its own (loopback, listen and advertised hosts; repeatable)",
    multiple: true,
    parse: (t: string) => usage(() => parseAllowedHost(t), '--allowed-host'),
  },
} as const;

function usage<T>(fn: () => T, option: string): T {
  try {
    return fn();
  } catch (err) {
    throw new UsageError((err as Error).message, option);
  }
}

/** Both lists from their parsed options. */
export function mcpHttpFrom(v: { 'allowed-origin'?: string[] | undefined; 'allowed-host'?: string[] | undefined }): { mcpHttp?: McpHttpAllowed } {
  const origins = v['allowed-origin'] ?? [];
  const hosts = v['allowed-host'] ?? [];
  if (origins.length === 0 && hosts.length === 0) return {};
  return { mcpHttp: { ...(origins.length ? { allowedOrigins: [...origins] } : {}), ...(hosts.length ? { allowedHosts: [...hosts] } : {}) } };
}

/** A name as URL writes a Host header's host part (lowercase, IPv6 in brackets), or undefined if it is not one. */
function normalHost(v: string): string | undefined {
  const bare = v.startsWith('[') && v.endsWith(']') ? v.slice(1, -1) : v;
  if (isIP(bare) === 6) return new URL(`http://[${bare}]`).hostname;
  if (isIP(bare) === 4) return bare;
  const lower = v.toLowerCase();
  return HOST_NAME.test(lower) ? lower.replace(/\.$/, '') : undefined;
}

/**
 * The names a broker or gateway is reached by: loopback's, the address it listens on (all of
 * this machine's addresses and its host name when it listens on every address), the host of
 * its --advertise-url, and what the operator adds.
 */
export function ownHostNames(o: { listenHost?: string | undefined; advertiseUrl?: string | undefined; extra?: readonly string[] | undefined }): string[] {
  const names = new Set(LOOPBACK_NAMES);
  const listen = o.listenHost ?? '127.0.0.1';
  if (listen === '0.0.0.0' || listen === '::' || listen === '') {
    const own = normalHost(hostname());
    if (own) names.add(own);
    for (const addrs of Object.values(networkInterfaces())) for (const a of addrs ?? []) names.add(normalHost(a.address) ?? a.address);
  } else {
    names.add(normalHost(listen) ?? listen);
  }
  if (o.advertiseUrl) {
    try {
      names.add(new URL(o.advertiseUrl).hostname.toLowerCase());
    } catch {
      // the cluster options check the URL itself
    }
  }
  for (const h of o.extra ?? []) names.add(parseAllowedHost(h));
  return [...names];
}

/** The reason a request is refused (403), or undefined when its Origin and Host are allowed. */
export function refusedOrigin(req: IncomingMessage, policy: McpOriginPolicy): string | undefined {
  const origin = req.headers['origin'];
  if (origin !== undefined && !policy.allowedOrigins.includes(origin)) {
    return `Origin ${JSON.stringify(origin)} is not allowed to call /mcp (browser origins must be listed with --allowed-origin; MCP clients that are not browsers send none)`;
  }
  const host = req.headers['host'];
  let name: string | undefined;
  try {
    name = host ? new URL(`http://${host}`).hostname.toLowerCase() : undefined;
  } catch {
    name = undefined;
  }
  if (name === undefined || !policy.allowedHosts.includes(name)) {
    return `Host ${JSON.stringify(host ?? '')} is not a name this server answers /mcp for (add it with --allowed-host)`;
  }
  return undefined;
}
