/**
 * Can git, run on the fast path in this workspace, be made to start a program the tenant
 * names? The router proves commands read-only by their words, but git also obeys
 * configuration: `core.fsmonitor` runs a program on `git status`, `diff.external` and
 * `diff.<driver>.textconv` on `git diff`/`log -p`, filters on any index refresh,
 * `include.path` pulls any of these in from elsewhere. The fast path reads no system or
 * global configuration at all (fast-path.ts GIT_PINNED) and pins every key with a fixed
 * name from the command line's scope, which outranks the repository's; driver names are
 * the repository's choice, so no fixed list of overrides can switch them off. What is left
 * is every repository git can open from where it runs, and this reads each one's
 * configuration as git would (git-config-parse.ts): a repository that names a program, or
 * one this cannot read, sends the call to the VM.
 *
 * Which repositories: for each directory the command runs git in (the classifier's
 * `gitDirs`, from parsed words), the `.git` of it and of every directory above it up to
 * the workspace root (git's discovery), a directory there that is itself a bare
 * repository, what a `gitdir:` file or `commondir` points at, and, through the index's
 * gitlinks, every populated submodule below, recursively (`git status` and `git diff` run a
 * child git in each). The classifier sends git to the VM when the same command writes
 * workspace files (it could write what git reads), and the session holds the other
 * writers (uploads, E2B file calls, a VM's release pull) off while a fast-path git runs, so
 * what is read here is what git reads.
 *
 * Reads only inside the workspace, through directory fds from its root, never through a
 * symlink (a symlink on any of these paths is itself a reason for the VM). Everything it
 * reads is the tenant's, so everything is bounded: a configuration file over
 * MAX_CONFIG_BYTES, an index over MAX_INDEX_BYTES, more than MAX_REPOSITORIES repositories
 * or MAX_ENTRIES directory entries send git to the VM instead of being read; the walks
 * yield to the event loop. A 230 MB `.git/config` held the broker's loop for 12 s per `git
 * status` (every tenant waiting), a `.git/modules` of 200,000 files for 0.9 s.
 */
import { constants } from 'node:fs';
import { at, closeQuietly, lstatAt, openDirAt, openFileAt, reopenDir } from '../../../guest-agent/src/workspace/fd-path.ts';
import { nameFromBytes } from '../../../guest-agent/src/workspace/names.ts';
import { openSyncRoot, readSmallFile } from '../../../guest-agent/src/workspace/sync-path.ts';
import { walk } from '../../../guest-agent/src/workspace/walk.ts';
import { LoopSlicer } from '../../../guest-agent/src/workspace/work-budget.ts';
import { parseGitConfig, type ConfigEntry } from './git-config-parse.ts';
import { indexGitlinks } from './git-index.ts';
import { WORKSPACE_MOUNT } from './paths.ts';

/**
 * Keys whose value is a program, a command line, or a way to more configuration or to a
 * transport that runs one, by section: keys without a subsection (`plain`) and with one
 * (`sub`); '*' is every key.
 */
const PROGRAM_KEYS: Record<string, { plain?: ReadonlySet<string> | '*'; sub?: ReadonlySet<string> | '*' }> = {
  core: { plain: new Set(['fsmonitor', 'pager', 'sshcommand', 'editor', 'askpass', 'hookspath', 'worktree', 'gitproxy', 'alternaterefscommand']) },
  diff: { plain: new Set(['external']), sub: new Set(['textconv', 'command']) },
  merge: { sub: new Set(['driver']) },
  filter: { sub: new Set(['clean', 'smudge', 'process']) },
  difftool: { sub: new Set(['cmd', 'path']) },
  mergetool: { sub: new Set(['cmd', 'path']) },
  man: { sub: new Set(['cmd', 'path']) },
  browser: { sub: new Set(['cmd', 'path']) },
  web: { plain: new Set(['browser']) },
  pager: { plain: '*' },
  alias: { plain: '*', sub: '*' },
  // `--pretty=<name>` formats, which may hold `%G?` (a gpg run).
  pretty: { plain: '*' },
  gpg: { plain: '*', sub: '*' },
  log: { plain: new Set(['showsignature']) },
  credential: { plain: new Set(['helper']), sub: new Set(['helper']) },
  sequence: { plain: new Set(['editor']) },
  include: { plain: new Set(['path']) },
  includeif: { sub: new Set(['path']) },
  uploadpack: { plain: '*' },
  // A promisor remote is fetched from on demand (a partial clone's missing objects).
  remote: { sub: new Set(['uploadpack', 'receivepack', 'proxy', 'vcs', 'promisor', 'partialclonefilter']) },
  extensions: { plain: new Set(['partialclone']) },
  url: { sub: new Set(['insteadof', 'pushinsteadof']) },
  protocol: { plain: '*', sub: '*' },
  submodule: { sub: new Set(['update']) },
  interactive: { plain: new Set(['difffilter']) },
  trailer: { sub: new Set(['command', 'cmd']) },
};

