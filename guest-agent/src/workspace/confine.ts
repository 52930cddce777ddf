import { closeSync, constants, fchownSync, fstatSync, openSync, realpathSync, type Stats } from 'node:fs';
import { HutchError } from '../protocol/errors.ts';
import { assertProcfs, closeQuietly, isPlainName, joinNames, lstatAt, mkdirAt, openDirAt, readlinkAt, reopenDir } from './fd-path.ts';
import { nameFromBytes, nameToBytes } from './names.ts';

/**
 * Path confinement: the one place that turns a tenant-supplied path into something inside
 * the workspace. Used by the agent in the guest and by the broker on the host.
 *
 * Tenant paths are relative to the workspace root or absolute under its mount point
 * (/work, where the workspace appears in the VM and in the fast path). They are resolved
 * like openat2(RESOLVE_IN_ROOT) with the workspace as root, but refusing instead of
 * clamping: each component is looked up relative to an already-open directory fd without
 * following symlinks (fd-path.ts says how, and why not openat2 or a mount namespace). A
 * symlink on the way is read, not followed: its target is applied to the stack of held
 * directory fds (absolute targets under the mount point restart at the root, `..` pops a
 * held fd and never walks the real `..`), so a link that points out of the workspace,
 * directly, through another link, through `..` or through /proc/self/root, is refused with
 * `outside_workspace`.
 *
 * Safety does not rest on the tree holding still: a tenant process swapping a directory for
 * a symlink (renameat2 RENAME_EXCHANGE in a loop) while a tool runs can make a lookup fail,
 * never make it leave the workspace, because every step acts on the directory fd it holds.
 * Callers act on the final component through `Resolution.dirFd` + `name` the same way.
 */

const MAX_SYMLINK_HOPS = 40;
/** Retries of one component that changed kind between lstat and open (a swap in progress). */
const MAX_COMPONENT_RETRIES = 16;
const DOT = Buffer.from('.');
const DOTDOT = Buffer.from('..');

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
  /** Workspace-relative path with every symlink resolved ('' is the root); odd bytes surrogate-escaped (names.ts). */
  rel: string;
  /** The same path as raw name bytes. */
  raw: Buffer;
  /**
   * Host path, for messages and for callers that still act by path (check-then-use: a
   * tenant can swap a component after this is returned). Race-free callers use
   * `Workspace.open()` and act through its directory fd.
   */
  abs: string;
  /** lstat of the final component, undefined when it does not exist. */
  stat: Stats | undefined;
  /** Components (from the end) that do not exist yet; 0 when the path exists. */
  missingDepth: number;
}

interface Frame {
  fd: number;
  name: Buffer;
}

/**
 * A resolved path that holds open the directories leading to it. Owned by the caller:
 * `close()` it (try/finally) when done. `dirFd` + `name` address the final component the
 * way openat(dirFd, name) would, for as long as the resolution is open.
 */
export class Resolution implements ResolvedPath {
  readonly rel: string;
  readonly raw: Buffer;
  readonly abs: string;
  private closed = false;
  private ownDirFd: number | undefined;

  constructor(
    private readonly ws: Workspace,
    /** Held directories, root first; the last is the deepest existing directory on the path. */
    private readonly frames: Frame[],
    /** Final component (an entry of the last frame); undefined when the path is the root or lies below missing directories. */
    private finalName: Buffer | undefined,
    /** Components below the last frame that do not exist yet, the final one last. */
    private readonly missing: Buffer[],
    public stat: Stats | undefined,
    /** An fd on the final component when resolving already opened it as a directory. */
    dirOfFinal?: number,
  ) {
    this.ownDirFd = dirOfFinal;
    const names = frames.slice(1).map((f) => f.name);
    if (finalName) names.push(finalName);
    names.push(...missing);
    this.raw = joinNames(names);
    this.rel = nameFromBytes(this.raw);
    this.abs = ws.hostPath(this.rel);
  }

  get missingDepth(): number {
    return this.missing.length;
  }

  /** True for the workspace root itself. */
  get isRoot(): boolean {
    return this.raw.length === 0;
  }

  /** The directory holding the final component (for the root: the root). Valid until close(). */
  get dirFd(): number {
    if (this.closed) throw new Error(`resolution of ${this.rel} used after close()`);
    if (this.missing.length > 1) throw new Error('dirFd of a path with missing parents: call makeParents() first');
    return (this.frames[this.frames.length - 1] as Frame).fd;
  }

  /** The final component's raw name; throws for the root, which has no name in the workspace. */
  get name(): Buffer {
    if (this.missing.length > 0) return this.missing[this.missing.length - 1] as Buffer;
    if (!this.finalName) throw new HutchError('bad_request', 'the workspace root has no name', { path: '.' });
    return this.finalName;
  }

  /**
   * An fd on the final component as a directory (it must be one), owned by this
   * resolution. Opened with O_NOFOLLOW from the held parent, so what was checked is what
   * is opened, or ENOTDIR.
   */
  openDir(): number {
    if (this.ownDirFd !== undefined) return this.ownDirFd;
    if (this.missing.length > 0) throw new HutchError('not_found', `no such directory: ${this.ws.display(this.rel)}`, { path: this.rel });
    this.ownDirFd = this.finalName ? openDirAt(this.dirFd, this.finalName) : reopenDir(this.dirFd);
    return this.ownDirFd;
  }

