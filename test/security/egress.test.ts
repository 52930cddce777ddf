/**
 * What a tenant can reach through its sandbox's network. The tenant side is a real agent
 * process (the guest's code) serving its proxy port; "tenant processes" are this test's
 * connections to that port, exactly what curl or pip in the guest make. The broker side is
 * the real AgentClient and SandboxNetwork. Destinations on this host (its loopback, its
 * addresses, the broker's own port) are real servers that count every hit.
 *
 * The name resolver and the connect are swapped only where a test needs a name to answer
 * differently on a second lookup (DNS rebinding): that fake stands for a DNS server we do not
 * run, and is named so.
 */
import { createServer as httpServer, type Server } from 'node:http';
import { connect, createServer, type Socket } from 'node:net';
import { networkInterfaces } from 'node:os';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startAgent, type AgentProcess } from '../helpers/agent-process.ts';
import { DEFAULT_NETWORK, Networks } from '../../host-broker/src/network/networks.ts';
import type { SandboxNetwork } from '../../host-broker/src/network/sandbox-network.ts';

async function freePort(): Promise<number> {
  const s = createServer();
  await new Promise<void>((r) => s.listen(0, '127.0.0.1', r));
  const port = (s.address() as { port: number }).port;
  await new Promise((r) => s.close(r));
  return port;
}

/** Writes `raw` to the guest's proxy port as a tenant process would; all it answers until it closes. */
function ask(port: number, raw: string, timeoutMs = 20_000): Promise<string> {
  return new Promise((resolve) => {
    const s = connect({ host: '127.0.0.1', port });
    let out = '';
    s.on('data', (d) => (out += d.toString('latin1')));
    s.on('close', () => resolve(out));
    s.on('error', () => resolve(out));
    s.setTimeout(timeoutMs, () => (s.destroy(), resolve(out)));
    s.write(raw);
  });
}

interface Guest {
  agent: AgentProcess;
  proxyPort: number;
  network: SandboxNetwork;
}

async function guest(networks: Networks, session: string, principal: string, spec?: Parameters<Networks['forSession']>[2]): Promise<Guest> {
  const proxyPort = await freePort();
  const agent = await startAgent({ args: ['--proxy-port', String(proxyPort)] });
  const network = networks.forSession(session, principal, spec);
  agent.client.network = network;
  return { agent, proxyPort, network };
}

