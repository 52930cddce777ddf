/**
 * A sandbox's egress policy: which destinations its traffic may reach through the
 * broker's proxy. Rules are domains (`pypi.org`), wildcards (`*.githubusercontent.com`:
 * subdomains only), addresses and CIDR ranges (`10.1.0.0/16`, `[fd12::]/16`), each with an
 * optional port or port range (`:443`, `:8000-8100`).
 *
 * Decided, in this order, on the name the client asked for and every address the host
 * resolved it to (the connection then goes to the first of those addresses, never to a
 * second lookup, so a name cannot rebind between the check and the connect):
 *   1. mode `none`: refused;
 *   2. a `deny` rule matching the name or any address: refused (deny wins over allow);
 *   3. an address no policy opens (loopback, this host, link-local and metadata, multicast,
 *      reserved; addresses.ts): refused;
 *   4. an address on a private network (RFC 1918, CGNAT, ULA): refused unless an `allow`
 *      CIDR rule names it: a domain rule never opens the host's LAN;
 *   5. mode `public`: allowed; mode `allowlist`: allowed only when an `allow` rule matches
 *      (a literal address only through a CIDR rule, so a domain rule cannot be bypassed by
 *      connecting to its address).
 */
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { familyOf, hardRefusal, judgedAddress, parseCidr, PRIVATE_RANGES, RangeSet, type Cidr } from './addresses.ts';

export type EgressMode = 'none' | 'allowlist' | 'public';
export const EGRESS_MODES: readonly EgressMode[] = ['none', 'allowlist', 'public'];

export type EgressRule =
  | { kind: 'domain'; name: string; text: string; ports?: PortRange }
  | { kind: 'suffix'; suffix: string; text: string; ports?: PortRange }
  | { kind: 'cidr'; cidr: Cidr; set: RangeSet; text: string; ports?: PortRange };

export interface PortRange {
  lo: number;
  hi: number;
}

export interface EgressPolicy {
  mode: EgressMode;
  allow: readonly EgressRule[];
  deny: readonly EgressRule[];
  /** Where an allow and a deny rule both match, the allow wins (E2B's semantics); default: the deny. */
  allowBeatsDeny?: boolean;
}

/** At most this many rules per list: each connection is checked against all of them. */
export const MAX_RULES = 1000;
const LABEL = /^(?!-)[a-z0-9_-]{1,63}(?<!-)$/;

/** A host name as compared: lower case, no trailing dot. */
export function normalName(name: string): string {
  return name.toLowerCase().replace(/\.$/, '');
}

function validName(name: string): boolean {
  return name.length <= 253 && name.split('.').every((l) => LABEL.test(l));
}

function parsePorts(text: string, rule: string): PortRange {
  const m = /^(\d{1,5})(?:-(\d{1,5}))?$/.exec(text);
  const lo = Number(m?.[1]);
  const hi = m?.[2] !== undefined ? Number(m[2]) : lo;
  if (!m || lo < 1 || hi > 65535 || lo > hi) throw new HutchError('bad_request', `egress rule ${JSON.stringify(rule)}: ${JSON.stringify(text)} is not a port or port range (1-65535, such as 443 or 8000-8100)`);
  return { lo, hi };
}

/** Parses one rule; a malformed one is `bad_request` naming it. */
export function parseRule(raw: string): EgressRule {
  const text = raw.trim();
  if (text.length === 0 || text.length > 300) throw new HutchError('bad_request', `egress rule ${JSON.stringify(raw.slice(0, 300))}: expected a domain, *.domain, an address or a CIDR range, with an optional :port`);
  let host = text;
  let ports: PortRange | undefined;
  // [v6]/len:port, [v6]:port, v6/len, v6, v4/len:port, name:port
  const bracket = /^\[([^\]]+)\](\/\d{1,3})?(?::(.+))?$/.exec(text);
  if (bracket) {
    host = bracket[1]! + (bracket[2] ?? '');
    if (bracket[3] !== undefined) ports = parsePorts(bracket[3], text);
  } else if ((text.match(/:/g) ?? []).length === 1) {
    const at = text.lastIndexOf(':');
    host = text.slice(0, at);
    ports = parsePorts(text.slice(at + 1), text);
  }
  const withPorts = <R extends EgressRule>(r: R): R => (ports ? { ...r, ports } : r);
  const addr = host.split('/')[0]!;
  if (familyOf(addr)) {
    const cidr = parseCidr(host, `egress rule ${JSON.stringify(text)}:`);
    return withPorts({ kind: 'cidr', cidr, set: new RangeSet([cidr]), text });
  }
  const name = normalName(host);
  if (name.startsWith('*.')) {
    const suffix = name.slice(2);
    if (!validName(suffix) || !suffix.includes('.')) throw new HutchError('bad_request', `egress rule ${JSON.stringify(text)}: a wildcard names the subdomains of a domain with a dot in it, such as *.example.com`);
    return withPorts({ kind: 'suffix', suffix, text });
  }
  if (!validName(name)) throw new HutchError('bad_request', `egress rule ${JSON.stringify(text)}: expected a domain, *.domain, an address or a CIDR range, with an optional :port`);
  return withPorts({ kind: 'domain', name, text });
}

