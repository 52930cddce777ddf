/**
 * Which fast-path binaries the host can actually run inside the sandbox.
 *
 * The sandbox sees the host's /usr (and the /bin, /lib symlinks into it) but not /etc, so a
 * binary that is missing, or that reaches its program through /etc/alternatives (Debian's
 * /usr/bin/awk -> /etc/alternatives/awk -> /usr/bin/mawk), would fail there while the VM
 * runs it. Such commands are routed to the VM. Checked once at init: the host's /usr does
 * not change under a running broker.
 */
import { lstatSync, readlinkSync } from 'node:fs';
import { dirname, resolve } from 'node:path';

const SEARCH_DIRS = ['/usr/bin', '/usr/sbin', '/bin', '/sbin'];
const MAX_HOPS = 16;

/** /bin -> usr/bin style links that the sandbox recreates. */
const MERGED_USR: Record<string, string> = { '/bin': '/usr/bin', '/sbin': '/usr/sbin', '/lib': '/usr/lib', '/lib64': '/usr/lib64' };

/**
 * @param root file-system prefix the host's `/` is read from ('' in production; a scratch
 *   tree in tests). Symlink targets are interpreted as seen from that root.
 */
export function sandboxCanRun(name: string, root = ''): boolean {
  for (const dir of SEARCH_DIRS) {
    const verdict = resolvesInsideUsr(`${dir}/${name}`, root);
    if (verdict !== 'missing') return verdict === 'ok';
  }
  return false;
}

function resolvesInsideUsr(path: string, root: string): 'ok' | 'missing' | 'outside' {
  let p = path;
  for (let hop = 0; hop < MAX_HOPS; hop++) {
    p = unmerge(p);
    if (!p.startsWith('/usr/')) return hop === 0 ? 'missing' : 'outside';
    let st;
    try {
      st = lstatSync(root + p);
    } catch {
      return hop === 0 ? 'missing' : 'outside';
    }
    if (!st.isSymbolicLink()) return st.isFile() && (st.mode & 0o111) !== 0 ? 'ok' : hop === 0 ? 'missing' : 'outside';
    p = resolve(dirname(p), readlinkSync(root + p));
  }
  return 'outside';
}

function unmerge(p: string): string {
  for (const [from, to] of Object.entries(MERGED_USR)) {
    if (p === from || p.startsWith(`${from}/`)) return to + p.slice(from.length);
  }
  return p;
}

/** Availability of each binary, computed once. */
export function probeHostBinaries(names: readonly string[]): Map<string, boolean> {
  return new Map(names.map((n) => [n, sandboxCanRun(n)]));
}
