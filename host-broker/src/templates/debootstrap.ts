/**
 * `--from debootstrap:SUITE --packages a,b,c`: a Debian root filesystem as a tarball,
 * cached under `<cache>/template-debootstrap/<key>/rootfs.tar` by suite, packages, mirror
 * and this file, so CI builds it once (minutes) and then reuses it.
 *
 * debootstrap runs on the host (as rootfs/base.ts does for the default template): it needs
 * no VM and no egress proxy for what is only Debian packages, and what it installs are Debian
 * packages checked against the Debian archive keyring, named by the user from a strict
 * alphabet. The resulting tree is only tarred here; the template build unpacks it in its VM.
 */
import { mkdir, rm, writeFile } from 'node:fs/promises';
import { existsSync } from 'node:fs';
import { performance } from 'node:perf_hooks';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { cacheDir, cacheRoot, fillAtomically, hashInputs, withLock } from '../../../build/cache.ts';
import { ensureHostPackages } from '../../../build/host-apt.ts';
import { run } from '../../../build/run.ts';
import { assertNoMountsUnder, unmountAllUnder } from '../../../rootfs/chroot.ts';

const MIRROR = 'http://deb.debian.org/debian';
const KEYRING = '/usr/share/keyrings/debian-archive-keyring.gpg';
const THIS_FILE = fileURLToPath(import.meta.url);

export function validateDebootstrap(suite: string, packages: readonly string[]): void {
  if (!/^[a-z]{2,20}$/.test(suite)) throw new HutchError('bad_request', `debootstrap suite ${JSON.stringify(suite)}: expected a Debian suite name such as trixie or bookworm`);
  for (const p of packages) {
    if (!/^[a-z0-9][a-z0-9+.-]{0,99}$/.test(p)) throw new HutchError('bad_request', `--packages: ${JSON.stringify(p)} is not a Debian package name`);
  }
}

export async function debootstrapTarball(suite: string, packagesIn: readonly string[], log: (m: string) => void): Promise<{ tarball: string; key: string; packages: string[] }> {
  const packages = [...new Set(packagesIn)].sort();
  validateDebootstrap(suite, packages);
  const key = await hashInputs([{ label: 'suite', value: suite }, { label: 'packages', value: packages.join(',') }, { label: 'mirror', value: MIRROR }, { file: THIS_FILE }]);
  const dir = join(await cacheDir('template-debootstrap'), key);
  const tarball = join(dir, 'rootfs.tar');
  if (existsSync(tarball)) {
    log(`debootstrap ${suite} + ${packages.join(',') || '(no packages)'}: cached (${dir})`);
    return { tarball, key, packages };
  }
  if (process.getuid?.() !== 0) throw new HutchError('unavailable', 'debootstrap needs root');
  await ensureHostPackages(['debootstrap', 'debian-archive-keyring', 'tar'], log);
  await withLock(join(cacheRoot(), 'template-debootstrap', `${key}.lock`), async () => {
    if (existsSync(tarball)) return;
    await fillAtomically(dir, async (tmp) => {
      const tree = join(tmp, 'tree');
      await mkdir(tree, { recursive: true });
      const debCache = await cacheDir('downloads', `debootstrap-${suite}-amd64`);
      log(`debootstrap --variant=minbase ${suite}${packages.length ? ` --include=${packages.join(',')}` : ''} (downloads cached in ${debCache})`);
      const t0 = performance.now();
      let last = 0;
      try {
        await run(
        ['debootstrap', '--variant=minbase', '--arch=amd64', '--components=main', `--keyring=${KEYRING}`, `--cache-dir=${debCache}`, ...(packages.length ? [`--include=${packages.join(',')}`] : []), suite, tree, MIRROR],
        {
          onLine: (line) => {
            // debootstrap's own progress, at most every 5 s.
            if (Date.now() - last > 5000 && /^I: /.test(line)) {
              last = Date.now();
              log(`  debootstrap: ${line.slice(3)}`);
            }
          },
        },
        );
      } finally {
        // debootstrap mounts /proc and /sys in the target; a failed run may leave them there.
        await unmountAllUnder(tmp);
        await assertNoMountsUnder(tmp);
      }
      // No package lists or downloaded .debs in the image.
      await run(['sh', '-c', 'rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/archives/*.deb "$1"/var/log/*.log', 'sh', tree]);
      log(`debootstrap done in ${Math.round((performance.now() - t0) / 1000)} s; tarring`);
      await run(['tar', '-C', tree, '--sort=name', '--numeric-owner', '--xattrs', '-cf', join(tmp, 'rootfs.tar'), '.']);
      await rm(tree, { recursive: true, force: true });
      await writeFile(join(tmp, 'debootstrap.json'), `${JSON.stringify({ suite, packages, mirror: MIRROR, seconds: Math.round((performance.now() - t0) / 1000), builtAt: new Date().toISOString() }, null, 2)}\n`);
    });
  }, log);
  return { tarball, key, packages };
}
