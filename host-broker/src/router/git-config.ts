/**
 * Can git, run on the fast path in this workspace, be made to start a program the
 * repository names? The router proves commands read-only by their words, but git also
 * obeys the repository's own configuration: `core.fsmonitor` runs a program on `git
 * status`, `diff.external` and `diff.<driver>.textconv` on `git diff`/`log -p`, filters on
 * any index refresh, `log.showSignature` runs gpg, and `include.path` can pull any of these
 * in from a file elsewhere. Driver names are the repository's choice, so no fixed list of
 * `-c` overrides can switch them all off (and git has no "ignore repository config"):
 * a repository whose configuration names a program goes to the VM instead. The fast path
 * additionally pins the keys that can be pinned (fast-path.ts BASE_ENV: fsmonitor, hooks,
 * pager, optional locks), as a second layer.
 *
 * Reads only inside the workspace, through directory fds from its root, never through a
 * symlink (a `.git` or config that is a symlink is itself a reason for the VM). Everything
 * it reads is the tenant's, so everything is bounded: a configuration file over
 * MAX_CONFIG_BYTES, or a search past MAX_ENTRIES entries, sends git to the VM instead of
 * being read; and the walks yield to the event loop. A 230 MB `.git/config` held the
 * broker's loop for 12 s per `git status` (every tenant waiting), a `.git/modules` of
 * 200,000 files for 0.9 s.
 */
import { at, closeQuietly, lstatAt, openDirAt } from '../../../guest-agent/src/workspace/fd-path.ts';
import { openSyncRoot, readSmallFile } from '../../../guest-agent/src/workspace/sync-path.ts';
import { walk } from '../../../guest-agent/src/workspace/walk.ts';
import { LoopSlicer } from '../../../guest-agent/src/workspace/work-budget.ts';

/** Keys whose value is a program, a command line or a path git executes. */
const PROGRAM_KEYS: RegExp[] = [
  /^core\.(fsmonitor|pager|sshcommand|editor|askpass|hookspath|worktree|gitproxy)$/,
  /^diff\.external$/,
  /^diff\..+\.(textconv|command)$/,
  /^merge\..+\.driver$/,
  /^filter\..+\.(clean|smudge|process)$/,
  /^pager\..+$/,
  /^alias\..+$/,
  /^gpg\.(program|.+\.program)$/,
  /^log\.showsignature$/,
  /^credential\.(.+\.)?helper$/,
  /^sequence\.editor$/,
  /^(include\.path|includeif\..+\.path)$/,
  /^uploadpack\.packobjectshook$/,
  /^remote\..+\.(uploadpack|receivepack|proxy)$/,
  /^submodule\..+\.update$/,
  /^interactive\.difffilter$/,
];

/** Values that leave a boolean-ish key off (core.fsmonitor=false is common and harmless). */
const OFF = new Set(['false', 'no', 'off', '0', '']);

/** Nested repositories are looked for this many directories deep. */
const MAX_DEPTH = 4;
/** Directory entries one check may look at (nested search, .git/modules, hooks together). */
export const MAX_ENTRIES = 50_000;
/** A configuration file larger than this is not read: git's own are a few KiB. */
export const MAX_CONFIG_BYTES = 256 * 1024;
const SKIP_DIRS = new Set(['node_modules', '.venv', 'venv', '__pycache__', 'target', 'dist', 'build', '.cache']);
const GIT = Buffer.from('.git');
const CONFIG = 'config';

/** Thrown inside a check when it has looked at MAX_ENTRIES entries. */
class TooManyEntries extends Error {}

/** Counts what one check looks at and yields the loop between slices. */
class CheckBudget {
  private seen = 0;
  private readonly slicer = new LoopSlicer();
  readonly tick = async (): Promise<void> => {
    if (++this.seen > MAX_ENTRIES) throw new TooManyEntries();
    await this.slicer.tick();
  };
}

/**
 * A reason to keep git off the fast path in this workspace, or null. `nested`: also look
 * for repositories below the root (the command changes directory).
 */
export async function gitConfigHazard(workspace: string, opts: { nested?: boolean } = {}): Promise<string | null> {
  const rootFd = openSyncRoot(workspace);
  const budget = new CheckBudget();
  try {
    const root = await repoHazard(rootFd, '', budget);
    if (root || !opts.nested) return root;
    const walker = walk(rootFd, {
      skipDirs: SKIP_DIRS,
      // Look into each `.git` only through repoHazard; list directories down to MAX_DEPTH.
      skip: (rel, type) => rel.startsWith('.git/') || rel.includes('/.git/') || (type === 'dir' && depthOf(rel) > MAX_DEPTH),
      tick: budget.tick,
    });
    for await (const e of walker) {
      if (!e.name.equals(GIT) || e.rel === '.git') continue; // the root's was checked first
      const why = await repoHazard(e.dirFd, e.rel.slice(0, -'/.git'.length), budget);
      if (why) return why;
    }
    return null;
  } catch (err) {
    if (err instanceof TooManyEntries) return `the workspace has too many entries to check every repository's git configuration (over ${MAX_ENTRIES})`;
    throw err;
  } finally {
    closeQuietly(rootFd);
  }
}