/** Values that leave a boolean-ish key off (core.fsmonitor=false is common and harmless). */
const OFF = new Set(['false', 'no', 'off', '0', '']);
const OFF_KEYS = new Set(['core.fsmonitor', 'log.showsignature']);

/** Directory entries one check may look at (.git/modules and hooks together). */
export const MAX_ENTRIES = 50_000;
/** A configuration file larger than this is not read: git's own are a few KiB. */
export const MAX_CONFIG_BYTES = 256 * 1024;
/** An index larger than this is not read for submodules (about 300,000 tracked files). */
export const MAX_INDEX_BYTES = 32 * 1024 * 1024;
/** Repositories one check may read (discovery, gitdir files, submodules). */
export const MAX_REPOSITORIES = 64;
/** Submodules within submodules, as deep as this. */
const MAX_NESTING = 8;
/** A gitdir or commondir file is one line. */
const MAX_POINTER_BYTES = 4096;

const GIT = Buffer.from('.git');
const DOT = Buffer.from('.');
const DOTDOT = Buffer.from('..');
const GITDIR = Buffer.from('gitdir: ');
const COMMONDIR = Buffer.from('commondir');
const INDEX = Buffer.from('index');
const HASH_BYTES: Record<string, number> = { sha1: 20, sha256: 32 };

/** Where git may run: workspace-relative directories ('' is the root), as the classifier found them. */
export interface GitReach {
  dirs: readonly string[];
}

/** Thrown inside a check when it has read all it may; the message is the reason for the VM. */
class Exhausted extends Error {}

/** A reason to keep git off the fast path in this workspace for a command that runs git in `reach.dirs`, or null. */
export async function gitConfigHazard(workspace: string, reach: GitReach): Promise<string | null> {
  const rootFd = openSyncRoot(workspace);
  const check = new RepoCheck(rootFd);
  try {
    for (const dir of reach.dirs) {
      const why = await check.fromDirectory(dir);
      if (why) return why;
    }
    return null;
  } catch (err) {
    if (err instanceof Exhausted) return err.message;
    throw err;
  } finally {
    closeQuietly(rootFd);
  }
}

/** A directory reached from the root without a symlink: its fd (the caller's to close) and its components. */
type Reached = { fd: number; parts: Buffer[] } | { missing: true } | { hazard: string };

const SLASH = 0x2f;
const MOUNT = Buffer.from(WORKSPACE_MOUNT);

class RepoCheck {
  private readonly checked = new Set<string>();
  private entries = 0;
  private readonly slicer = new LoopSlicer();

  constructor(private readonly rootFd: number) {}

  readonly tick = async (): Promise<void> => {
    if (++this.entries > MAX_ENTRIES) throw new Exhausted(`the repositories hold too many entries to check their git configuration (over ${MAX_ENTRIES})`);
    await this.slicer.tick();
  };

  /** git run in `dir`: its repository is found by looking there and in every directory above. */
  async fromDirectory(dir: string): Promise<string | null> {
    const r = this.reach([], Buffer.from(dir), 'refuse');
    if ('missing' in r) return null; // git cannot run there: the `cd` or `-C` fails
    if ('hazard' in r) return r.hazard;
    closeQuietly(r.fd);
    for (let n = r.parts.length; n >= 0; n--) {
      const parts = r.parts.slice(0, n);
      const d = this.reach(parts, Buffer.alloc(0), 'refuse');
      if (!('fd' in d)) return 'hazard' in d ? d.hazard : null;
      try {
        const why = await this.repository(d.fd, parts, 0, true);
        if (why) return why;
      } finally {
        closeQuietly(d.fd);
      }
    }
    return null;
  }

