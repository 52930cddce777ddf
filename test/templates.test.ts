/**
 * Templates for real: a Debian trixie template from debootstrap (python3, nodejs), one from a
 * tarball made from a directory (built while the broker runs), and the default template, all
 * three alive in one broker; roots without /bin/sh or glibc refused; slots stay with their
 * template. Builds are content-addressed and kept under ~/.cache/hutch/test-templates (the
 * debootstrap tarball under ~/.cache/hutch/template-debootstrap), so a warm run only boots.
 */
import { execFileSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, statSync, symlinkSync, writeFileSync, copyFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { cacheRoot } from '../build/cache.ts';
import { ensureStaticBusybox } from '../build/busybox.ts';
import { ensureBase } from '../rootfs/base.ts';
import { createLogger } from '../guest-agent/src/log.ts';
import { HutchError } from '../guest-agent/src/protocol/errors.ts';
import { QemuBackend } from '../host-broker/src/backends/qemu-backend.ts';
import { cacheDir } from '../host-broker/src/backends/registry.ts';
import type { Hutch } from '../host-broker/src/sdk/index.ts';
import { buildTemplate, type TemplateBuildResult } from '../host-broker/src/templates/build.ts';
import { TemplateStore } from '../host-broker/src/templates/store.ts';
import { qemuPids } from '../host-broker/src/vm/qemu-driver.ts';
import { startBroker, type TestBroker } from './helpers/broker.ts';
import { missingRootTools } from './helpers/prerequisites.ts';

const missing = missingRootTools(['qemu-system-x86_64', 'debootstrap', 'mke2fs', 'tar'], 'building templates needs root');
if (missing) console.warn(`SKIPPING test/templates.test.ts: ${missing}`);

const log = (m: string) => console.log(`[template] ${m}`);
/** The same bytes on every run, so the content-addressed builds kept in the cache are reused. */
const STABLE_TAR = ['--sort=name', '--mtime=@1704067200', '--owner=0', '--group=0', '--numeric-owner'];

describe.skipIf(missing !== undefined)('templates', { tags: ['vm'] }, () => {
  let work: string;
  let dataDir: string;
  let b: TestBroker;
  let hutch: Hutch;
  let trixie: TemplateBuildResult;
  let fromDir: TemplateBuildResult;

  beforeAll(async () => {
    work = mkdtempSync(join(tmpdir(), 'hutch-templates-test-'));
    dataDir = join(work, 'data');
    mkdirSync(dataDir);
    // Builds survive runs: the data dir's templates/ lives in the cache (content-addressed ids).
    const kept = join(cacheRoot(), 'test-templates', 'templates');
    mkdirSync(kept, { recursive: true });
    symlinkSync(kept, join(dataDir, 'templates'));
    trixie = await buildTemplate({ name: 'trixie', from: 'debootstrap:trixie', packages: ['python3', 'nodejs'], dataDir, cacheDir: cacheDir(), log });
    console.log(`[template] trixie: ${trixie.cached ? 'reused' : 'built'} in ${trixie.seconds.toFixed(1)} s; pristine snapshot ${(trixie.snapshot.bytes / 2 ** 20).toFixed(0)} MiB on disk, boot ${trixie.snapshot.bootMs} ms`);
    b = await startBroker({ backend: 'qemu', dataDir, idleMs: 600_000 });
    hutch = await b.connect();
  }, 3_600_000);

  afterAll(async () => {
    // The kept builds: only what the names point at (a changed input leaves the old build behind).
    if (dataDir) new TemplateStore(dataDir).removeUnnamed();
    await b?.stop();
    if (b) expect(qemuPids(b.dataDir)).toEqual([]);
    rmSync(work, { recursive: true, force: true });
  }, 120_000);

  it('a template built while the broker runs (a tarball made from a directory) is usable at once', async () => {
    // The directory: Debian bookworm's base tree (python3 3.11, nodejs 18) plus a marker file.
    const base = await ensureBase({ log });
    const tar = join(work, 'from-dir.tar');
    execFileSync('tar', ['-C', base.tree, '--sort=name', '--numeric-owner', '-cf', tar, '.']);
    const extra = join(work, 'extra');
    mkdirSync(join(extra, 'etc'), { recursive: true });
    writeFileSync(join(extra, 'etc/made-from-dir'), 'yes\n');
    execFileSync('tar', ['-C', extra, ...STABLE_TAR, '-rf', tar, './etc/made-from-dir']);
    fromDir = await buildTemplate({ name: 'fromdir', from: tar, run: ['echo built-by-step > /etc/step-ran'], env: { HUTCH_TEMPLATE_TEST: 'on' }, dataDir, cacheDir: cacheDir(), log });
    console.log(`[template] fromdir: ${fromDir.cached ? 'reused' : 'built'} in ${fromDir.seconds.toFixed(1)} s; pristine snapshot ${(fromDir.snapshot.bytes / 2 ** 20).toFixed(0)} MiB on disk, boot ${fromDir.snapshot.bootMs} ms`);
    expect(fromDir.manifest.source.kind).toBe('tarball');
  }, 1_800_000);

  it('runs the default, trixie and fromdir templates side by side in one broker', async () => {
    const made = await Promise.all(
      [undefined, 'trixie', 'fromdir'].map(async (template) => {
        const t0 = performance.now();
        const sb = await hutch.create({ ...(template ? { template } : {}), workspace: { files: { 'in.txt': `hello ${template ?? 'default'}\n` } } });
        const py = await sb.run('python3 --version', { route: 'vm' });
        console.log(`[template] ${template ?? 'default'}: first call (restore + python3) ${((performance.now() - t0) / 1000).toFixed(1)} s, restore phase ${String(py.timing.wakePhases?.['restore'] ?? '?')} ms`);
        return { template: template ?? 'default', sb, py };
      }),
    );
    const live = (await hutch.sessions()).filter((s) => s.live).map((s) => s.template);
    expect(live.sort()).toEqual(['default', 'fromdir', 'trixie']);
    for (const { template, sb, py } of made) {
      expect(py.exitCode, template).toBe(0);
      const node = await sb.run('node --version', { route: 'vm' });
      expect(node.exitCode, template).toBe(0);
      // Round trip: host -> guest (pushed file), guest writes, host reads it back.
      const rt = await sb.run('cat in.txt && python3 -c "open(\'out.txt\',\'w\').write(open(\'in.txt\').read().upper())"', { route: 'vm' });
      expect(rt.stdout).toBe(`hello ${template}\n`);
      // ...pulled back into the host workspace, the source of truth.
      expect(readFileSync(join(b.dataDir, 'sessions', sb.id, 'workspace', 'out.txt'), 'utf8')).toBe(`HELLO ${template.toUpperCase()}\n`);
      // The kernel has virtio-net for template builds' egress; a tenant VM still has no NIC.
      expect((await sb.run('ls /sys/class/net', { route: 'vm' })).stdout, template).toBe('lo\n');
      if (template === 'trixie') {
        expect(py.stdout).toMatch(/^Python 3\.13\./);
        expect(node.stdout).toMatch(/^v20\./);
      } else {
        expect(py.stdout).toMatch(/^Python 3\.11\./);
        expect(node.stdout).toMatch(/^v18\./);
      }
    }
    const own = made.find((m) => m.template === 'fromdir')!.sb;
    // The --run step ran in the image; the template's --env reaches tenant commands.
    expect((await own.run('cat /etc/step-ran /etc/made-from-dir; echo $HUTCH_TEMPLATE_TEST', { route: 'vm' })).stdout).toBe('built-by-step\nyes\non\n');
    expect((await made[0]!.sb.run('test -e /etc/made-from-dir || echo absent', { route: 'vm' })).stdout).toBe('absent\n');
    for (const m of made) await m.sb.close();
  }, 1_800_000);

  it('refuses an unknown template at create, and a name that is a path', async () => {
    await expect(hutch.create({ template: 'no-such-template' })).rejects.toMatchObject({ code: 'not_found' });
    await expect(hutch.create({ template: '../trixie' })).rejects.toMatchObject({ code: 'bad_request' });
  });

  it('never restores a slot of one template into another', async () => {
    const backend = await QemuBackend.create({ dataDir, cacheDir: cacheDir(), log: createLogger({ name: 'test', level: 'warn' }) });
    try {
      const spec = (template?: string) => ({ session: `slot-${template ?? 'default'}`, workspaceDir: join(work, 'ws'), stateDir: join(work, 'st'), cpus: 1, memoryMiB: 512, ...(template ? { template } : {}) });
      const keys = await Promise.all([undefined, 'trixie', 'fromdir'].map((t) => backend.pristineKey(spec(t))));
      expect(new Set(keys).size).toBe(3);
      // A slot of trixie's lineage offered to a fromdir session: refused before anything boots.
      const slot = { dir: join(work, 'slot'), state: join(work, 'slot/state'), manifest: join(work, 'slot/m.json'), pristineKey: keys[1]! };
      const err = await backend.start(spec('fromdir'), { from: slot }).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(HutchError);
      expect((err as HutchError).code).toBe('unavailable');
      expect((err as HutchError).message).toMatch(/another pristine snapshot/);
    } finally {
      await backend.shutdown();
    }
  }, 600_000);

  it('builds from an OCI image layout: layers in order, whiteouts applied, digests checked', async () => {
    const busybox = await ensureStaticBusybox(log);
    const oci = join(work, 'oci');
    const blobs = join(oci, 'blobs', 'sha256');
    mkdirSync(blobs, { recursive: true });
    const blob = (file: string) => {
      const hex = createHash('sha256').update(readFileSync(file)).digest('hex');
      copyFileSync(file, join(blobs, hex));
      return { digest: `sha256:${hex}`, size: statSync(file).size };
    };
    const l1 = join(work, 'oci-l1');
    mkdirSync(join(l1, 'bin'), { recursive: true });
    mkdirSync(join(l1, 'lib64'));
    mkdirSync(join(l1, 'etc'));
    copyFileSync(busybox, join(l1, 'bin/busybox'));
    symlinkSync('busybox', join(l1, 'bin/sh'));
    // The agent runs `bash --norc --noprofile -c CMD`: busybox has no bash applet, so a shim.
    writeFileSync(join(l1, 'bin/bash'), '#!/bin/busybox sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec /bin/busybox sh "$@"\n', { mode: 0o755 });
    copyFileSync('/lib64/ld-linux-x86-64.so.2', join(l1, 'lib64/ld-linux-x86-64.so.2'));
    writeFileSync(join(l1, 'etc/deleted-by-layer-2'), 'x\n');
    const l2 = join(work, 'oci-l2');
    mkdirSync(join(l2, 'etc'), { recursive: true });
    writeFileSync(join(l2, 'etc/.wh.deleted-by-layer-2'), '');
    writeFileSync(join(l2, 'etc/from-layer-2'), 'two\n');
    execFileSync('tar', ['-C', l1, ...STABLE_TAR, '-I', 'gzip -n', '-cf', join(work, 'l1.tgz'), '.']);
    execFileSync('tar', ['-C', l2, ...STABLE_TAR, '-cf', join(work, 'l2.tar'), '.']);
    writeFileSync(join(work, 'config.json'), JSON.stringify({ architecture: 'amd64', os: 'linux' }));
    writeFileSync(
      join(work, 'manifest.json'),
      JSON.stringify({
        schemaVersion: 2,
        config: { mediaType: 'application/vnd.oci.image.config.v1+json', ...blob(join(work, 'config.json')) },
        layers: [
          { mediaType: 'application/vnd.oci.image.layer.v1.tar+gzip', ...blob(join(work, 'l1.tgz')) },
          { mediaType: 'application/vnd.oci.image.layer.v1.tar', ...blob(join(work, 'l2.tar')) },
        ],
      }),
    );
    const manifest = blob(join(work, 'manifest.json'));
    writeFileSync(join(oci, 'index.json'), JSON.stringify({ schemaVersion: 2, manifests: [{ mediaType: 'application/vnd.oci.image.manifest.v1+json', ...manifest, platform: { architecture: 'amd64', os: 'linux' } }] }));
    writeFileSync(join(oci, 'oci-layout'), '{"imageLayoutVersion":"1.0.0"}');
    const r = await buildTemplate({
      name: 'oci',
      from: oci,
      // Fails the build unless layer 2's whiteout removed layer 1's file and left no .wh. entry.
      run: ['test ! -e /etc/deleted-by-layer-2 && test "$(cat /etc/from-layer-2)" = two && ! ls -a /etc | grep -q "^\\.wh\\."'],
      // Runs at boot before the pristine snapshot: its /tmp file is in every restored VM.
      start: 'echo "warm $OCI_TEST_ENV" > /tmp/started-before-snapshot',
      env: { OCI_TEST_ENV: 'yes' },
      dataDir,
      cacheDir: cacheDir(),
      log,
    });
    expect(r.manifest.source).toMatchObject({ kind: 'oci', digest: manifest.digest });
    // A root of nothing but busybox runs the agent (the layer's Node) and tenant commands.
    const sb = await hutch.create({ template: 'oci' });
    const out = await sb.run('cat /tmp/started-before-snapshot; id -u; echo $OCI_TEST_ENV', { route: 'vm' });
    expect(out.stdout).toBe('warm yes\n1000\nyes\n');
    await sb.close();
    // A blob whose bytes do not match its digest is refused before anything boots.
    writeFileSync(join(blobs, manifest.digest.slice('sha256:'.length)), '{}');
    await expect(buildTemplate({ name: 'oci-bad', from: oci, dataDir, cacheDir: cacheDir(), log })).rejects.toMatchObject({ code: 'bad_request' });
  }, 600_000);

  it('refuses a root filesystem without /bin/sh, or without glibc, naming what is missing', async () => {
    const busybox = await ensureStaticBusybox(log);
    const noSh = join(work, 'no-sh');
    mkdirSync(join(noSh, 'lib64'), { recursive: true });
    copyFileSync('/lib64/ld-linux-x86-64.so.2', join(noSh, 'lib64/ld-linux-x86-64.so.2'));
    const noGlibc = join(work, 'no-glibc');
    mkdirSync(join(noGlibc, 'bin'), { recursive: true });
    copyFileSync(busybox, join(noGlibc, 'bin/busybox'));
    symlinkSync('busybox', join(noGlibc, 'bin/sh'));
    symlinkSync('busybox', join(noGlibc, 'bin/bash'));
    const a = await buildTemplate({ name: 'no-sh', from: noSh, dataDir, cacheDir: cacheDir(), log }).catch((e: unknown) => e);
    expect(a).toBeInstanceOf(HutchError);
    expect((a as HutchError).code).toBe('unusable_rootfs');
    expect((a as HutchError).context?.['missing']).toEqual(expect.arrayContaining(['/bin/sh', 'bash']));
    expect((a as HutchError).message).toMatch(/lacks \/bin\/sh/);
    const c = await buildTemplate({ name: 'no-glibc', from: noGlibc, dataDir, cacheDir: cacheDir(), log }).catch((e: unknown) => e);
    expect((c as HutchError).code).toBe('unusable_rootfs');
    expect((c as HutchError).context?.['missing']).toEqual(['glibc (/lib64/ld-linux-x86-64.so.2)']);
    await expect(hutch.create({ template: 'no-sh' })).rejects.toMatchObject({ code: 'not_found' });
  }, 600_000);
});
