/**
 * A sandbox's network end to end in real microVMs: package managers in the guest reach the
 * registries the host uses (the shipped default), everything else is refused with an error
 * the agent can read, `network: 'none'` reaches nothing, and servers the sandbox starts are
 * reachable through the broker (HTTP and WebSocket), with the harness's token, waking a
 * released sandbox. The npm registry and Debian's mirror are real (this machine reaches them).
 */
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { Hutch, Sandbox } from '../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from './helpers/broker.ts';

/** A WebSocket echo server in Python's standard library (the guest has no websocket package). */
const WS_ECHO = String.raw`
import base64, hashlib, socket, struct, threading
def serve(c):
    req = b''
    while b'\r\n\r\n' not in req:
        req += c.recv(4096)
    key = [l.split(b':', 1)[1].strip() for l in req.split(b'\r\n') if l.lower().startswith(b'sec-websocket-key')][0]
    acc = base64.b64encode(hashlib.sha1(key + b'258EAFA5-E914-47DA-95CA-C5AB0DC85B11').digest())
    c.sendall(b'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: ' + acc + b'\r\n\r\n')
    f = c.makefile('rb')
    while True:
        h = f.read(2)
        if len(h) < 2: return
        op, n = h[0] & 15, h[1] & 127
        if n == 126: n = struct.unpack('>H', f.read(2))[0]
        elif n == 127: n = struct.unpack('>Q', f.read(8))[0]
        mask = f.read(4)
        data = bytes(b ^ mask[i % 4] for i, b in enumerate(f.read(n)))
        if op == 8: return
        reply = ('echo:' + data.decode()).encode()
        c.sendall(bytes([0x81, len(reply)]) + reply)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', 8765)); s.listen()
while True:
    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
`;