  /**
   * Follows `path` (relative to `base`, or absolute under /work) one component at a time
   * from the root, never through a symlink; `..` goes back up what was reached, so it
   * means the same here as to the kernel. `.git` components are refused where git would
   * run in them (the classifier's directories, submodule paths).
   */
  private reach(base: readonly Buffer[], path: Buffer, gitComponents: 'refuse' | 'allow'): Reached {
    let comps: Buffer[];
    if (path[0] === SLASH) {
      const rest = path.subarray(MOUNT.length);
      if (!path.subarray(0, MOUNT.length).equals(MOUNT) || (rest.length > 0 && rest[0] !== SLASH)) return { hazard: `\`${nameFromBytes(path)}\` is outside the workspace` };
      comps = split(rest);
    } else comps = [...base, ...split(path)];
    const parts: Buffer[] = [];
    const fds: number[] = [this.rootFd];
    const top = () => fds[fds.length - 1] as number;
    try {
      for (const c of comps) {
        if (c.length === 0 || (c.length === 1 && c[0] === 0x2e)) continue;
        if (c.equals(DOTDOT)) {
          if (parts.length === 0) return { hazard: `\`${nameFromBytes(path)}\` climbs out of the workspace` };
          parts.pop();
          closeQuietly(fds.pop() as number);
          continue;
        }
        const where = show([...parts, c]);
        if (gitComponents === 'refuse' && c.equals(GIT)) return { hazard: `git would run inside ${where}` };
        const st = lstatAt(top(), c);
        if (!st || (!st.isDirectory() && !st.isSymbolicLink())) return { missing: true };
        if (st.isSymbolicLink()) return { hazard: `${where} is a symlink` };
        fds.push(openDirAt(top(), c));
        parts.push(c);
      }
      return { fd: fds.length === 1 ? reopenDir(this.rootFd) : (fds.pop() as number), parts };
    } catch {
      return { hazard: `${show(parts) || 'the workspace'} changed while its git configuration was checked` };
    } finally {
      for (const fd of fds.slice(1)) closeQuietly(fd);
    }
  }

  /**
   * The repository whose work tree is the held directory `parts`, if it has one: a `.git`
   * directory or gitdir file, or, where git discovers one, the directory being a bare
   * repository itself.
   */
  private async repository(dirFd: number, parts: Buffer[], nesting: number, discovered: boolean): Promise<string | null> {
    const where = show([...parts, GIT]);
    const st = lstatAt(dirFd, GIT);
    if (!st) return discovered && looksBare(dirFd) ? `${show(parts) || 'the workspace root'} is a bare repository git would use` : null;
    if (st.isSymbolicLink()) return `${where} is a symlink`;
    let g: Reached;
    if (st.isDirectory()) g = this.reach([...parts, GIT], Buffer.alloc(0), 'allow');
    else {
      const target = st.isFile() ? pointer(at(dirFd, GIT), GITDIR) : null;
      if (target === null) return `${where} is neither a directory nor a gitdir file this check can read`;
      g = this.reach(parts, target, 'allow');
    }
    if ('missing' in g) return null; // not a repository git can open
    if ('hazard' in g) return g.hazard;
    try {
      return await this.gitDirectory(g.fd, g.parts, parts, nesting);
    } finally {
      closeQuietly(g.fd);
    }
  }

  /** The held git directory `gitParts`, whose work tree is `worktree`. */
  private async gitDirectory(gitFd: number, gitParts: Buffer[], worktree: Buffer[], nesting: number): Promise<string | null> {
    const key = show(gitParts);
    if (this.checked.has(key)) return null;
    this.checked.add(key);
    if (this.checked.size > MAX_REPOSITORIES) throw new Exhausted(`git could reach more than ${MAX_REPOSITORIES} repositories from here, more than this check reads`);
    const dirs: Array<{ fd: number; where: string }> = [{ fd: gitFd, where: key }];
    // A commondir (a linked worktree's, or a hand-made one): its config, hooks and modules are the ones git uses.
    let common: Reached | undefined;
    const commondir = lstatAt(gitFd, COMMONDIR);
    if (commondir) {
      const to = commondir.isFile() ? pointer(at(gitFd, COMMONDIR), Buffer.alloc(0)) : null;
      if (to === null) return `${key}/commondir is not a file this check can read`;
      common = this.reach(gitParts, to, 'allow');
      if ('hazard' in common) return common.hazard;
      if ('fd' in common) dirs.push({ fd: common.fd, where: show(common.parts) });
    }
    try {
      let objectFormat: string | undefined;
      for (const d of dirs) {
        for (const name of ['config', 'config.worktree']) {
          const c = configHazard(d.fd, name, `${d.where}/${name}`);
          if (typeof c === 'string') return c;
          objectFormat ??= c.objectFormat;
        }
      }
      for (const d of dirs) {
        const modules = await this.subtree(d.fd, 'modules', async (e) => {
          if (e.type === 'dir' || e.name.toString() !== 'config') return null;
          const c = configHazard(e.dirFd, 'config', `${d.where}/modules/${e.rel}`);
          return typeof c === 'string' ? c : null;
        });
        if (modules) return modules;
        const hooks = await this.subtree(d.fd, 'hooks', async (e) => (e.rel.includes('/') || e.rel.endsWith('.sample') ? null : `${d.where}/hooks/${e.rel} is a hook git could run`));
        if (hooks) return hooks;
      }
      return await this.submodules(gitFd, key, worktree, objectFormat ?? 'sha1', nesting);
    } finally {
      if (common && 'fd' in common) closeQuietly(common.fd);
    }
  }

