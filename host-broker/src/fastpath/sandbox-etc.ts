/**
 * The sandbox's /etc: a small directory the broker writes once and every sandbox mounts
 * read-only. Read tools need little from /etc (user and group names, nsswitch so glibc
 * looks only at files, the time zone, the dynamic linker's cache, Debian's alternatives
 * links for awk & co., a git config); nothing else of the host's /etc is visible, so
 * /etc/shadow, SSH keys and credentials in config files stay out of reach.
 */
import { chmodSync, copyFileSync, lstatSync, mkdirSync, mkdtempSync, readdirSync, readlinkSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { pidAlive } from '../../../build/cache.ts';

export interface SandboxIdentity {
  uid: number;
  gid: number;
  user: string;
  home: string;
}

export interface SandboxEtc {
  /** Mounted at /etc. */
  dir: string;
  /** An empty directory, mounted over masked /proc directories. */
  emptyDir: string;
  remove(): void;
}

const PREFIX = 'hutch-fastpath-etc-';

export function createSandboxEtc(id: SandboxIdentity, parent = tmpdir()): SandboxEtc {
  sweepStale(parent);
  // The pid in the name lets a later broker remove what a killed one left behind.
  const base = mkdtempSync(join(parent, `${PREFIX}${process.pid}-`));
  const dir = join(base, 'etc');
  const emptyDir = join(base, 'empty');
  try {
    chmodSync(base, 0o755); // mkdtemp makes it 0700; the sandbox user must be able to read it
    mkdirSync(dir, { mode: 0o755 });
    mkdirSync(emptyDir, { mode: 0o555 });
    const write = (name: string, text: string) => writeFileSync(join(dir, name), text, { mode: 0o644 });
    write('passwd', `root:x:0:0:root:/root:/usr/sbin/nologin\n${id.user}:x:${id.uid}:${id.gid}:${id.user}:${id.home}:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n`);
    write('group', `root:x:0:\n${id.user}:x:${id.gid}:\nnogroup:x:65534:\n`);
    // Files only: no systemd/NSS modules that would try D-Bus or sockets from inside.
    write('nsswitch.conf', 'passwd: files\ngroup: files\nshadow: files\nhosts: files\nnetworks: files\nprotocols: files\nservices: files\n');
    write('hosts', '127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost ip6-loopback\n');
    write('hostname', 'sandbox\n');
    // The workspace's owner on the host may map to nobody inside; git must still read it.
    write('gitconfig', '[safe]\n\tdirectory = *\n');
    symlinkSync('../proc/self/mounts', join(dir, 'mtab'));
    copyIfPresent('/etc/ld.so.cache', join(dir, 'ld.so.cache'));
    copyIfPresent('/etc/os-release', join(dir, 'os-release'));
    copyLinkIfPresent('/etc/localtime', join(dir, 'localtime'));
    copyAlternatives(join(dir, 'alternatives'));
  } catch (err) {
    rmSync(base, { recursive: true, force: true });
    throw err;
  }
  return { dir, emptyDir, remove: () => rmSync(base, { recursive: true, force: true }) };
}

function sweepStale(parent: string): void {
  let names: string[] = [];
  try {
    names = readdirSync(parent);
  } catch {
    return;
  }
  for (const name of names) {
    const pid = Number(/^hutch-fastpath-etc-(\d+)-/.exec(name)?.[1]);
    if (pid > 0 && pid !== process.pid && !pidAlive(pid)) rmSync(join(parent, name), { recursive: true, force: true });
  }
}


function copyIfPresent(from: string, to: string): void {
  try {
    copyFileSync(from, to);
  } catch {
    // absent on this host: the sandbox works without it (ld.so then searches its default dirs)
  }
}

function copyLinkIfPresent(from: string, to: string): void {
  try {
    if (lstatSync(from).isSymbolicLink()) symlinkSync(readlinkSync(from), to);
  } catch {
    // no time zone configured: tools use UTC
  }
}

/** Debian's /etc/alternatives is a directory of symlinks into /usr; the links are copied, not their targets. */
function copyAlternatives(to: string): void {
  mkdirSync(to, { mode: 0o755 });
  let names: string[];
  try {
    names = readdirSync('/etc/alternatives');
  } catch {
    return;
  }
  for (const name of names) {
    copyLinkIfPresent(`/etc/alternatives/${name}`, join(to, name));
  }
}