describe('egress through the proxy: what a tenant cannot reach', () => {
  let hits = 0;
  let loopback: Server;
  let anyAddr: Server;
  let loopPort = 0;
  let anyPort = 0;
  let g: Guest;
  const hostAddresses = Object.values(networkInterfaces())
    .flat()
    .filter((i) => i && !i.internal)
    .map((i) => i!.address.split('%')[0]!);

  beforeAll(async () => {
    const serve = () => httpServer((_req, res) => (hits++, res.end('secret\n')));
    loopback = serve().listen(0, '127.0.0.1');
    anyAddr = serve().listen(0, '::');
    await Promise.all([loopback, anyAddr].map((s) => new Promise((r) => s.once('listening', r))));
    loopPort = (loopback.address() as { port: number }).port;
    anyPort = (anyAddr.address() as { port: number }).port;
    // The most open policy there is: public, and an allow rule naming everything.
    g = await guest(new Networks({ ...DEFAULT_NETWORK, mode: 'public' }), 's-open', 'alice', { base: 'public', allow: ['0.0.0.0/0', '::/0', 'localhost'] });
  });
  afterAll(async () => {
    await g.agent.stop();
    loopback.close();
    anyAddr.close();
  });

  it("never reaches loopback, this host's addresses, the broker's port, link-local or metadata: by name, literal, mapped, NAT64 or 6to4 form", async () => {
    const targets = [
      `127.0.0.1:${loopPort}`,
      `localhost:${loopPort}`,
      `8000-s-other.localhost:${anyPort}`,
      `[::1]:${anyPort}`,
      `[::ffff:127.0.0.1]:${loopPort}`,
      `[::ffff:7f00:1]:${loopPort}`,
      `[64:ff9b::7f00:1]:${loopPort}`,
      `[2002:7f00:1::1]:${loopPort}`,
      `[::127.0.0.1]:${loopPort}`,
      `2130706433:${loopPort}`,
      `0.0.0.0:${anyPort}`,
      `169.254.169.254:80`,
      `[fd00:ec2::254]:80`,
      `100.100.100.200:80`,
      `[64:ff9b::a9fe:a9fe]:80`,
      ...hostAddresses.map((a) => (a.includes(':') ? `[${a}]:${anyPort}` : `${a}:${anyPort}`)),
    ];
    for (const t of targets) {
      const viaConnect = await ask(g.proxyPort, `CONNECT ${t} HTTP/1.1\r\nHost: ${t}\r\n\r\n`);
      expect(viaConnect, `CONNECT ${t}`).toMatch(/^HTTP\/1\.1 (400|403|502) /);
      const viaGet = await ask(g.proxyPort, `GET http://${t}/ HTTP/1.1\r\nHost: ${t}\r\n\r\n`);
      expect(viaGet, `GET ${t}`).toMatch(/^HTTP\/1\.1 (400|403|502) /);
      expect(viaGet + viaConnect).not.toContain('secret');
    }
    expect(hits).toBe(0);
    // The refusal says why, for the agent to read.
    expect(await ask(g.proxyPort, `CONNECT 127.0.0.1:${loopPort} HTTP/1.1\r\n\r\n`)).toMatch(/403 Forbidden[^]*127\.0\.0\.1 is loopback/);
    expect(g.network.totals.refused).toBeGreaterThan(targets.length);
    expect(g.network.totals.connections).toBe(0);
  });

  it('never reaches a private network unless a CIDR rule names it', async () => {
    const closed = await guest(new Networks({ ...DEFAULT_NETWORK, mode: 'public' }), 's-lan', 'alice', { base: 'public', allow: ['*.corp.example'] });
    try {
      for (const t of ['10.0.0.1:80', '192.168.1.1:80', '[::ffff:a00:1]:80', '[fd12::1]:80', '172.16.5.4:80', '[64:ff9b::a00:1]:80']) {
        expect(await ask(closed.proxyPort, `CONNECT ${t} HTTP/1.1\r\n\r\n`), t).toMatch(/^HTTP\/1\.1 403 [^]*private network/);
      }
    } finally {
      await closed.agent.stop();
    }
  });

  it('connects to the address it checked: a name that rebinds to loopback after the check reaches nothing here', async () => {
    // A fake resolver (standing for a DNS server that rebinds): public first, loopback after.
    let lookups = 0;
    const dialled: string[] = [];
    const networks = new Networks({ ...DEFAULT_NETWORK, mode: 'public' });
    const r = await guest(networks, 's-rebind', 'alice', 'public');
    (r.network as unknown as { o: { proxy: unknown } }).o.proxy = {
      lookup: async () => (lookups++ === 0 ? ['93.184.216.34'] : ['127.0.0.1']),
      connect: (address: string, port: number) => {
        dialled.push(address);
        // The "internet" answers from a local server: only the address asked for matters here.
        return connect({ host: '127.0.0.1', port: address === '93.184.216.34' ? anyPort : 9 });
      },
    };
    try {
      const out = await ask(r.proxyPort, `GET http://rebind.example/ HTTP/1.1\r\nHost: rebind.example\r\n\r\n`);
      expect(out).toMatch(/^HTTP\/1\.1 200/);
      expect(lookups).toBe(1);
      expect(dialled).toEqual(['93.184.216.34']);
      // A name that answers loopback among public addresses is refused whole.
      (r.network as unknown as { o: { proxy: unknown } }).o.proxy = { lookup: async () => ['93.184.216.34', '127.0.0.1'], connect: () => { throw new Error('must not connect'); } };
      expect(await ask(r.proxyPort, `CONNECT mixed.example:443 HTTP/1.1\r\n\r\n`)).toMatch(/^HTTP\/1\.1 403 [^]*loopback/);
    } finally {
      await r.agent.stop();
    }
  });

  it('a deny rule wins over an allow wildcard; a policy change applies to the next connection', async () => {
    const networks = new Networks({ ...DEFAULT_NETWORK });
    const d = await guest(networks, 's-deny', 'alice', { base: 'none', allow: ['*.debian.org'], deny: ['security.debian.org'] });
    try {
      expect(await ask(d.proxyPort, 'CONNECT security.debian.org:443 HTTP/1.1\r\n\r\n')).toMatch(/^HTTP\/1\.1 403 [^]*denied by the rule "security\.debian\.org"/);
      expect(await ask(d.proxyPort, 'CONNECT example.com:443 HTTP/1.1\r\n\r\n')).toMatch(/^HTTP\/1\.1 403 [^]*not in this sandbox's allowlist/);
      d.network.setPolicy(networks.resolve('none'));
      expect(await ask(d.proxyPort, 'CONNECT deb.debian.org:443 HTTP/1.1\r\n\r\n')).toMatch(/^HTTP\/1\.1 403 [^]*no network access/);
    } finally {
      await d.agent.stop();
    }
  });

  it('cannot exhaust the broker: connections per sandbox and per principal are bounded, and answered at once past it', async () => {
    const networks = new Networks({ ...DEFAULT_NETWORK, mode: 'public', limits: { maxConnections: 3, bytesPerSecond: 1e9 }, perPrincipalConnections: 5 });
    const a = await guest(networks, 's-a', 'mallory', 'public');
    const b = await guest(networks, 's-b', 'mallory', 'public');
    const c = await guest(networks, 's-c', 'carol', 'public');
    const held: Socket[] = [];
    // A connection that never finishes its request head holds a slot (until the head timeout).
    const hold = (port: number) =>
      new Promise<void>((resolve) => {
        const s = connect({ host: '127.0.0.1', port }, () => {
          s.write('CONNECT example.com:443 HTTP/1.1\r\n');
          setTimeout(resolve, 300);
        });
        s.on('error', () => undefined);
        held.push(s);
      });
    try {
      for (let i = 0; i < 3; i++) await hold(a.proxyPort);
      expect(a.network.openConnections).toBe(3);
      expect(await ask(a.proxyPort, 'CONNECT example.com:443 HTTP/1.1\r\n\r\n')).toMatch(/^HTTP\/1\.1 429 [^]*already has 3 connections/);
      for (let i = 0; i < 2; i++) await hold(b.proxyPort);
      expect(await ask(b.proxyPort, 'CONNECT example.com:443 HTTP/1.1\r\n\r\n')).toMatch(/^HTTP\/1\.1 429 [^]*principal's sandboxes already hold 5/);
      // Another principal is not affected.
      await hold(c.proxyPort);
      expect(c.network.openConnections).toBe(1);
    } finally {
      for (const s of held) s.destroy();
      await Promise.all([a, b, c].map((x) => x.agent.stop()));
    }
  });

  it('a sandbox that is not serving a session refuses, and a garbage request is a 400', async () => {
    const proxyPort = await freePort();
    const agent = await startAgent({ args: ['--proxy-port', String(proxyPort)] });
    try {
      expect(await ask(proxyPort, 'CONNECT example.com:443 HTTP/1.1\r\n\r\n')).toMatch(/^HTTP\/1\.1 503 [^]*not serving a session/);
      agent.client.network = new Networks({ ...DEFAULT_NETWORK }).forSession('s-x', 'alice', 'public');
      expect(await ask(proxyPort, '\x16\x03\x01\x02\x00garbage\r\n\r\n')).toMatch(/^HTTP\/1\.1 400 /);
      expect(await ask(proxyPort, `GET http://example.com/ HTTP/1.1\r\nX: ${'a'.repeat(40_000)}\r\n\r\n`)).toMatch(/^HTTP\/1\.1 400 [^]*over 32768 bytes/);
    } finally {
      await agent.stop();
    }
  });
});