  /** Every populated submodule the index of the git directory `gitFd` lists, checked as a repository of its own. */
  private async submodules(gitFd: number, where: string, worktree: Buffer[], objectFormat: string, nesting: number): Promise<string | null> {
    const hashBytes = HASH_BYTES[objectFormat.toLowerCase()];
    if (hashBytes === undefined) return `${where} uses object format ${objectFormat}, which this check does not read`;
    const links = await indexGitlinksOf(gitFd, where, hashBytes);
    if (typeof links === 'string') return links;
    for (const link of links) {
      if (link[0] === SLASH || split(link).some((c) => c.length === 0 || c.equals(DOT) || c.equals(DOTDOT) || c.toString('latin1').toLowerCase() === '.git')) {
        return `${where}/index lists a submodule at \`${nameFromBytes(link)}\`, a path git would refuse`;
      }
      if (nesting >= MAX_NESTING) return `submodules nest more than ${MAX_NESTING} deep below ${show(worktree) || 'the workspace root'}`;
      const d = this.reach(worktree, link, 'refuse');
      if ('missing' in d) continue; // not checked out: git does not look into it
      if ('hazard' in d) return d.hazard;
      try {
        const why = await this.repository(d.fd, d.parts, nesting + 1, false);
        if (why) return why;
      } finally {
        closeQuietly(d.fd);
      }
    }
    return null;
  }

  /** The first non-null answer of `check` over the entries under `<git dir>/<name>`, if it is a directory. */
  private async subtree(gitFd: number, name: string, check: (e: { rel: string; name: Buffer; type: string; dirFd: number }) => Promise<string | null>): Promise<string | null> {
    let fd: number;
    try {
      fd = openDirAt(gitFd, Buffer.from(name));
    } catch {
      return null; // missing or not a directory: git does not use it
    }
    try {
      for await (const e of walk(fd, { tick: this.tick })) {
        const why = await check(e);
        if (why) return why;
      }
      return null;
    } finally {
      closeQuietly(fd);
    }
  }
}

/**
 * The gitlinks an index lists, by the index's identity (device, inode, size, ctime: a write
 * or a rename changes one of them, and no tenant can set a ctime), so the index of a
 * repository that has not changed is not read again for every git call: 20,000 entries
 * cost about 10 ms of the loop.
 */
const gitlinkCache = new Map<string, { stamp: string; paths: Buffer[] }>();
const GITLINK_CACHE_ENTRIES = 256;

/** The gitlinks of a held git directory's index (none without one), or why they are not read; at most MAX_INDEX_BYTES, read on the thread pool. */
async function indexGitlinksOf(gitFd: number, where: string, hashBytes: number): Promise<Buffer[] | string> {
  const st = lstatAt(gitFd, INDEX);
  if (!st) return [];
  if (!st.isFile()) return `${where}/index is not a regular file`;
  let fh;
  try {
    fh = await openFileAt(gitFd, INDEX, constants.O_RDONLY | constants.O_NONBLOCK);
  } catch {
    return `${where}/index changed while it was checked`;
  }
  try {
    const before = await fh.stat({ bigint: true });
    if (!before.isFile()) return `${where}/index is not a regular file`;
    if (before.size > BigInt(MAX_INDEX_BYTES)) return `${where}/index is ${before.size} bytes, over the ${MAX_INDEX_BYTES} this check reads for submodules`;
    const id = `${before.dev}:${before.ino}`;
    const stamp = `${before.size}:${before.ctimeNs}:${hashBytes}`;
    const hit = gitlinkCache.get(id);
    if (hit?.stamp === stamp) return hit.paths;
    const buf = Buffer.allocUnsafe(Number(before.size) + 1);
    let filled = 0;
    for (;;) {
      const { bytesRead } = await fh.read(buf, filled, buf.length - filled, filled);
      if (bytesRead === 0) break;
      filled += bytesRead;
      if (filled === buf.length) break;
    }
    const after = await fh.stat({ bigint: true });
    if (filled !== Number(before.size) || after.ctimeNs !== before.ctimeNs || after.size !== before.size) return `${where}/index changed while it was checked`;
    const links = await indexGitlinks(buf.subarray(0, filled), hashBytes);
    if (!links.ok) return `${where}/index cannot be read for submodules: ${links.error}`;
    gitlinkCache.delete(id);
    gitlinkCache.set(id, { stamp, paths: links.paths });
    if (gitlinkCache.size > GITLINK_CACHE_ENTRIES) gitlinkCache.delete(gitlinkCache.keys().next().value as string);
    return links.paths;
  } finally {
    await fh.close();
  }
}

