import { lstatSync, readlinkSync, realpathSync, type Stats } from 'node:fs';
import { HutchError } from '../protocol/errors.ts';

/**
 * Path confinement: the one place that turns a tenant-supplied path into a host path
 * inside the workspace. Used by the agent in the guest and by the broker on the host.
 *
 * Tenant paths are relative to the workspace root or absolute under its mount point
 * (/work, where the workspace appears in the VM and in the fast path). Symlinks are
 * resolved component by component with lstat/readlink, interpreting targets as the
 * tenant sees them (absolute targets under the mount point), so a link that points out
 * of the workspace, directly, through another link, through `..` or through
 * /proc/self/root, is refused with `outside_workspace` before anything is opened.
 *
 * This is a check-then-use design. It is race-free for the broker because nothing of the
 * tenant runs against a host workspace while the broker touches it (calls of a session are
 * serialised and fast-path sandboxes die with their call); callers still open final
 * components with O_NOFOLLOW as a second line of defence.
 */

const MAX_SYMLINK_HOPS = 40;

export type MissingPolicy =
  /** Every component must exist. */
  | 'none'
  /** The last component may be missing (write, mkdir). */
  | 'final'
  /** Any trailing components may be missing (write with parents, mkdir -p). */
  | 'parents';

export interface ResolveOptions {
  /** Follow a symlink in the last component. Reading does; stat/remove/rename do not. */
  followFinal?: boolean;
  missing?: MissingPolicy;
}

export interface ResolvedPath {
  /** Workspace-relative path with every symlink resolved ('' is the root). */
  rel: string;
  /** Host path. */
  abs: string;
  /** lstat of the final component, undefined when it does not exist. */
  stat: Stats | undefined;
  /** Components (from the end) that do not exist yet; 0 when the path exists. */
  missingDepth: number;
}

export class Workspace {
  /** The workspace root on this machine, symlinks resolved. */
  readonly root: string;

  constructor(
    root: string,
    /** Where tenants see the workspace; absolute tenant paths and symlink targets are read against it. */
    readonly mountPoint = '/work',
  ) {
    this.root = realpathSync(root);
  }

  /** The tenant-facing path for a workspace-relative one (for messages and results). */
  display(rel: string): string {
    return rel === '' ? '.' : rel;
  }

  hostPath(rel: string): string {
    return rel === '' ? this.root : `${this.root}/${rel}`;
  }

  resolve(input: string, opts: ResolveOptions = {}): ResolvedPath {
    const followFinal = opts.followFinal ?? true;
    const missing = opts.missing ?? 'none';
    let pending = this.lexical(input, input);
    const done: string[] = [];
    let stat: Stats | undefined = this.lstat(this.root, input);
    let hops = 0;
    let missingDepth = 0;

    while (pending.length > 0) {
      const c = pending.shift() as string;
      if (c === '..') {
        if (done.length === 0) throw outside(input, 'a symlink on the path leads above the workspace root');
        done.pop();
        stat = undefined;
        if (missingDepth > 0) missingDepth--;
        continue;
      }
      const isLast = pending.length === 0;
      if (missingDepth > 0) {
        // Below a missing directory nothing exists and no symlink can intervene.
        done.push(c);
        missingDepth++;
        continue;
      }
      const abs = this.hostPath(done.length ? `${done.join('/')}/${c}` : c);
      const st = this.lstat(abs, input);
      if (!st) {
        if (missing === 'none' || (missing === 'final' && !isLast)) {
          throw new HutchError('not_found', `no such file or directory: ${input}`, { path: input, missing: [...done, c].join('/') });
        }
        done.push(c);
        missingDepth = 1;
        stat = undefined;
        continue;
      }
      if (st.isSymbolicLink() && (!isLast || followFinal)) {
        if (++hops > MAX_SYMLINK_HOPS) throw outside(input, 'too many levels of symbolic links');
        const target = readlinkSync(abs);
        if (target.startsWith('/')) {
          pending = [...this.lexical(target, input, true), ...pending];
          done.length = 0;
        } else {
          pending = [...splitParts(target), ...pending];
        }
        continue;
      }
      if (!isLast && !st.isDirectory()) {
        throw new HutchError('not_a_directory', `not a directory: ${[...done, c].join('/')} (in ${input})`, { path: input });
      }
      done.push(c);
      stat = st;
    }
    const rel = done.join('/');
    return { rel, abs: this.hostPath(rel), stat: missingDepth > 0 ? undefined : stat, missingDepth };
  }

  /**
   * Lexically normalises a tenant path (or an absolute symlink target) into components
   * below the root. `..` may appear only where it stays inside; it is kept for symlink
   * targets only because there it must be applied after the link's directory is known.
   */
  private lexical(p: string, input: string, isLinkTarget = false): string[] {
    if (p.includes('\0')) throw new HutchError('bad_request', 'path contains a NUL byte', { path: input });
    let rest = p;
    if (p.startsWith('/')) {
      const mp = this.mountPoint;
      if (p === mp || p === `${mp}/`) rest = '';
      else if (p.startsWith(`${mp}/`)) rest = p.slice(mp.length + 1);
      else {
        throw outside(input, isLinkTarget ? `a symlink on the path points to ${p}, outside ${mp}` : `absolute path outside ${mp}`);
      }
    }
    const out: string[] = [];
    for (const c of splitParts(rest)) {
      if (c === '..') {
        if (out.length === 0) throw outside(input, '`..` leads above the workspace root');
        out.pop();
      } else out.push(c);
    }
    return out;
  }

  private lstat(abs: string, input: string): Stats | undefined {
    try {
      return lstatSync(abs);
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code;
      if (code === 'ENOENT') return undefined;
      if (code === 'ENOTDIR') throw new HutchError('not_a_directory', `a component of ${input} is not a directory`, { path: input });
      if (code === 'EACCES') throw new HutchError('permission_denied', `permission denied: ${input}`, { path: input });
      throw err;
    }
  }
}

function splitParts(p: string): string[] {
  return p.split('/').filter((c) => c !== '' && c !== '.');
}

function outside(input: string, why: string): HutchError {
  return new HutchError('outside_workspace', `${input} is outside the workspace: ${why}`, { path: input });
}
