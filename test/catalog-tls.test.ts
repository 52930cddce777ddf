/**
 * rediss://: the catalog over TLS against a real redis-server with a certificate from a CA
 * made here (openssl). The server's certificate is verified, and so is its name; there is
 * no way to turn either off, so every wrong setup must fail typed, not connect.
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { parseRedisUrl, RespClient } from '../host-broker/src/catalog/resp.ts';
import { failure } from './helpers/cluster.ts';

function skipReason(): string | undefined {
  const r = spawnSync('redis-server', ['--version'], { encoding: 'utf8' });
  if (r.error || r.status !== 0) return 'redis-server is not installed (./hutch setup installs it: apt-get install redis-server)';
  const o = spawnSync('openssl', ['version'], { encoding: 'utf8' });
  if (o.error || o.status !== 0) return 'openssl (the CLI) is not installed: the test makes its certificates with it';
  return undefined;
}
const skip = skipReason();
if (skip) console.log(`SKIPPING test/catalog-tls.test.ts: ${skip}`);

async function freePort(): Promise<number> {
  const s = createServer();
  await new Promise<void>((r) => s.listen(0, '127.0.0.1', r));
  const port = (s.address() as { port: number }).port;
  await new Promise((r) => s.close(r));
  return port;
}

function openssl(dir: string, ...args: string[]): void {
  const r = spawnSync('openssl', args, { cwd: dir, encoding: 'utf8' });
  if (r.status !== 0) throw new Error(`openssl ${args.join(' ')}: ${r.stderr}`);
}

/** A CA, and a server certificate it signed for `names` (subjectAltName entries). */
function makeCerts(dir: string, prefix: string, names: string): void {
  openssl(dir, 'req', '-x509', '-newkey', 'rsa:2048', '-nodes', '-keyout', `${prefix}ca.key`, '-out', `${prefix}ca.pem`, '-days', '2', '-subj', `/CN=${prefix}test CA`);
  openssl(dir, 'req', '-newkey', 'rsa:2048', '-nodes', '-keyout', `${prefix}server.key`, '-out', `${prefix}server.csr`, '-subj', '/CN=redis');
  writeFileSync(join(dir, `${prefix}ext.cnf`), `subjectAltName=${names}\n`);
  openssl(dir, 'x509', '-req', '-in', `${prefix}server.csr`, '-CA', `${prefix}ca.pem`, '-CAkey', `${prefix}ca.key`, '-CAcreateserial', '-out', `${prefix}server.pem`, '-days', '2', '-extfile', `${prefix}ext.cnf`);
}

describe.skipIf(skip !== undefined)('the catalog over TLS (rediss://)', () => {
  const dir = mkdtempSync(join(tmpdir(), 'hutch-catalog-tls-'));
  let redis: ChildProcess | undefined;
  let tlsPort = 0;
  let plainPort = 0;
  let ca: Buffer;
  let otherCa: Buffer;

  beforeAll(async () => {
    // The server's certificate names localhost only: 127.0.0.1 reaches it under a name it does not carry.
    makeCerts(dir, '', 'DNS:localhost');
    makeCerts(dir, 'other-', 'DNS:localhost');
    ca = readFileSync(join(dir, 'ca.pem'));
    otherCa = readFileSync(join(dir, 'other-ca.pem'));
    tlsPort = await freePort();
    plainPort = await freePort();
    redis = spawn(
      'redis-server',
      ['--port', String(plainPort), '--tls-port', String(tlsPort), '--bind', '127.0.0.1 -::1', '--tls-cert-file', 'server.pem', '--tls-key-file', 'server.key', '--tls-ca-cert-file', 'ca.pem', '--tls-auth-clients', 'no', '--save', '', '--appendonly', 'no', '--dir', dir],
      { cwd: dir, stdio: 'ignore' },
    );
    // Up once the plain port answers (both listeners open together).
    const probe = new RespClient({ host: '127.0.0.1', port: plainPort }, 500);
    for (let i = 0; ; i++) {
      try {
        await probe.command('PING');
        break;
      } catch (err) {
        if (i > 100) throw err;
        await new Promise((r) => setTimeout(r, 100));
      }
    }
    probe.close();
  }, 60_000);
  afterAll(() => {
    redis?.kill('SIGKILL');
    rmSync(dir, { recursive: true, force: true });
  });

  it('parses rediss:// as TLS, and still refuses other schemes', () => {
    expect(parseRedisUrl('rediss://:pw@cache.example:6380/1')).toEqual({ host: 'cache.example', port: 6380, password: 'pw', db: 1, tls: true });
    expect(parseRedisUrl('redis://cache.example').tls).toBeUndefined();
    expect(() => parseRedisUrl('https://cache.example')).toThrow(/rediss:\/\//);
  });

  it('talks to a TLS Redis whose certificate the given CA signed, for the name in the address', async () => {
    const c = new RespClient(parseRedisUrl(`rediss://localhost:${tlsPort}`), 5000, ca);
    expect(await c.command('SET', 'k', 'over tls')).toBe('OK');
    expect(await c.command('GET', 'k')).toBe('over tls');
    c.close();
  });

  it('refuses a server certificate no trusted CA signed, typed and without sending a command', async () => {
    // The system's CAs (no CA given) and a different private CA: neither signed it.
    for (const trust of [undefined, otherCa]) {
      const c = new RespClient(parseRedisUrl(`rediss://localhost:${tlsPort}`), 5000, trust);
      const e = await failure<{ code?: string; message: string }>(c.command('SET', 'stolen', 'x'));
      expect(e.code).toBe('unavailable');
      expect(e.message).toMatch(/rediss:\/\/localhost:\d+ unreachable: .*(certificate|self.signed)/i);
      c.close();
    }
    const check = new RespClient(parseRedisUrl(`rediss://localhost:${tlsPort}`), 5000, ca);
    expect(await check.command('EXISTS', 'stolen')).toBe(0);
    check.close();
  });

  it('refuses a certificate for another name than the address names (the same server, reached as 127.0.0.1)', async () => {
    const wrongName = new RespClient(parseRedisUrl(`rediss://127.0.0.1:${tlsPort}`), 5000, ca);
    const e = await failure<{ code?: string; message: string }>(wrongName.command('PING'));
    expect(e.code).toBe('unavailable');
    expect(e.message).toMatch(/ERR_TLS_CERT_ALTNAME_INVALID|not in the cert's list|altnames/i);
    wrongName.close();
  });

  it('a TLS client at a plain port, and a plain client at the TLS port, fail in bounded time', async () => {
    const tlsAtPlain = new RespClient(parseRedisUrl(`rediss://localhost:${plainPort}`), 2000, ca);
    expect((await failure<{ code?: string }>(tlsAtPlain.command('PING'))).code).toBe('unavailable');
    tlsAtPlain.close();
    const plainAtTls = new RespClient(parseRedisUrl(`redis://127.0.0.1:${tlsPort}`), 2000);
    expect((await failure<{ code?: string }>(plainAtTls.command('PING'))).code).toBe('unavailable');
    plainAtTls.close();
  });
});
