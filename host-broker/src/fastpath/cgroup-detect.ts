/**
 * Finds where this process sits in the cgroup hierarchies, from /proc/self/cgroup and
 * /proc/self/mountinfo, so per-run cgroups can be made below the broker's own cgroup (the
 * runs then also count against whatever limit the broker itself runs under).
 */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';

export interface CgroupMount {
  /** 'cgroup2', or 'cgroup' (v1). */
  fstype: 'cgroup' | 'cgroup2';
  mountPoint: string;
  /** Path of the mount's root within its hierarchy (usually '/'). */
  root: string;
  /** v1: the controllers bound to this hierarchy (from the super options). */
  controllers: string[];
}

export interface CgroupLayout {
  mounts: CgroupMount[];
  /** Hierarchy key -> this process's path: '' for v2 (the `0::` line), else the v1 controller list. */
  own: Map<string, string>;
}

export function readCgroupLayout(procSelf = '/proc/self'): CgroupLayout {
  return {
    mounts: parseMountinfo(readFileSync(join(procSelf, 'mountinfo'), 'utf8')),
    own: parseProcCgroup(readFileSync(join(procSelf, 'cgroup'), 'utf8')),
  };
}

export function parseMountinfo(text: string): CgroupMount[] {
  const out: CgroupMount[] = [];
  for (const line of text.split('\n')) {
    // id parent major:minor root mountpoint opts [optional...] - fstype source superopts
    const sep = line.indexOf(' - ');
    if (sep < 0) continue;
    const left = line.slice(0, sep).split(' ');
    const [fstype, , superOpts = ''] = line.slice(sep + 3).split(' ');
    if (fstype !== 'cgroup' && fstype !== 'cgroup2') continue;
    const root = unescapeMount(left[3] ?? '/');
    const mountPoint = unescapeMount(left[4] ?? '');
    const controllers = fstype === 'cgroup' ? superOpts.split(',').filter((o) => o !== 'rw' && o !== 'ro' && !o.includes('=')) : [];
    out.push({ fstype, mountPoint, root, controllers });
  }
  return out;
}

export function parseProcCgroup(text: string): Map<string, string> {
  const own = new Map<string, string>();
  for (const line of text.split('\n')) {
    const m = /^\d+:([^:]*):(.*)$/.exec(line);
    if (m) own.set(m[1] as string, m[2] as string);
  }
  return own;
}

/** Host directory of this process's cgroup in `mount`, or undefined if it is not in it. */
export function ownDir(layout: CgroupLayout, mount: CgroupMount): string | undefined {
  const key = mount.fstype === 'cgroup2' ? '' : findV1Key(layout, mount);
  if (key === undefined) return undefined;
  const path = layout.own.get(key);
  if (path === undefined) return undefined;
  const rel = mount.root !== '/' && path.startsWith(mount.root) ? path.slice(mount.root.length) : path;
  const dir = join(mount.mountPoint, rel);
  return dir.length > 1 && dir.endsWith('/') ? dir.slice(0, -1) : dir;
}

function findV1Key(layout: CgroupLayout, mount: CgroupMount): string | undefined {
  for (const key of layout.own.keys()) {
    if (key === '') continue;
    const names = key.split(',');
    if (names.length === mount.controllers.length && names.every((n) => mount.controllers.includes(n))) return key;
  }
  return undefined;
}

/** mountinfo escapes space, tab, newline and backslash as \ooo. */
function unescapeMount(s: string): string {
  return s.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(parseInt(o, 8)));
}
