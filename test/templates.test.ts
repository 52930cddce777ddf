/**
 * Templates for real: a Debian trixie template from debootstrap (python3, nodejs), one from a
 * tarball made from a directory (built while the broker runs), and the default template, all
 * three alive in one broker; roots without /bin/sh or glibc refused; slots stay with their
 * template. Builds are content-addressed and kept under ~/.cache/hutch/test-templates (the
 * debootstrap tarball under ~/.cache/hutch/template-debootstrap), so a warm run only boots.
 */
import { execFileSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync, copyFileSync } from 'node:fs';
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
import { qemuPids } from '../host-broker/src/vm/qemu-driver.ts';
import { startBroker, type TestBroker } from './helpers/broker.ts';
import { missingRootTools } from './helpers/prerequisites.ts';

const missing = missingRootTools(['qemu-system-x86_64', 'debootstrap', 'mke2fs', 'tar'], 'building templates needs root');
if (missing) console.warn(`SKIPPING test/templates.test.ts: ${missing}`);

const log = (m: string) => console.log(`[template] ${m}`);

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
    execFileSync('tar', ['-C', extra, '--numeric-owner', '--owner=0', '--group=0', '-rf', tar, './etc/made-from-dir']);
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
