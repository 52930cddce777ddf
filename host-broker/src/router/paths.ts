/**
 * Where a path argument points, decided from its text alone.
 *
 * This is not path confinement (that is guest-agent/src/workspace/confine.ts, which resolves
 * real files and symlinks): the router runs before anything executes and never touches the
 * file system. It only sorts a shell word into the places that look the same on the fast
 * path and in the VM (the workspace, mounted at /work in both; scratch files in /tmp; a few
 * devices) and everything else. `..` is applied lexically against the lowest directory the
 * command may be in at that point (see `cwdDepth`), so a word that could climb above the
 * workspace root is "outside".
 */

export const WORKSPACE_MOUNT = '/work';

export type PathPlace =
  | { kind: 'workspace' }
  | { kind: 'tmp'; path: string }
  | { kind: 'device'; path: string }
  | { kind: 'outside'; why: string };

/** Devices that behave identically in a bubblewrap `--dev` and in the guest. */
export const READ_DEVICES = new Set(['/dev/null', '/dev/zero', '/dev/urandom', '/dev/random']);
export const WRITE_DEVICES = new Set(['/dev/null']);
/**
 * Links into /proc/self/fd. The fast path has no procfs (a procfs shows the workspace's host
 * path: fastpath/bwrap-argv.ts), and bash opens these files even in its own redirections, so
 * a command naming one runs in the VM; `>&2` and `<&0` name no file and stay on the fast path.
 */
const FD_LINKS = new Set(['/dev/stdin', '/dev/stdout', '/dev/stderr', '/dev/fd']);

export interface PathInput {
  value: string;
  /** A glob component may match `..`. */
  globDotDot?: boolean;
}

/**
 * @param cwdDepth how many directories below the workspace root the command is, at least
 *   (`cd` into a directory can fail, so a deeper cwd is never assumed).
 */
export function placeOf(p: PathInput, cwdDepth: number): PathPlace {
  const v = p.value;
  if (v.startsWith('/')) return placeAbsolute(v, p.globDotDot === true);
  let depth = cwdDepth;
  for (const comp of v.split('/')) {
    if (comp === '' || comp === '.') continue;
    if (comp === '..' || (p.globDotDot === true && looksLikeDotGlob(comp))) {
      depth--;
      if (depth < 0) return { kind: 'outside', why: `\`${v}\`, which climbs out of the workspace with \`..\`` };
    } else depth++;
  }
  return { kind: 'workspace' };
}

function placeAbsolute(v: string, globDotDot: boolean): PathPlace {
  const parts: string[] = [];
  for (const comp of v.split('/')) {
    if (comp === '' || comp === '.') continue;
    if (comp === '..' || (globDotDot && looksLikeDotGlob(comp))) parts.pop();
    else parts.push(comp);
  }
  const norm = `/${parts.join('/')}`;
  if (norm === WORKSPACE_MOUNT || norm.startsWith(`${WORKSPACE_MOUNT}/`)) return { kind: 'workspace' };
  if (norm === '/tmp' || norm.startsWith('/tmp/')) return { kind: 'tmp', path: norm };
  if (READ_DEVICES.has(norm) || WRITE_DEVICES.has(norm)) return { kind: 'device', path: norm };
  if (FD_LINKS.has(norm) || norm.startsWith('/dev/fd/')) return { kind: 'outside', why: `\`${v}\`, a link into /proc/self/fd (the fast path has no procfs)` };
  return { kind: 'outside', why: `\`${v}\`, outside the workspace and /tmp` };
}

function looksLikeDotGlob(comp: string): boolean {
  return comp.startsWith('.') || comp.startsWith('[');
}

/**
 * Applies `cd <dir>` to the lowest possible cwd depth; null when the directory could be
 * above the workspace root.
 */
export function depthAfterCd(dir: string, cwdDepth: number): number | null {
  if (dir.startsWith('/')) {
    const place = placeOf({ value: dir }, 0);
    if (place.kind !== 'workspace') return null;
    const parts = dir.split('/').filter((c) => c !== '' && c !== '.');
    let depth = -1; // the leading "work" component
    for (const c of parts) depth += c === '..' ? -1 : 1;
    return Math.min(cwdDepth, Math.max(depth, 0));
  }
  let depth = cwdDepth;
  let lowest = cwdDepth;
  for (const comp of dir.split('/')) {
    if (comp === '' || comp === '.') continue;
    depth += comp === '..' ? -1 : 1;
    if (depth < 0) return null;
    lowest = Math.min(lowest, depth);
  }
  // The cd may fail and leave the shell where it was, so keep the lower of the two.
  return Math.min(lowest, cwdDepth, depth);
}

/** True when `child` is `parent` or below it (both normalised absolute paths). */
export function isWithin(child: string, parent: string): boolean {
  return child === parent || child.startsWith(`${parent}/`);
}
