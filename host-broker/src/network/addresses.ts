/**
 * What a sandbox's traffic may never reach, whatever its policy says, and the address
 * forms that hide an IPv4 address inside an IPv6 one.
 *
 * Every check runs on the address the proxy will connect to (resolved once, by the host),
 * never on a name: a name that resolves to loopback is loopback. Ranges are Node's
 * `net.BlockList`, which also matches IPv4-mapped IPv6 forms (::ffff:127.0.0.1) against
 * IPv4 subnets. Translation prefixes that embed an IPv4 address by other means (NAT64,
 * 6to4, IPv4-compatible, Teredo) are unwrapped here and the embedded address judged
 * instead, so `64:ff9b::7f00:1` is loopback too.
 */
import { BlockList, isIP } from 'node:net';
import { networkInterfaces } from 'node:os';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';

export type Family = 'ipv4' | 'ipv6';

export function familyOf(address: string): Family | undefined {
  const f = isIP(address);
  return f === 4 ? 'ipv4' : f === 6 ? 'ipv6' : undefined;
}

/** An address range in CIDR form ("10.0.0.0/8", "fd00::/8") or a bare address. */
export interface Cidr {
  readonly family: Family;
  readonly address: string;
  readonly prefix: number;
  readonly text: string;
}

/** Parses "10.1.0.0/16", "fd12::/16" or a bare address; throws `bad_request` naming `what` otherwise. */
export function parseCidr(text: string, what = 'address range'): Cidr {
  const slash = text.indexOf('/');
  const address = slash < 0 ? text : text.slice(0, slash);
  const family = familyOf(address);
  const width = family === 'ipv4' ? 32 : 128;
  const len = slash < 0 ? String(width) : text.slice(slash + 1);
  const prefix = /^\d{1,3}$/.test(len) ? Number(len) : NaN;
  if (!family || !(prefix >= 0 && prefix <= width)) {
    throw new HutchError('bad_request', `${what} ${JSON.stringify(text)}: expected an address range such as 10.1.0.0/16 or fd12::/16, or an address`);
  }
  return { family, address, prefix, text };
}

/** A set of ranges; `has` answers for any address form BlockList understands. */
export class RangeSet {
  private readonly list = new BlockList();
  readonly ranges: Cidr[] = [];

  constructor(ranges: Iterable<Cidr> = []) {
    for (const r of ranges) this.add(r);
  }

  add(r: Cidr): void {
    this.list.addSubnet(r.address, r.prefix, r.family);
    this.ranges.push(r);
  }

  /** The first range holding `address`, or undefined. */
  match(address: string): Cidr | undefined {
    const family = familyOf(address);
    if (!family || !this.list.check(address, family)) return undefined;
    // BlockList says whether, not which: find the rule for the message (few ranges, rare path).
    return this.ranges.find((r) => {
      const one = new BlockList();
      one.addSubnet(r.address, r.prefix, r.family);
      return one.check(address, family);
    });
  }

  has(address: string): boolean {
    const family = familyOf(address);
    return family !== undefined && this.list.check(address, family);
  }
}

const ranges = (...texts: string[]) => new RangeSet(texts.map((t) => parseCidr(t)));

/** Never reachable, with the reason a refusal gives. Order matters only for the message. */
const HARD: ReadonlyArray<[RangeSet, string]> = [
  [ranges('127.0.0.0/8', '::1/128'), 'loopback'],
  [ranges('0.0.0.0/8', '::/128'), 'the unspecified network'],
  [ranges('169.254.0.0/16', 'fe80::/10'), 'link-local (cloud metadata services live here)'],
  [ranges('100.100.100.200/32', 'fd00:ec2::254/128'), 'a cloud metadata service'],
  [ranges('224.0.0.0/4', 'ff00::/8'), 'multicast'],
  // Only what no network routes to a host: documentation and benchmarking ranges stay open,
  // since resolvers in sandboxed networks answer with them (here, deb.debian.org is 203.0.113.80).
  [ranges('240.0.0.0/4', '255.255.255.255/32', 'fec0::/10', '100::/64'), 'a reserved range'],
];