  /**
   * Creates the missing directories below the deepest existing one (all of them with
   * `includeFinal`), each with mkdir in the held parent and then opened with O_NOFOLLOW,
   * so a symlink planted in between is refused rather than followed.
   */
  makeParents(mode: number, owner: { uid: number; gid: number } | undefined, includeFinal = false): void {
    const keep = includeFinal ? 0 : 1;
    let created = 0;
    while (this.missing.length > keep) {
      created++;
      const name = this.missing.shift() as Buffer;
      const parent = (this.frames[this.frames.length - 1] as Frame).fd;
      mkdirAt(parent, name, mode);
      const fd = openDirAt(parent, name);
      this.frames.push({ fd, name });
      if (owner) fchownSync(fd, owner.uid, owner.gid);
    }
    if (includeFinal && created > 0) {
      // The final directory now exists and is the last frame; address it as an entry of its parent.
      const last = this.frames.pop() as Frame;
      this.finalName = last.name;
      this.stat = fstatSync(last.fd);
      this.ownDirFd = last.fd;
    }
  }

  close(): void {
    if (this.closed) return;
    this.closed = true;
    if (this.ownDirFd !== undefined) closeQuietly(this.ownDirFd);
    for (const f of this.frames) closeQuietly(f.fd);
  }
}

export class Workspace {
  /** The workspace root on this machine, symlinks resolved. */
  readonly root: string;
  private readonly mountBytes: Buffer;

  constructor(
    root: string,
    /** Where tenants see the workspace; absolute tenant paths and symlink targets are read against it. */
    readonly mountPoint = '/work',
  ) {
    this.root = realpathSync(root);
    this.mountBytes = Buffer.from(mountPoint.replace(/\/+$/, ''), 'utf8');
  }

  /** The tenant-facing path for a workspace-relative one (for messages and results). */
  display(rel: string): string {
    return rel === '' ? '.' : rel;
  }

  hostPath(rel: string): string {
    return rel === '' ? this.root : `${this.root}/${rel}`;
  }

  /** The host path as bytes, right for names that are not UTF-8 (where hostPath's string cannot be). */
  hostPathBytes(rel: string | Buffer): Buffer {
    const raw = typeof rel === 'string' ? nameToBytes(rel) : rel;
    return raw.length === 0 ? Buffer.from(this.root) : Buffer.concat([Buffer.from(`${this.root}/`), raw]);
  }

  /**
   * Opens the workspace root directory. The root path itself is the host's (never under a
   * tenant's control), so opening it by path is safe; everything below goes by fds.
   */
  openRoot(): number {
    assertProcfs();
    return openSync(this.root, constants.O_RDONLY | constants.O_DIRECTORY);
  }

  /** Resolves a path and returns what it found, releasing the directories it held (see ResolvedPath.abs). */
  resolve(input: string, opts: ResolveOptions = {}): ResolvedPath {
    const r = this.open(input, opts);
    r.close();
    return { rel: r.rel, raw: r.raw, abs: r.abs, stat: r.stat, missingDepth: r.missingDepth };
  }