describe('sandbox networks in real VMs', { tags: ['vm'] }, () => {
  let b: TestBroker;
  let hutch: Hutch;
  let sb: Sandbox;

  beforeAll(async () => {
    b = await startBroker({ backend: 'qemu', idleMs: 600_000, tokens: { other: 'other-principal-token-0123456789' } });
    hutch = await b.connect();
    sb = await hutch.create({ workspace: { files: { 'ws_echo.py': WS_ECHO, 'hello.txt': 'hello from the sandbox\n', 'package.json': '{"name":"t","version":"1.0.0"}\n' } } });
  }, 600_000);
  afterAll(async () => {
    await hutch?.close();
    await b?.stop();
  }, 300_000);

  it("the default policy reaches the host's registries: npm install lands in the host workspace", async () => {
    expect(sb.info.network?.mode).toBe('allowlist');
    expect(sb.info.network?.allow).toContain('registry.npmjs.org:443');
    const r = await sb.run('npm install --no-audit --no-fund is-number@7.0.0 2>&1', { timeoutMs: 300_000 });
    expect(r.exitCode, r.stdout).toBe(0);
    expect(r.route).toBe('vm');
    expect(r.network?.connections).toBeGreaterThan(0);
    expect(r.network?.bytesIn).toBeGreaterThan(1000);
    const pkg = join(b.dataDir, 'sessions', sb.id, 'workspace', 'node_modules', 'is-number', 'package.json');
    expect(existsSync(pkg)).toBe(true);
    expect(JSON.parse(readFileSync(pkg, 'utf8')).version).toBe('7.0.0');
  }, 600_000);

  it('apt-get download of a small package reaches the guest image\'s Debian mirror', async () => {
    const apt = '-o Dir::State::Lists=/tmp/apt/lists -o Dir::Cache=/tmp/apt/cache -o Debug::NoLocking=1 -o APT::Sandbox::User=tenant';
    const r = await sb.run(`mkdir -p /tmp/apt/lists/partial /tmp/apt/cache/archives/partial && apt-get -q ${apt} update >/dev/null 2>&1; apt-get -q ${apt} download hello 2>&1 && ls hello_*.deb`, { timeoutMs: 600_000 });
    expect(r.exitCode, r.stdout).toBe(0);
    expect(r.stdout).toMatch(/hello_.*_amd64\.deb/);
    expect(existsSync(join(b.dataDir, 'sessions', sb.id, 'workspace', r.stdout.trim().split('\n').at(-1)!))).toBe(true);
  }, 900_000);

  it('anything else is refused with an error the agent can read, and shows in the telemetry', async () => {
    const plain = await sb.run('curl -sS http://example.com/ ; echo; curl -sS https://example.com/ 2>&1; echo exit=$?', { timeoutMs: 120_000 });
    expect(plain.stdout).toMatch(/hutch egress proxy: example\.com:80 is not in this sandbox's allowlist/);
    expect(plain.stdout).toMatch(/403/);
    expect(plain.stdout).not.toMatch(/exit=0/);
    expect(plain.network?.refused).toBe(2);
    const events: unknown[] = [];
    await hutch.telemetry({ session: sb.id, count: 1, onSample: (e) => events.push(...(e.sessions[0]?.events ?? [])) });
    expect(events).toContainEqual(expect.objectContaining({ kind: 'network.refused', host: 'example.com', port: 443 }));
  }, 300_000);

  it("network: 'none' reaches nothing, and a live sandbox's policy can change", async () => {
    const closed = await hutch.create({ network: 'none', workspace: { files: { 'package.json': '{"name":"t","version":"1.0.0"}\n' } } });
    try {
      expect(closed.info.network?.mode).toBe('none');
      const npm = await closed.run('npm install --no-audit --no-fund --fetch-retries=0 is-number@7.0.0 2>&1', { timeoutMs: 300_000 });
      expect(npm.exitCode).not.toBe(0);
      const curl = await closed.run('curl -sS http://deb.debian.org/debian/ 2>&1', { timeoutMs: 120_000 });
      expect(curl.stdout).toMatch(/no network access \(network: none\)/);
      // Opened while it lives: the next connection uses the new policy.
      await closed.network.set({ base: 'none', allow: ['deb.debian.org:80'] });
      const again = await closed.run('curl -sS -o /dev/null -w "%{http_code}" http://deb.debian.org/debian/dists/bookworm/Release', { timeoutMs: 120_000 });
      expect(again.stdout).toBe('200');
    } finally {
      await closed.close();
    }
  }, 900_000);

  it('a server the sandbox starts is reachable through the broker, HTTP and WebSocket, only with a token', async () => {
    const start = await sb.run('(setsid python3 -m http.server 8000 --bind 127.0.0.1 >/tmp/http.log 2>&1 &) ; (setsid python3 ws_echo.py >/tmp/ws.log 2>&1 &) ; for i in $(seq 1 100); do (echo > /dev/tcp/127.0.0.1/8000) 2>/dev/null && (echo > /dev/tcp/127.0.0.1/8765) 2>/dev/null && exit 0; sleep 0.3; done; exit 1', { timeoutMs: 120_000 });
    expect(start.exitCode, start.stderr).toBe(0);
    const res = await sb.ports.fetch(8000, '/hello.txt');
    expect(res.status).toBe(200);
    expect(await res.text()).toBe('hello from the sandbox\n');
    const ws = await sb.ports.connect(8765);
    const reply = await new Promise<string>((resolve) => {
      ws.once('message', (d) => resolve(String(d)));
      ws.send('ping');
    });
    ws.close();
    expect(reply).toBe('echo:ping');
    // No token: 401; another principal's token: 404, as for a sandbox that does not exist.
    expect((await fetch(sb.ports.url(8000, '/hello.txt'))).status).toBe(401);
    expect((await fetch(sb.ports.url(8000, '/hello.txt'), { headers: { 'x-hutch-token': 'other-principal-token-0123456789' } })).status).toBe(404);
    // Nothing listening: a clear 502.
    const none = await sb.ports.fetch(8999);
    expect(none.status).toBe(502);
    expect(await none.text()).toMatch(/connection_refused: nothing listens on port 8999/);
  }, 600_000);

  it('a request to a released sandbox wakes it, its server still running', async () => {
    await sb.hint('idle');
    // The release runs in the background: wait until the VM is snapshotted (none) or reclaimed (its server keeps it).
    const state = async () => {
      let vm = 'live';
      await hutch.telemetry({ session: sb.id, count: 1, onSample: (e) => (vm = e.sessions[0]?.vm ?? 'live') });
      return vm;
    };
    for (let i = 0; i < 600 && (await state()) === 'live'; i++) await new Promise((r) => setTimeout(r, 500));
    expect(await state()).not.toBe('live');
    const res = await sb.ports.fetch(8000, '/hello.txt');
    expect(res.status).toBe(200);
    expect(await res.text()).toBe('hello from the sandbox\n');
  }, 600_000);
});