function depthOf(rel: string): number {
  let n = 1;
  for (let i = rel.indexOf('/'); i !== -1; i = rel.indexOf('/', i + 1)) n++;
  return n;
}

/** The hazard of the repository whose work tree is the directory `dirFd` (`rel` in the workspace), if it has a .git. */
async function repoHazard(dirFd: number, rel: string, budget: CheckBudget): Promise<string | null> {
  const where = rel ? `${rel}/.git` : '.git';
  const st = lstatAt(dirFd, GIT);
  if (!st) return null;
  if (st.isSymbolicLink()) return `${where} is a symlink`;
  // A gitfile (worktree, submodule checkout) points git at a directory elsewhere.
  if (!st.isDirectory()) return `${where} is a file pointing at another git directory`;
  let gitFd: number;
  try {
    gitFd = openDirAt(dirFd, GIT);
  } catch {
    return `${where} changed while its configuration was checked`;
  }
  try {
    for (const c of [CONFIG, 'config.worktree']) {
      const why = configHazard(gitFd, c, `${where}/${c}`);
      if (why) return why;
    }
    const modules = await subtree(gitFd, 'modules', budget, async (e) => (e.type !== 'dir' && e.name.toString() === CONFIG ? configHazard(e.dirFd, CONFIG, `${where}/modules/${e.rel}`) : null));
    if (modules) return modules;
    return await subtree(gitFd, 'hooks', budget, async (e) => (e.rel.includes('/') || e.rel.endsWith('.sample') ? null : `${where}/hooks/${e.rel} is a hook git could run`));
  } finally {
    closeQuietly(gitFd);
  }
}

/** The first non-null answer of `check` over the entries under `.git/<name>`, if it is a directory. */
async function subtree(gitFd: number, name: string, budget: CheckBudget, check: (e: { rel: string; name: Buffer; type: string; dirFd: number }) => Promise<string | null>): Promise<string | null> {
  let fd: number;
  try {
    fd = openDirAt(gitFd, Buffer.from(name));
  } catch {
    return null; // missing or not a directory: git does not use it
  }
  try {
    for await (const e of walk(fd, { tick: budget.tick })) {
      const why = await check(e);
      if (why) return why;
    }
    return null;
  } finally {
    closeQuietly(fd);
  }
}

/** The hazard of one configuration file in the held directory, if it exists. */
function configHazard(dirFd: number, name: string, where: string): string | null {
  const raw = Buffer.from(name);
  const st = lstatAt(dirFd, raw);
  if (!st) return null;
  if (!st.isFile()) return `${where} is not a regular file`;
  if (st.size > MAX_CONFIG_BYTES) return `${where} is ${st.size} bytes, over the ${MAX_CONFIG_BYTES} this check reads`;
  const text = readSmallFile(at(dirFd, raw), MAX_CONFIG_BYTES);
  if (!text) return `${where} changed while it was checked`;
  const key = programKey(text.toString('utf8'));
  return key ? `${where} sets ${key}, which makes git run a program` : null;
}

/** The first configuration key in `text` that names a program, or null. */
export function programKey(text: string): string | null {
  let section = '';
  const lines = text.replace(/\\\r?\n/g, ' ').split(/\r?\n/);
  for (const raw of lines) {
    const line = raw.trim();
    if (!line || line.startsWith('#') || line.startsWith(';')) continue;
    const head = /^\[\s*([^\]\s"]+)(?:\s+"((?:[^"\\]|\\.)*)")?\s*\](.*)$/.exec(line);
    if (head) {
      const [, name, sub, rest] = head;
      section = sub !== undefined ? `${(name as string).toLowerCase()}.${sub}` : (name as string).toLowerCase();
      // `[core] fsmonitor = x` on one line.
      const inline = (rest ?? '').trim();
      if (inline) {
        const k = checkEntry(section, inline);
        if (k) return k;
      }
      continue;
    }
    const k = checkEntry(section, line);
    if (k) return k;
  }
  return null;
}

function checkEntry(section: string, line: string): string | null {
  const m = /^([A-Za-z][A-Za-z0-9-]*)\s*(?:=\s*(.*))?$/.exec(line);
  if (!m) return null;
  // Section names are case-insensitive, subsections are not, keys are: compare lowercased.
  const key = `${section}.${(m[1] as string).toLowerCase()}`.toLowerCase();
  if (!PROGRAM_KEYS.some((re) => re.test(key))) return null;
  const value = (m[2] ?? 'true').replace(/\s*[#;].*$/, '').replace(/^"(.*)"$/, '$1').trim().toLowerCase();
  if ((key === 'core.fsmonitor' || key === 'log.showsignature') && OFF.has(value)) return null;
  return key;
}