  /** Resolves a tenant path, holding the directories on it open; the caller closes the result. */
  open(input: string, opts: ResolveOptions = {}): Resolution {
    const followFinal = opts.followFinal ?? true;
    const missingPolicy = opts.missing ?? 'none';
    let pending = this.lexical(input);
    const frames: Frame[] = [{ fd: this.openRoot(), name: Buffer.alloc(0) }];
    const missing: Buffer[] = [];
    let hops = 0;
    let retries = 0;
    try {
      while (pending.length > 0) {
        const c = pending.shift() as Buffer;
        if (c.equals(DOTDOT)) {
          if (missing.length > 0) missing.pop();
          else if (frames.length === 1) throw outside(input, 'a symlink on the path leads above the workspace root');
          else closeSync((frames.pop() as Frame).fd);
          continue;
        }
        const isLast = pending.length === 0;
        if (missing.length > 0) {
          // Below a missing directory nothing exists and no symlink can intervene.
          missing.push(c);
          continue;
        }
        const parent = (frames[frames.length - 1] as Frame).fd;
        const st = this.lstat(parent, c, input);
        if (!st) {
          if (missingPolicy === 'none' || (missingPolicy === 'final' && !isLast)) {
            throw new HutchError('not_found', `no such file or directory: ${input}`, { path: input, missing: nameFromBytes(joinNames([...frames.slice(1).map((f) => f.name), c])) });
          }
          missing.push(c);
          continue;
        }
        if (st.isSymbolicLink() && (!isLast || followFinal)) {
          if (++hops > MAX_SYMLINK_HOPS) throw outside(input, 'too many levels of symbolic links');
          let target: Buffer;
          try {
            target = readlinkAt(parent, c);
          } catch (err) {
            // No longer a symlink (swapped since lstat): look at the component again.
            if ((err as NodeJS.ErrnoException).code === 'EINVAL' || (err as NodeJS.ErrnoException).code === 'ENOENT') {
              pending.unshift(c);
              if (++retries > MAX_COMPONENT_RETRIES) throw changing(input);
              continue;
            }
            throw err;
          }
          if (target[0] === 0x2f) {
            const parts = this.absoluteTarget(target, input);
            while (frames.length > 1) closeSync((frames.pop() as Frame).fd);
            pending = [...parts, ...pending];
          } else {
            pending = [...splitRaw(target), ...pending];
          }
          continue;
        }
        if (isLast) return new Resolution(this, frames, c, missing, st);
        if (!st.isDirectory()) {
          throw new HutchError('not_a_directory', `not a directory: ${nameFromBytes(joinNames([...frames.slice(1).map((f) => f.name), c]))} (in ${input})`, { path: input });
        }
        let fd: number;
        try {
          fd = openDirAt(parent, c);
        } catch (err) {
          const code = (err as NodeJS.ErrnoException).code;
          // It stopped being a directory since lstat (a swap): O_NOFOLLOW refused it; look again.
          if (code === 'ENOTDIR' || code === 'ELOOP' || code === 'ENOENT') {
            pending.unshift(c);
            if (++retries > MAX_COMPONENT_RETRIES) throw changing(input);
            continue;
          }
          throw err;
        }
        frames.push({ fd, name: c });
      }
      // The path ended on a directory we hold (or below missing ones): address it as an entry of its parent.
      if (missing.length > 0 || frames.length === 1) return new Resolution(this, frames, undefined, missing, missing.length > 0 ? undefined : fstatSync((frames[0] as Frame).fd));
      const last = frames.pop() as Frame;
      return new Resolution(this, frames, last.name, missing, fstatSync(last.fd), last.fd);
    } catch (err) {
      for (const f of frames) closeQuietly(f.fd);
      throw mapErrno(err, input);
    }
  }

  /**
   * Lexically normalises a tenant path into components below the root, as raw names.
   * `..` may appear only where it stays inside.
   */
  private lexical(p: string): Buffer[] {
    if (p.includes('\0')) throw new HutchError('bad_request', 'path contains a NUL byte', { path: p });
    let rest = p;
    if (p.startsWith('/')) {
      const mp = this.mountPoint;
      if (p === mp || p === `${mp}/`) rest = '';
      else if (p.startsWith(`${mp}/`)) rest = p.slice(mp.length + 1);
      else throw outside(p, `absolute path outside ${mp}`);
    }
    const out: Buffer[] = [];
    for (const c of rest.split('/')) {
      if (c === '' || c === '.') continue;
      if (c === '..') {
        if (out.length === 0) throw outside(p, '`..` leads above the workspace root');
        out.pop();
      } else out.push(nameToBytes(c));
    }
    return out;
  }

  /** An absolute symlink target, read as the tenant sees it: only under the mount point, `..` applied lexically. */
  private absoluteTarget(target: Buffer, input: string): Buffer[] {
    const mp = this.mountBytes;
    const under = target.length >= mp.length && target.subarray(0, mp.length).equals(mp) && (target.length === mp.length || target[mp.length] === 0x2f);
    if (!under) throw outside(input, `a symlink on the path points to ${nameFromBytes(target)}, outside ${this.mountPoint}`);
    const out: Buffer[] = [];
    for (const c of splitRaw(target.subarray(mp.length))) {
      if (c.equals(DOTDOT)) {
        if (out.length === 0) throw outside(input, `a symlink on the path points to ${nameFromBytes(target)}, above the workspace root`);
        out.pop();
      } else out.push(c);
    }
    return out;
  }

  private lstat(parent: number, name: Buffer, input: string): Stats | undefined {
    if (!isPlainName(name)) throw new HutchError('bad_request', `invalid path component in ${input}`, { path: input });
    return lstatAt(parent, name);
  }
}

/** Components of a raw path, `.` and empty ones dropped, `..` kept (applied by the caller). */
function splitRaw(p: Buffer): Buffer[] {
  const out: Buffer[] = [];
  let start = 0;
  for (let i = 0; i <= p.length; i++) {
    if (i === p.length || p[i] === 0x2f) {
      if (i > start) {
        const c = p.subarray(start, i);
        if (!c.equals(DOT)) out.push(Buffer.from(c));
      }
      start = i + 1;
    }
  }
  return out;
}

function outside(input: string, why: string): HutchError {
  return new HutchError('outside_workspace', `${input} is outside the workspace: ${why}`, { path: input });
}

function changing(input: string): HutchError {
  return new HutchError('busy', `${input} keeps changing while being resolved; retry`, { path: input });
}

function mapErrno(err: unknown, input: string): unknown {
  if (err instanceof HutchError) return err;
  const code = (err as NodeJS.ErrnoException).code;
  if (code === 'ENOTDIR') return new HutchError('not_a_directory', `a component of ${input} is not a directory`, { path: input });
  if (code === 'EACCES') return new HutchError('permission_denied', `permission denied: ${input}`, { path: input });
  return err;
}
