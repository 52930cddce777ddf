/**
 * A template's source and its --run steps are untrusted: the host only reads the source as
 * bytes and everything is unpacked and run inside a throwaway microVM. What a hostile
 * tarball or step would try: entries with ../ and absolute names, a symlink pointing out of
 * the tree with a file written through it, a hard link to a host file, setuid files and
 * device nodes, steps writing the build VM's other disks, steps reaching for the host's
 * loopback or cloud metadata over the build network. None of it may reach the host.
 * And a template name is a file name under the data dir, never a path.
 */
import { createHash, randomBytes } from 'node:crypto';
import { execFileSync } from 'node:child_process';
import { existsSync, mkdtempSync, type Stats, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { lookup } from 'node:dns/promises';
import { createServer as createHttpServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { networkInterfaces, tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ensureStaticBusybox } from '../../build/busybox.ts';
import { ensureAgentLayer } from '../../rootfs/agent-layer.ts';
import { HutchError } from '../../guest-agent/src/protocol/errors.ts';
import { cacheDir } from '../../host-broker/src/backends/registry.ts';
import { buildTemplate } from '../../host-broker/src/templates/build.ts';
import { TemplateStore, validateTemplateName } from '../../host-broker/src/templates/store.ts';
import { startBroker } from '../helpers/broker.ts';
import { isVmUid, JAILED, qemuJailView, type QemuJailView } from '../helpers/qemu-jailed.ts';
import { qemuPids } from '../../host-broker/src/vm/qemu-driver.ts';
import { missingRootTools } from '../helpers/prerequisites.ts';

/** One ustar entry (written by hand: the point is entries no well-behaved tar would write). */
function tarEntry(e: { name: string; type?: '0' | '1' | '2' | '3' | '4' | '5'; mode?: number; link?: string; body?: Buffer; major?: number; minor?: number }): Buffer {
  const h = Buffer.alloc(512);
  const body = e.body ?? Buffer.alloc(0);
  const put = (off: number, len: number, s: string) => h.write(s, off, len, 'latin1');
  const oct = (off: number, len: number, n: number) => put(off, len, `${n.toString(8).padStart(len - 1, '0')}\0`);
  put(0, 100, e.name);
  oct(100, 8, e.mode ?? 0o644);
  oct(108, 8, 0);
  oct(116, 8, 0);
  oct(124, 12, body.length);
  oct(136, 12, 1704067200);
  put(148, 8, '        ');
  put(156, 1, e.type ?? '0');
  put(157, 100, e.link ?? '');
  put(257, 6, 'ustar\0');
  put(263, 2, '00');
  oct(329, 8, e.major ?? 0);
  oct(337, 8, e.minor ?? 0);
  let sum = 0;
  for (const byte of h) sum += byte;
  put(148, 8, `${sum.toString(8).padStart(6, '0')}\0 `);
  return Buffer.concat([h, body, Buffer.alloc((512 - (body.length % 512)) % 512)]);
}

/** What makes a root acceptable: busybox as /bin/sh and bash, glibc's loader. */
function qualifyingRoot(busybox: Buffer): Buffer[] {
  return [
    tarEntry({ name: './bin/', type: '5', mode: 0o755 }),
    tarEntry({ name: './bin/busybox', mode: 0o755, body: busybox }),
    tarEntry({ name: './bin/sh', type: '2', link: 'busybox' }),
    tarEntry({ name: './bin/bash', type: '2', link: 'busybox' }),
    tarEntry({ name: './lib64/', type: '5', mode: 0o755 }),
    tarEntry({ name: './lib64/ld-linux-x86-64.so.2', mode: 0o755, body: readFileSync('/lib64/ld-linux-x86-64.so.2') }),
  ];
}

const sha = (f: string) => createHash('sha256').update(readFileSync(f)).digest('hex');

const missing = missingRootTools(['qemu-system-x86_64', 'mke2fs'], 'template builds need root');
if (missing) console.warn(`SKIPPING the VM part of test/security/template-build.test.ts: ${missing}`);

describe('template names cannot leave the data dir', () => {
  const bad = ['../x', '/abs', 'a/b', 'a\0b', '', '.', '..', 'x..y', 'UPPER', '-lead', 'a'.repeat(64), 'sp ace', 'nl\n'];

  it('validateTemplateName refuses paths, NUL, dots and odd characters', () => {
    for (const name of bad) {
      let err: unknown;
      try {
        validateTemplateName(name);
      } catch (e) {
        err = e;
      }
      expect(err, JSON.stringify(name)).toBeInstanceOf(HutchError);
      expect((err as HutchError).code).toBe('bad_request');
    }
    expect(validateTemplateName('py3.13-ml_x')).toBe('py3.13-ml_x');
  });

  it('the store and the builder refuse them before touching the disk', async () => {
    const data = mkdtempSync(join(tmpdir(), 'hutch-tpl-names-'));
    try {
      const store = new TemplateStore(data);
      for (const name of ['../../etc/passwd', '/etc/passwd', 'x\0']) {
        expect(() => store.resolve(name)).toThrow(/invalid template name/);
        expect(() => store.setName(name, 'a'.repeat(24))).toThrow(/invalid template name/);
        await expect(buildTemplate({ name, from: '/nonexistent', dataDir: data, cacheDir: data })).rejects.toMatchObject({ code: 'bad_request' });
      }
      expect(readdirSync(data)).toEqual([]);
    } finally {
      rmSync(data, { recursive: true, force: true });
    }
  });

  it('--egress-allow takes address ranges only, and contradicts --offline, refused before touching the disk', async () => {
    const data = mkdtempSync(join(tmpdir(), 'hutch-tpl-egress-flags-'));
    try {
      for (const egressAllow of [['10.0.0.0/33'], ['evil.example/8'], ['10.0.0.0/8,127.0.0.1']]) {
        await expect(buildTemplate({ name: 'ok', from: '/nonexistent', run: ['true'], egressAllow, dataDir: data, cacheDir: data })).rejects.toMatchObject({ code: 'bad_request', message: expect.stringMatching(/--egress-allow/) });
      }
      await expect(buildTemplate({ name: 'ok', from: '/nonexistent', run: ['true'], network: false, egressAllow: ['10.0.0.0/8'], dataDir: data, cacheDir: data })).rejects.toMatchObject({ code: 'bad_request', message: expect.stringMatching(/contradict/) });
      expect(readdirSync(data)).toEqual([]);
    } finally {
      rmSync(data, { recursive: true, force: true });
    }
  });

  it('over the harness API, create({ template }) with a path is bad_request', async () => {
    const b = await startBroker();
    try {
      const hutch = await b.connect();
      for (const template of ['../x', '/abs', 'a\0b']) await expect(hutch.create({ template })).rejects.toMatchObject({ code: 'bad_request' });
      // A valid name on a backend without templates: told so, not silently the default.
      await expect(hutch.create({ template: 'valid-name' })).rejects.toMatchObject({ code: 'unavailable' });
    } finally {
      await b.stop();
    }
  });
});

describe.skipIf(missing !== undefined)('a hostile template source and --run steps stay in the build VM', { tags: ['vm'] }, () => {
  const tag = randomBytes(4).toString('hex');
  const hostPaths = ['escape', 'abs', 'via-symlink', 'step'].map((k) => `/tmp/hutch-${k}-${tag}`);
  let work: string;
  let data: string;
  let tarball: string;

  beforeAll(async () => {
    work = mkdtempSync(join(tmpdir(), 'hutch-tpl-hostile-'));
    data = join(work, 'data');
    const busybox = readFileSync(await ensureStaticBusybox());
    tarball = join(work, 'hostile.tar');
    writeFileSync(
      tarball,
      Buffer.concat([
        ...qualifyingRoot(busybox),
        tarEntry({ name: `../../../../../../tmp/hutch-escape-${tag}`, body: Buffer.from('escaped\n') }),
        tarEntry({ name: `/tmp/hutch-abs-${tag}`, body: Buffer.from('absolute\n') }),
        tarEntry({ name: './evil', type: '2', link: '/tmp' }),
        tarEntry({ name: `./evil/hutch-via-symlink-${tag}`, body: Buffer.from('through a symlink\n') }),
        tarEntry({ name: './hostname-link', type: '1', link: '/etc/hostname' }),
        tarEntry({ name: './bin/suid-root', mode: 0o4755, body: busybox.subarray(0, 4096) }),
        tarEntry({ name: './kmsg', type: '3', mode: 0o666, major: 1, minor: 11 }),
        tarEntry({ name: './disk', type: '4', mode: 0o666, major: 8, minor: 0 }),
        Buffer.alloc(1024),
      ]),
    );
  }, 300_000);

  afterAll(() => {
    rmSync(work, { recursive: true, force: true });
    for (const p of hostPaths) rmSync(p, { force: true });
  });

  /** Nothing of the build reached the host: no file outside, /etc/hostname untouched, no set-ID file or device node. */
  function expectNoTrace(before: { hostname: Stats; text: string; layer: string; layerSha: string }, id?: string): void {
    for (const p of hostPaths) expect(existsSync(p), p).toBe(false);
    expect(readFileSync('/etc/hostname', 'utf8')).toBe(before.text);
    const after = statSync('/etc/hostname');
    expect([after.ino, after.nlink, after.mtimeMs]).toEqual([before.hostname.ino, before.hostname.nlink, before.hostname.mtimeMs]);
    expect(sha(before.layer)).toBe(before.layerSha);
    // No setuid file and no device node on the host, anywhere under the data dir: the
    // template's own (in its ext4 image) are data the host never mounts.
    expect(execFileSync('find', [data, '(', '-perm', '-4000', '-o', '-type', 'b', '-o', '-type', 'c', ')', '-print'], { encoding: 'utf8' })).toBe('');
    // The build's scratch space is gone.
    expect(readdirSync(join(data, 'templates')).filter((n) => n.startsWith('.build-'))).toEqual([]);
    if (id) expect(readdirSync(tmpdir()).filter((n) => n.startsWith(`hutch-tpl-${id.slice(0, 8)}`))).toEqual([]);
  }

  async function snapshotHost() {
    const layer = await ensureAgentLayer({ log: () => undefined });
    return { hostname: statSync('/etc/hostname'), text: readFileSync('/etc/hostname', 'utf8'), layer: layer.image, layerSha: sha(layer.image) };
  }

  it('a tarball with ../ and absolute names, a symlink out written through, a hard link to a host file, set-ID files and devices: refused or contained', async () => {
    const before = await snapshotHost();
    const tarSha = sha(tarball);
    const r = await buildTemplate({ name: 'hostile', from: tarball, dataDir: data, cacheDir: cacheDir(), log: (m) => console.log(`[hostile] ${m}`) }).catch((e: unknown) => e);
    // busybox tar in the build VM refuses to write through a symlink it made: the build fails,
    // typed, with tar's words. Either way the host saw nothing of it.
    if (r instanceof Error) {
      expect(r).toBeInstanceOf(HutchError);
      expect((r as HutchError).code).toBe('bad_request');
      expect(r.message).toMatch(/could not be unpacked/);
    }
    expect(sha(tarball)).toBe(tarSha);
    expectNoTrace(before);
  }, 1_200_000);

  it('--run steps (symlinks out, hard links, device nodes, set-ID bits, writes to the other disks) stay in the VM', async () => {
    const before = await snapshotHost();
    const busybox = readFileSync(await ensureStaticBusybox());
    const clean = join(work, 'clean.tar');
    writeFileSync(
      clean,
      Buffer.concat([
        ...qualifyingRoot(busybox),
        Buffer.alloc(1024),
      ]),
    );
    const r = await buildTemplate({
      name: 'hostile-steps',
      from: clean,
      run: [
        `/bin/busybox ln -s /tmp /evil && echo pwned > /evil/hutch-step-${tag}; echo pwned > ../../../../tmp/hutch-escape-${tag}; true`,
        '/bin/busybox ln /etc/hostname /hostname-link; echo pwned >> /hostname-link; true',
        // The build VM's other disks: the agent layer and the input are read-only devices.
        '/bin/busybox dd if=/dev/zero of=/dev/vda bs=4096 count=16 2>&1; /bin/busybox dd if=/dev/zero of=/dev/vdb bs=4096 count=16 2>&1; true',
        '/bin/busybox mknod /made-by-step c 1 3; /bin/busybox mknod /disk b 8 0; /bin/busybox chmod 4755 /bin/busybox; true',
      ],
      dataDir: data,
      cacheDir: cacheDir(),
      log: (m) => console.log(`[hostile-steps] ${m}`),
    });
    expect(r.cached).toBe(false);
    expectNoTrace(before, r.manifest.id);
  }, 1_200_000);

  it("--run steps download through the egress proxy, but never reach this host's loopback, own addresses or cloud metadata", async () => {
    // Servers a step would love to reach: one on the host's loopback (where the broker and
    // Redis listen), one on all addresses. Neither may see a single request.
    let hits = 0;
    const serve = () => createHttpServer((_req, res) => (hits++, res.end('secret\n')));
    const loop = serve().listen(0, '127.0.0.1');
    const any = serve().listen(0, '0.0.0.0');
    await Promise.all([loop, any].map((s) => new Promise((r) => s.once('listening', r))));
    const lp = (loop.address() as AddressInfo).port;
    const ap = (any.address() as AddressInfo).port;
    const hostIp = Object.values(networkInterfaces()).flat().find((i) => i && i.family === 'IPv4' && !i.internal)?.address ?? '192.0.2.1';
    const lines: string[] = [];
    try {
      const busybox = readFileSync(await ensureStaticBusybox());
      const clean = join(work, 'net.tar');
      writeFileSync(clean, Buffer.concat([...qualifyingRoot(busybox), Buffer.alloc(1024)]));
      const attempts = [
        // Through the proxy (http_proxy is set for steps): refused by address, by name, mapped.
        `http://127.0.0.1:${lp}/`, `http://localhost:${lp}/`, `http://[::ffff:127.0.0.1]:${lp}/`, `http://${hostIp}:${ap}/`, 'http://169.254.169.254/latest/meta-data/',
        // A private network (the build host's LAN) without --egress-allow for it.
        'http://172.31.255.254/',
      ];
      const direct = [
        // Around the proxy: slirp's host alias (the host's loopback when unrestricted), the host, the metadata service.
        `http://10.0.2.2:${lp}/`, `http://${hostIp}:${ap}/`, 'http://169.254.169.254/',
      ];
      const step = [
        // No wget -T: busybox 1.35's wget segfaults with it; `timeout` bounds the direct tries.
        ...attempts.map((u) => `if /bin/busybox wget -q -O - '${u}'; then echo "LEAK proxy ${u}"; else echo "BLOCKED proxy ${u}"; fi`),
        ...direct.map((u) => `if /bin/busybox timeout 10 /bin/busybox wget -Y off -q -O - '${u}'; then echo "LEAK direct ${u}"; else echo "BLOCKED direct ${u}"; fi`),
        // An ordinary download works, and lands in the image.
        '/bin/busybox timeout 120 /bin/busybox wget -q -O /fetched http://deb.debian.org/debian/dists/bookworm/Release && /bin/busybox grep -q "^Origin: Debian" /fetched && echo FETCHED',
      ].join('\n');
      // Where a network reaches Debian through a mirror on its LAN, that is what --egress-allow is for.
      const mirror = await lookup('deb.debian.org', { all: true }).then((r) => r.map((x) => x.address), () => []);
      // The build VM's QEMU, which runs the tenant's steps with a NIC, is jailed like any
      // other: its own id, no capabilities, no host network (its relay reaches the proxy's
      // Unix socket only). Watched while the steps run; QEMU drops root once it has opened
      // its devices, before the guest runs, so each QEMU's last look is what counts.
      const last = new Map<number, QemuJailView>();
      const watch = setInterval(() => {
        for (const pid of qemuPids('hutch-tpl-')) {
          try {
            last.set(pid, qemuJailView(pid));
          } catch {
            // exited meanwhile
          }
        }
      }, 250);
      const r = await buildTemplate({ name: 'egress', from: clean, run: [step], egressAllow: mirror, dataDir: data, cacheDir: cacheDir(), log: (m) => (lines.push(m), console.log(`[egress] ${m}`)) }).finally(() => clearInterval(watch));
      expect(r.cached).toBe(false);
      expect(last.size).toBeGreaterThan(0);
      for (const v of last.values()) {
        expect(isVmUid(v.uids), String(v.uids)).toBe(true);
        expect(v).toMatchObject(JAILED);
      }
      // What the step printed (the log also echoes the step's text, which names LEAK).
      const out = lines.filter((l) => l.startsWith('  | ')).join('\n');
      expect(out).not.toContain('LEAK');
      expect(out).not.toContain('secret');
      for (const u of attempts) expect(out).toContain(`BLOCKED proxy ${u}`);
      for (const u of direct) expect(out).toContain(`BLOCKED direct ${u}`);
      expect(out).toContain('FETCHED');
      expect(lines.join('\n')).toMatch(/egress: .*refused: 127\.0\.0\.1 is loopback/);
      expect(lines.join('\n')).toMatch(/egress: .*refused: 172\.31\.255\.254 is on a private network/);
      expect(hits).toBe(0);
      // Without steps there is no NIC and no proxy at all; --offline steps get none either.
      const offline = await buildTemplate({ name: 'offline', from: clean, run: ['if /bin/busybox timeout 10 /bin/busybox wget -q -O /x http://deb.debian.org/; then echo ONLINE; else echo OFFLINE; fi; echo NET:$(/bin/busybox ls /sys/class/net)'], network: false, dataDir: data, cacheDir: cacheDir(), log: (m) => lines.push(m) });
      expect(offline.manifest.id).not.toBe(r.manifest.id);
      const offOut = lines.filter((l) => l.startsWith('  | ')).join('\n');
      expect(offOut).toMatch(/OFFLINE/);
      expect(offOut).not.toMatch(/ONLINE/);
      expect(offOut).toMatch(/NET:lo$/m);
    } finally {
      loop.close();
      any.close();
    }
  }, 1_200_000);
});