export function parseRules(list: readonly string[], what: string): EgressRule[] {
  if (list.length > MAX_RULES) throw new HutchError('bad_request', `${what}: ${list.length} rules; at most ${MAX_RULES}`, { limit: MAX_RULES });
  return list.map(parseRule);
}

function portMatches(r: EgressRule, port: number): boolean {
  return !r.ports || (port >= r.ports.lo && port <= r.ports.hi);
}

/** Whether `r` matches a connection to `name` (normalised; undefined for a literal address) at `address`. */
function ruleMatches(r: EgressRule, name: string | undefined, address: string, port: number): boolean {
  if (!portMatches(r, port)) return false;
  switch (r.kind) {
    case 'domain':
      return name === r.name;
    case 'suffix':
      return name !== undefined && name.endsWith(`.${r.suffix}`);
    case 'cidr':
      return r.set.has(judgedAddress(address)) || r.set.has(address);
  }
}

export type EgressDecision =
  | { allowed: true; address: string; rule?: string }
  | { allowed: false; reason: string; rule?: string };

export interface DecideInput {
  /** What the client asked for: a name or a literal address. */
  host: string;
  port: number;
  /** Every address the host resolved the name to (the literal itself for an address). */
  addresses: readonly string[];
}

/** Decides one connection (see the module comment for the order). */
export function decide(policy: EgressPolicy, input: DecideInput, own: RangeSet): EgressDecision {
  const dest = `${input.host}:${input.port}`;
  if (policy.mode === 'none') return { allowed: false, reason: `${dest}: this sandbox has no network access (network: none)` };
  const name = familyOf(input.host) ? undefined : normalName(input.host);
  if (input.addresses.length === 0) return { allowed: false, reason: `${dest}: the name has no address` };
  const allowedBy = () => {
    for (const address of input.addresses) {
      const allow = policy.allow.find((r) => ruleMatches(r, name, address, input.port));
      if (allow) return allow;
    }
    return undefined;
  };
  const excepted = policy.allowBeatsDeny ? allowedBy() : undefined;
  for (const address of excepted ? [] : input.addresses) {
    const deny = policy.deny.find((r) => ruleMatches(r, name, address, input.port));
    if (deny) return { allowed: false, reason: `${dest} is denied by the rule ${JSON.stringify(deny.text)}`, rule: deny.text };
  }
  let via: string | undefined;
  for (const address of input.addresses) {
    const hard = hardRefusal(address, own);
    if (hard) return { allowed: false, reason: `${dest} is refused: ${address} is ${hard}` };
    if (PRIVATE_RANGES.has(judgedAddress(address))) {
      const opened = policy.allow.find((r) => r.kind === 'cidr' && ruleMatches(r, name, address, input.port));
      if (!opened) return { allowed: false, reason: `${dest} is refused: ${address} is on a private network (only an allow rule with its CIDR range opens it)` };
      via ??= opened.text;
    }
  }
  if (policy.mode === 'public') return { allowed: true, address: input.addresses[0]!, ...(via ? { rule: via } : {}) };
  const allow = excepted ?? allowedBy();
  if (allow) return { allowed: true, address: input.addresses[0]!, rule: allow.text };
  return { allowed: false, reason: `${dest} is not in this sandbox's allowlist (allow it with a rule such as ${JSON.stringify(name ?? input.host)})` };
}

/**
 * The refusal a connection gets whatever its name resolves to, or undefined when the
 * addresses decide: checked before the name is resolved, so a refused name costs no DNS
 * lookup (and tells no resolver what the sandbox tried).
 */
export function decideByName(policy: EgressPolicy, host: string, port: number): EgressDecision | undefined {
  const dest = `${host}:${port}`;
  if (policy.mode === 'none') return { allowed: false, reason: `${dest}: this sandbox has no network access (network: none)` };
  if (familyOf(host)) return undefined;
  const name = normalName(host);
  const byName = (r: EgressRule) => r.kind !== 'cidr' && ruleMatches(r, name, '', port);
  const allowed = policy.allow.find(byName);
  const denied = policy.deny.find(byName);
  if (denied && !(policy.allowBeatsDeny && allowed)) return { allowed: false, reason: `${dest} is denied by the rule ${JSON.stringify(denied.text)}`, rule: denied.text };
  if (policy.mode === 'allowlist' && !allowed && !policy.allow.some((r) => r.kind === 'cidr')) {
    return { allowed: false, reason: `${dest} is not in this sandbox's allowlist (allow it with a rule such as ${JSON.stringify(name)})` };
  }
  return undefined;
}

/** The policy's rules as text, for a sandbox's info. */
export function describePolicy(p: EgressPolicy): { mode: EgressMode; allow: string[]; deny: string[] } {
  return { mode: p.mode, allow: p.allow.map((r) => r.text), deny: p.deny.map((r) => r.text) };
}