function split(path: Buffer): Buffer[] {
  const out: Buffer[] = [];
  let start = 0;
  for (let i = path.indexOf(SLASH); i !== -1; i = path.indexOf(SLASH, start)) {
    out.push(path.subarray(start, i));
    start = i + 1;
  }
  out.push(path.subarray(start));
  return out;
}

function show(parts: readonly Buffer[]): string {
  return parts.map((p) => nameFromBytes(p)).join('/');
}

/**
 * Roughly git's test for a directory that is a repository itself (a HEAD, and objects
 * there or through a commondir). git is pinned to refuse such a repository on the fast
 * path (safe.bareRepository=explicit), so this only keeps the answer the VM's.
 */
function looksBare(dirFd: number): boolean {
  return lstatAt(dirFd, Buffer.from('HEAD')) !== undefined && (lstatAt(dirFd, Buffer.from('objects')) ?? lstatAt(dirFd, COMMONDIR)) !== undefined;
}

/** The path a one-line pointer file holds (`gitdir: <path>`, a commondir), line ends trimmed as git trims them; null if unreadable. */
function pointer(path: Buffer, prefix: Buffer): Buffer | null {
  const raw = readSmallFile(path, MAX_POINTER_BYTES);
  if (!raw) return null;
  let end = raw.length;
  while (end > 0 && (raw[end - 1] === 0x0a || raw[end - 1] === 0x0d)) end--;
  const line = raw.subarray(0, end);
  if (!line.subarray(0, prefix.length).equals(prefix) || line.includes(0x0a) || line.includes(0)) return null;
  const to = line.subarray(prefix.length);
  return to.length === 0 ? null : to;
}

/** The hazard of one configuration file in the held directory, or its object format (absent: none said). */
function configHazard(dirFd: number, name: string, where: string): string | { objectFormat: string | undefined } {
  const raw = Buffer.from(name);
  const st = lstatAt(dirFd, raw);
  if (!st) return { objectFormat: undefined };
  if (!st.isFile()) return `${where} is not a regular file`;
  if (st.size > MAX_CONFIG_BYTES) return `${where} is ${st.size} bytes, over the ${MAX_CONFIG_BYTES} this check reads`;
  const text = readSmallFile(at(dirFd, raw), MAX_CONFIG_BYTES);
  if (!text) return `${where} changed while it was checked`;
  const parsed = parseGitConfig(text.toString('latin1'));
  if (!parsed.ok) return `${where} cannot be read the way git reads it (${parsed.error})`;
  const key = firstProgramKey(parsed.entries);
  if (key) return `${where} sets ${key}, which makes git run a program`;
  return { objectFormat: parsed.entries.findLast((e) => e.section === 'extensions' && e.sub === null && e.key === 'objectformat')?.value ?? undefined };
}

function firstProgramKey(entries: readonly ConfigEntry[]): string | null {
  for (const e of entries) {
    const rule = PROGRAM_KEYS[e.section];
    const keys = e.sub === null ? rule?.plain : rule?.sub;
    if (!keys || (keys !== '*' && !keys.has(e.key))) continue;
    const name = e.sub === null ? `${e.section}.${e.key}` : `${e.section}.${e.sub}.${e.key}`;
    if (e.sub === null && OFF_KEYS.has(name) && OFF.has((e.value ?? 'true').trim().toLowerCase())) continue;
    return name;
  }
  return null;
}

/** The first configuration key in `text` that names a program, `unreadable: ...` when git's syntax does not hold, or null. */
export function programKey(text: string): string | null {
  const parsed = parseGitConfig(text);
  return parsed.ok ? firstProgramKey(parsed.entries) : `unreadable: ${parsed.error}`;
}