/** The LANs a host sits on: reachable only through an explicit CIDR rule naming them. */
export const PRIVATE_RANGES = ranges('10.0.0.0/8', '172.16.0.0/12', '192.168.0.0/16', '100.64.0.0/10', 'fc00::/7');

/**
 * The IPv4 address an IPv6 address carries by a translation scheme, or undefined.
 * NAT64 (64:ff9b::/96 and the local-use 64:ff9b:1::/48), 6to4 (2002::/16: bits 16-47),
 * IPv4-compatible (::/96) and Teredo (2001::/32: the client address, bitwise inverted,
 * in the last 32 bits). IPv4-mapped (::ffff:0:0/96) is BlockList's own business.
 */
export function embeddedIpv4(address: string): string | undefined {
  if (familyOf(address) !== 'ipv6') return undefined;
  const words = expandV6(address);
  if (!words) return undefined;
  const v4 = (hi: number, lo: number) => [hi >> 8, hi & 0xff, lo >> 8, lo & 0xff].join('.');
  const [w0, w1, w2, w3, w4, w5, w6, w7] = words as [number, number, number, number, number, number, number, number];
  if (w0 === 0x64 && w1 === 0xff9b && w2 === 0 && w3 === 0 && w4 === 0 && w5 === 0) return v4(w6, w7);
  if (w0 === 0x64 && w1 === 0xff9b && w2 === 1) return v4(w6, w7);
  if (w0 === 0x2002) return v4(w1, w2);
  if (w0 === 0x2001 && w1 === 0) return v4(w6 ^ 0xffff, w7 ^ 0xffff);
  if (w0 === 0 && w1 === 0 && w2 === 0 && w3 === 0 && w4 === 0 && w5 === 0 && (w6 !== 0 || w7 > 1)) return v4(w6, w7);
  return undefined;
}

/** Eight 16-bit words, or undefined for a malformed address (an embedded dotted quad is allowed). */
function expandV6(address: string): number[] | undefined {
  let a = address.toLowerCase().split('%')[0]!;
  const dotted = /(\d+)\.(\d+)\.(\d+)\.(\d+)$/.exec(a);
  if (dotted) {
    const o = dotted.slice(1).map(Number);
    if (o.some((x) => x > 255)) return undefined;
    a = `${a.slice(0, dotted.index)}${((o[0]! << 8) | o[1]!).toString(16)}:${((o[2]! << 8) | o[3]!).toString(16)}`;
  }
  const [head, tail, extra] = a.split('::');
  if (extra !== undefined) return undefined;
  const parts = (s: string | undefined) => (s ? s.split(':') : []);
  const h = parts(head);
  const t = parts(tail);
  const missing = 8 - h.length - t.length;
  if (tail === undefined ? missing !== 0 : missing < 1) return undefined;
  const groups = [...h, ...Array<string>(tail === undefined ? 0 : missing).fill('0'), ...t];
  if (groups.some((g) => !/^[0-9a-f]{1,4}$/.test(g))) return undefined;
  return groups.map((g) => parseInt(g, 16));
}

/** The address in the form ranges are judged on: an embedded IPv4 address is judged as itself. */
export function judgedAddress(address: string): string {
  return embeddedIpv4(address) ?? address;
}

/** This host's interface addresses: a sandbox reaching one reaches the broker's own ports. */
export function ownAddresses(): RangeSet {
  const own = new RangeSet();
  for (const list of Object.values(networkInterfaces())) {
    for (const i of list ?? []) {
      const addr = i.address.split('%')[0]!;
      if (familyOf(addr)) own.add(parseCidr(addr));
    }
  }
  return own;
}

/**
 * Why `address` may never be reached (loopback, this host, link-local and metadata,
 * multicast, reserved), or undefined. No policy opens these.
 */
export function hardRefusal(address: string, own: RangeSet): string | undefined {
  const a = judgedAddress(address);
  if (!familyOf(a)) return 'not an IP address';
  for (const [set, why] of HARD) if (set.has(a)) return why;
  if (own.has(a)) return "one of this host's own addresses";
  return undefined;
}
