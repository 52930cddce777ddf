/**
 * The template build VM's egress proxy, on the host, with real sockets: what a hostile
 * --run step would ask it for (the host's loopback, the host's own addresses, cloud
 * metadata, names that resolve to them, malformed and oversized heads, a connection
 * flood), and that an ordinary download through it works.
 */
import { lookup } from 'node:dns/promises';
import { connect, type Server } from 'node:net';
import { createServer as createHttpServer } from 'node:http';
import { mkdtempSync, rmSync } from 'node:fs';
import { networkInterfaces, tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { parseCidr, parseProxyRequest, startEgressProxy, type EgressProxy } from '../host-broker/src/templates/egress-proxy.ts';

describe('--egress-allow ranges', () => {
  it.each(['10.0.0.0/33', '10.0.0.0/8/1', 'example.org/8', '', '10.0.0/8', '::/129', '10.0.0.0/-1', '10.0.0.0/ 8'])('parseCidr refuses %j', (c) => {
    expect(() => parseCidr(c)).toThrow(/--egress-allow/);
  });
  it('parseCidr takes a bare address as one host', () => {
    expect(parseCidr('192.168.7.9')).toMatchObject({ family: 'ipv4', prefix: 32 });
  });
});

describe('parseProxyRequest', () => {
  it('CONNECT host:port and [v6]:port', () => {
    expect(parseProxyRequest('CONNECT deb.debian.org:443 HTTP/1.1\r\nHost: x\r\n\r\n')).toEqual({ host: 'deb.debian.org', port: 443 });
    expect(parseProxyRequest('CONNECT [2001:db8::1]:8443 HTTP/1.1\r\n\r\n')).toEqual({ host: '2001:db8::1', port: 8443 });
  });
  it('an absolute http URL becomes an origin-form request that closes, without proxy headers', () => {
    const t = parseProxyRequest('GET http://example.org:8080/a/b?c=d HTTP/1.1\r\nHost: example.org\r\nProxy-Connection: keep-alive\r\nProxy-Authorization: Basic eA==\r\nConnection: keep-alive\r\nUser-Agent: t\r\n\r\n');
    expect(t.host).toBe('example.org');
    expect(t.port).toBe(8080);
    expect(t.head?.toString()).toBe('GET /a/b?c=d HTTP/1.1\r\nHost: example.org\r\nUser-Agent: t\r\nConnection: close\r\n\r\n');
  });
  it.each([
    ['garbage\r\n\r\n', /not an HTTP/],
    ['GET /relative HTTP/1.1\r\n\r\n', /absolute http/],
    ['GET https://example.org/ HTTP/1.1\r\n\r\n', /CONNECT for https/],
    ['GET http://u:p@example.org/ HTTP/1.1\r\n\r\n', /credentials/],
    ['CONNECT example.org HTTP/1.1\r\n\r\n', /host:port/],
    ['CONNECT example.org:0 HTTP/1.1\r\n\r\n', /out of range/],
    ['CONNECT example.org:70000 HTTP/1.1\r\n\r\n', /out of range/],
  ])('refuses %j', (head, why) => {
    expect(() => parseProxyRequest(head)).toThrow(why);
  });
});

describe('the proxy, live', () => {
  let dir: string;
  let proxy: EgressProxy;
  const lines: string[] = [];
  let hits = 0;
  let loopbackServer: Server;
  let anyServer: Server;
  let loopPort = 0;
  let anyPort = 0;
  const hostAddress = Object.values(networkInterfaces()).flat().find((i) => i && i.family === 'IPv4' && !i.internal)?.address;

  beforeAll(async () => {
    dir = mkdtempSync(join(tmpdir(), 'hutch-egress-test-'));
    // Where a network reaches Debian through a mirror on its LAN, that is what --egress-allow is for.
    const mirror = await lookup('deb.debian.org', { all: true }).then((r) => r.map((x) => x.address), () => []);
    proxy = await startEgressProxy({ socketPath: join(dir, 'p.sock'), allow: mirror, log: (l) => lines.push(l), maxConnections: 4, headTimeoutMs: 1_000 });
    const serve = () => createHttpServer((_req, res) => (hits++, res.end('secret\n')));
    loopbackServer = serve().listen(0, '127.0.0.1');
    anyServer = serve().listen(0, '0.0.0.0');
    await Promise.all([loopbackServer, anyServer].map((s) => new Promise((r) => s.once('listening', r))));
    loopPort = (loopbackServer.address() as { port: number }).port;
    anyPort = (anyServer.address() as { port: number }).port;
  });
  afterAll(async () => {
    await proxy.close();
    loopbackServer.close();
    anyServer.close();
    rmSync(dir, { recursive: true, force: true });
  });

  /** Sends raw bytes to the proxy and returns all it answers until it closes. */
  function ask(raw: string, timeoutMs = 20_000): Promise<string> {
    return new Promise((resolve, reject) => {
      const s = connect(proxy.socketPath);
      let out = '';
      s.on('data', (d) => (out += d.toString('latin1')));
      s.on('close', () => resolve(out));
      s.on('error', reject);
      s.setTimeout(timeoutMs, () => (s.destroy(), resolve(out)));
      s.write(raw);
    });
  }

  it("never reaches this host's loopback, own addresses or link-local, by address or by name", async () => {
    const attempts = [
      `GET http://127.0.0.1:${loopPort}/ HTTP/1.1\r\nHost: x\r\n\r\n`,
      `CONNECT 127.0.0.1:${loopPort} HTTP/1.1\r\n\r\n`,
      `CONNECT localhost:${loopPort} HTTP/1.1\r\n\r\n`,
      `GET http://[::ffff:7f00:1]:${loopPort}/ HTTP/1.1\r\n\r\n`,
      `GET http://2130706433:${loopPort}/ HTTP/1.1\r\n\r\n`,
      `GET http://169.254.169.254/latest/meta-data/ HTTP/1.1\r\n\r\n`,
      `CONNECT 0.0.0.0:${anyPort} HTTP/1.1\r\n\r\n`,
      ...(hostAddress ? [`GET http://${hostAddress}:${anyPort}/ HTTP/1.1\r\n\r\n`, `CONNECT ${hostAddress}:${anyPort} HTTP/1.1\r\n\r\n`] : []),
    ];
    for (const a of attempts) {
      const out = await ask(a);
      expect(out, a).toMatch(/^HTTP\/1\.1 (403|502) /);
      expect(out, a).not.toContain('secret');
    }
    expect(hits).toBe(0);
    expect(lines.some((l) => /refused: 127\.0\.0\.1 is loopback/.test(l))).toBe(true);
  });

  it('refuses private networks by address, by mapped form and by name, unless a range is allowed', async () => {
    for (const a of ['CONNECT 10.0.0.1:80 HTTP/1.1\r\n\r\n', 'GET http://[::ffff:a00:1]/ HTTP/1.1\r\n\r\n', 'GET http://192.168.0.1/ HTTP/1.1\r\n\r\n']) {
      expect(await ask(a), a).toMatch(/^HTTP\/1\.1 403 [^]*private network/);
    }
    const open = await startEgressProxy({ socketPath: join(dir, 'lan.sock'), allow: ['10.0.0.0/8'], log: () => undefined });
    try {
      // Allowed: the proxy tries to connect (whatever the LAN answers), it does not refuse.
      const out = await new Promise<string>((resolve) => {
        const s = connect(open.socketPath);
        let got = '';
        s.on('data', (d) => (got += d.toString('latin1')));
        s.on('close', () => resolve(got));
        s.on('error', () => resolve(got));
        s.setTimeout(3_000, () => (s.destroy(), resolve(got)));
        s.write('CONNECT 10.255.255.1:9 HTTP/1.1\r\n\r\n');
      });
      expect(out).not.toMatch(/^HTTP\/1\.1 403/);
      expect(open.stats.refused).toBe(0);
    } finally {
      await open.close();
    }
    await expect(startEgressProxy({ socketPath: join(dir, 'bad.sock'), allow: ['10.0.0.0/99'], log: () => undefined })).rejects.toThrow(/--egress-allow/);
  });

  it('answers malformed, oversized and stalled heads with 400 and closes', async () => {
    expect(await ask('NONSENSE\r\n\r\n')).toMatch(/^HTTP\/1\.1 400 /);
    expect(await ask(`GET http://example.org/ HTTP/1.1\r\nX: ${'a'.repeat(40_000)}`)).toMatch(/^HTTP\/1\.1 400 .*\r\n\r\n.*over 32768 bytes/s);
    expect(await ask('GET http://example.org/ HTTP/1.1\r\n')).toMatch(/within 1 s/);
  });

  it('refuses connections over its limit with 503', async () => {
    const held = await Promise.all(
      [0, 1, 2, 3].map(
        () =>
          new Promise<ReturnType<typeof connect>>((r) => {
            const s = connect(proxy.socketPath, () => r(s));
            s.on('error', () => undefined);
          }),
      ),
    );
    try {
      expect(await ask('CONNECT example.org:443 HTTP/1.1\r\n\r\n')).toMatch(/^HTTP\/1\.1 503 .*more than 4 connections/s);
    } finally {
      for (const s of held) s.destroy();
    }
  });

  it('downloads through it: a plain GET and a CONNECT tunnel to a Debian mirror', async (ctx) => {
    const reachable = await lookup('deb.debian.org').then(() => true, () => false);
    if (!reachable) ctx.skip('deb.debian.org does not resolve here: no network to download from');
    await new Promise((r) => setTimeout(r, 1_200)); // the flood test's sockets are gone
    const got = await ask('GET http://deb.debian.org/debian/dists/bookworm/Release HTTP/1.1\r\nHost: deb.debian.org\r\nConnection: keep-alive\r\n\r\n', 60_000);
    expect(got).toMatch(/^HTTP\/1\.1 200 /);
    expect(got).toMatch(/\r\n\r\nOrigin: Debian\n/);
    // CONNECT: the tunnel is up (the TLS handshake itself is the client's business).
    const tunnel = await new Promise<string>((resolve, reject) => {
      const s = connect(proxy.socketPath);
      let out = '';
      s.on('data', (d) => {
        out += d.toString('latin1');
        if (out.includes('\r\n\r\n')) (s.destroy(), resolve(out));
      });
      s.on('error', reject);
      s.write('CONNECT deb.debian.org:443 HTTP/1.1\r\nHost: deb.debian.org:443\r\n\r\n');
    });
    expect(tunnel).toMatch(/^HTTP\/1\.1 200 Connection Established\r\n\r\n$/);
    expect(proxy.stats.allowed).toBeGreaterThanOrEqual(2);
  }, 120_000);
});
