/**
 * The egress policy's decisions and the address rules under them (network/addresses.ts,
 * network/egress-policy.ts), and how the host's registries become the default allowlist
 * (network/registries.ts). Pure functions: the live proxy is tested in egress-proxy.test.ts
 * and test/security/egress.test.ts.
 */
import { mkdirSync, mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { embeddedIpv4, hardRefusal, parseCidr, RangeSet } from '../host-broker/src/network/addresses.ts';
import { decide, parseRule, parseRules, type EgressPolicy } from '../host-broker/src/network/egress-policy.ts';
import { Networks, DEFAULT_NETWORK } from '../host-broker/src/network/networks.ts';
import { aptUrls, hostRegistries } from '../host-broker/src/network/registries.ts';

const own = new RangeSet([parseCidr('192.0.2.7'), parseCidr('2001:db8::7')]);

describe('addresses no policy opens', () => {
  it.each([
    ['127.0.0.1', 'loopback'],
    ['127.8.9.10', 'loopback'],
    ['0.0.0.0', 'unspecified'],
    ['169.254.169.254', 'link-local'],
    ['100.100.100.200', 'metadata'],
    ['fd00:ec2::254', 'metadata'],
    ['224.0.0.1', 'multicast'],
    ['255.255.255.255', 'reserved'],
    ['::1', 'loopback'],
    ['::', 'unspecified'],
    ['::ffff:127.0.0.1', 'loopback'],
    ['::ffff:7f00:1', 'loopback'],
    ['::ffff:a9fe:a9fe', 'link-local'],
    ['fe80::1', 'link-local'],
    ['ff02::1', 'multicast'],
    ['192.0.2.7', 'own addresses'],
    ['2001:db8::7', 'own addresses'],
    // IPv4 hidden in IPv6 by translation schemes: judged as the IPv4 address.
    ['64:ff9b::7f00:1', 'loopback'], // NAT64
    ['64:ff9b::169.254.169.254', 'link-local'],
    ['64:ff9b:1::a9fe:a9fe', 'link-local'], // local-use NAT64
    ['2002:7f00:1::', 'loopback'], // 6to4
    ['2002:a9fe:a9fe::1', 'link-local'],
    ['::127.0.0.1', 'loopback'], // IPv4-compatible
    ['2001:0:4136:e378:8000:63bf:80ff:fffe', 'loopback'], // Teredo: client 127.0.0.1, inverted
    ['not-an-ip', 'not an IP'],
  ])('%s is refused (%s)', (addr, why) => {
    expect(hardRefusal(addr, own)).toMatch(new RegExp(why));
  });

  it.each(['151.101.2.132', '203.0.113.80', '2a04:4e42::644', '64:ff9b::9765:284'])('%s may be reached', (addr) => {
    expect(hardRefusal(addr, own)).toBeUndefined();
  });

  it('unwraps the embedded IPv4 of each translation scheme', () => {
    expect(embeddedIpv4('64:ff9b::a00:1')).toBe('10.0.0.1');
    expect(embeddedIpv4('2002:0a00:0001::1')).toBe('10.0.0.1');
    expect(embeddedIpv4('2606:4700::1')).toBeUndefined();
    expect(embeddedIpv4('10.0.0.1')).toBeUndefined();
  });
});

describe('rules', () => {
  it.each([
    ['pypi.org', { kind: 'domain', name: 'pypi.org' }],
    ['PyPI.org.', { kind: 'domain', name: 'pypi.org' }],
    ['*.github.com', { kind: 'suffix', suffix: 'github.com' }],
    ['registry.npmjs.org:443', { kind: 'domain', ports: { lo: 443, hi: 443 } }],
    ['db.example.com:5432-5433', { kind: 'domain', ports: { lo: 5432, hi: 5433 } }],
    ['10.1.0.0/16', { kind: 'cidr' }],
    ['10.1.2.3:8080', { kind: 'cidr', ports: { lo: 8080, hi: 8080 } }],
    ['fd12::/16', { kind: 'cidr' }],
    ['[fd12::1]:443', { kind: 'cidr', ports: { lo: 443, hi: 443 } }],
    ['[fd12::]/16:443', { kind: 'cidr', ports: { lo: 443, hi: 443 } }],
  ])('%s parses', (text, shape) => {
    expect(parseRule(text)).toMatchObject(shape);
  });

  it.each(['', '*', '*.com', 'exa mple.com', 'a..b', '-a.com', 'x.com:0', 'x.com:70000', 'x.com:9-1', '10.0.0.0/33', 'x.com:http', 'a'.repeat(301)])('%j is refused with bad_request', (text) => {
    expect(() => parseRule(text)).toThrow(expect.objectContaining({ code: 'bad_request' }));
  });

  it('refuses more rules than the limit', () => {
    expect(() => parseRules(Array.from({ length: 1001 }, (_, i) => `h${i}.example.com`), 'network.allow')).toThrow(/at most 1000/);
  });
});

describe('decide', () => {
  const pol = (mode: EgressPolicy['mode'], allow: string[] = [], deny: string[] = []): EgressPolicy => ({ mode, allow: parseRules(allow, 'a'), deny: parseRules(deny, 'd') });
  const go = (p: EgressPolicy, host: string, port: number, addresses: string[]) => decide(p, { host, port, addresses }, own);

  it('none refuses everything, saying so', () => {
    expect(go(pol('none'), 'pypi.org', 443, ['151.101.0.223'])).toMatchObject({ allowed: false, reason: expect.stringMatching(/no network access/) });
  });

  it('an allowlist allows its names and ports only', () => {
    const p = pol('allowlist', ['pypi.org:443', '*.pythonhosted.org']);
    expect(go(p, 'pypi.org', 443, ['151.101.0.223'])).toMatchObject({ allowed: true, address: '151.101.0.223', rule: 'pypi.org:443' });
    expect(go(p, 'pypi.org', 80, ['151.101.0.223'])).toMatchObject({ allowed: false });
    expect(go(p, 'files.pythonhosted.org', 443, ['151.101.0.223'])).toMatchObject({ allowed: true });
    expect(go(p, 'pythonhosted.org', 443, ['151.101.0.223'])).toMatchObject({ allowed: false });
    expect(go(p, 'example.com', 443, ['93.184.216.34'])).toMatchObject({ allowed: false, reason: expect.stringMatching(/not in this sandbox's allowlist/) });
  });

  it("a literal address is never allowed by a domain rule (the domain's own address included)", () => {
    const p = pol('allowlist', ['pypi.org']);
    expect(go(p, '151.101.0.223', 443, ['151.101.0.223'])).toMatchObject({ allowed: false });
    expect(go(pol('allowlist', ['151.101.0.0/16']), '151.101.0.223', 443, ['151.101.0.223'])).toMatchObject({ allowed: true });
  });

  it('deny wins over an allow wildcard and over public', () => {
    expect(go(pol('allowlist', ['*.example.com'], ['secret.example.com']), 'secret.example.com', 443, ['93.184.216.34'])).toMatchObject({ allowed: false, rule: 'secret.example.com' });
    expect(go(pol('public', [], ['93.184.216.0/24']), 'example.com', 443, ['93.184.216.34'])).toMatchObject({ allowed: false, rule: '93.184.216.0/24' });
    expect(go(pol('public', [], ['*.example.com:443']), 'a.example.com', 80, ['93.184.216.34'])).toMatchObject({ allowed: true });
  });

  it('a name with any refused address is refused (no picking the good one)', () => {
    expect(go(pol('public'), 'mixed.example', 443, ['93.184.216.34', '127.0.0.1'])).toMatchObject({ allowed: false, reason: expect.stringMatching(/loopback/) });
  });

  it('private networks only through a CIDR allow rule, even on public or for an allowed name', () => {
    expect(go(pol('public'), 'nas.lan', 443, ['192.168.1.5'])).toMatchObject({ allowed: false, reason: expect.stringMatching(/private network/) });
    expect(go(pol('allowlist', ['nas.lan']), 'nas.lan', 443, ['192.168.1.5'])).toMatchObject({ allowed: false });
    expect(go(pol('public', ['192.168.1.0/24']), 'nas.lan', 443, ['192.168.1.5'])).toMatchObject({ allowed: true });
    expect(go(pol('allowlist', ['192.168.1.0/24']), 'nas.lan', 443, ['::ffff:192.168.1.5'])).toMatchObject({ allowed: true });
    // No rule opens loopback, not even one that names it.
    expect(go(pol('public', ['127.0.0.0/8', '0.0.0.0/0']), 'localhost', 80, ['127.0.0.1'])).toMatchObject({ allowed: false });
  });
});

describe('the broker default', () => {
  it('resolves a sandbox request against the defaults, and refuses more than --egress-max', () => {
    const n = new Networks({ ...DEFAULT_NETWORK, allowlist: ['registry.npmjs.org:443'], max: 'allowlist' });
    expect(n.resolve(undefined)).toMatchObject({ mode: 'allowlist', allow: [expect.objectContaining({ text: 'registry.npmjs.org:443' })] });
    expect(n.resolve('none')).toMatchObject({ mode: 'none' });
    expect(n.resolve({ allow: ['github.com'] }).allow.map((r) => r.text)).toEqual(['registry.npmjs.org:443', 'github.com']);
    expect(n.resolve({ base: 'none', allow: ['github.com'] })).toMatchObject({ mode: 'allowlist', allow: [expect.objectContaining({ text: 'github.com' })] });
    expect(() => n.resolve('public')).toThrow(/at most allowlist/);
    expect(() => n.resolve({ allow: ['not a rule'] })).toThrow(expect.objectContaining({ code: 'bad_request' }));
  });

  it("reads the host's npm, pip and apt configuration", () => {
    const home = mkdtempSync(join(tmpdir(), 'hutch-reg-'));
    const apt = join(home, 'apt');
    mkdirSync(join(apt, 'sources.list.d'), { recursive: true });
    writeFileSync(join(home, '.npmrc'), 'fund=false\nregistry = https://npm.mirror.example/\n');
    mkdirSync(join(home, '.config', 'pip'), { recursive: true });
    writeFileSync(join(home, '.config', 'pip', 'pip.conf'), '[global]\nindex-url = https://pip.mirror.example/simple\nextra-index-url = file:///opt/wheels https://extra.example:8443/simple\n');
    writeFileSync(join(apt, 'sources.list'), 'deb [arch=amd64] http://deb.mirror.example/debian bookworm main\n# deb http://commented.example/ x\n');
    writeFileSync(join(apt, 'sources.list.d', 'x.sources'), 'Types: deb\nURIs: https://apt.example/repo\nSuites: x\n');
    const r = hostRegistries({ env: {}, home, aptRoot: apt, guestApt: ['http://deb.debian.org/debian'] });
    expect(r.npm).toBe('https://npm.mirror.example/');
    expect(r.pip).toEqual({ index: 'https://pip.mirror.example/simple', extra: ['file:///opt/wheels', 'https://extra.example:8443/simple'] });
    expect(r.rules.sort()).toEqual(['apt.example:443', 'deb.debian.org:80', 'deb.mirror.example:80', 'extra.example:8443', 'npm.mirror.example:443', 'pip.mirror.example:443'].sort());
    // Nothing configured: npm's and pip's public registries (pypi's file host too).
    expect(hostRegistries({ env: {}, home: mkdtempSync(join(tmpdir(), 'hutch-reg-')), aptRoot: join(home, 'none') }).rules).toEqual(['registry.npmjs.org:443', 'pypi.org:443', 'files.pythonhosted.org:443']);
    expect(aptUrls('deb-src http://a.example/ x\ndeb cdrom:[x]/ y\n')).toEqual(['http://a.example/']);
  });
});
