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
 * Reads only inside the workspace, never through a symlink (a `.git` or config that is a
 * symlink is itself a reason for the VM).
 */
import { lstatSync, readdirSync, readFileSync, type Dirent } from 'node:fs';
import { join } from 'node:path';

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

/** Nested repositories are looked for this deep, in at most this many directories. */
const MAX_DEPTH = 4;
const MAX_DIRS = 2000;
const SKIP_DIRS = new Set(['node_modules', '.venv', 'venv', '__pycache__', 'target', 'dist', 'build', '.cache']);

/**
 * A reason to keep git off the fast path in this workspace, or null. `nested`: also look
 * for repositories below the root (the command changes directory).
 */
export function gitConfigHazard(workspace: string, opts: { nested?: boolean } = {}): string | null {
  const root = repoHazard(workspace, '');
  if (root) return root;
  if (!opts.nested) return null;
  let dirs = 0;
  const queue: Array<{ rel: string; depth: number }> = [{ rel: '', depth: 0 }];
  while (queue.length) {
    const { rel, depth } = queue.shift() as { rel: string; depth: number };
    if (++dirs > MAX_DIRS) return `the workspace has too many directories to check every repository's git configuration (over ${MAX_DIRS})`;
    let entries: Dirent[];
    try {
      entries = readdirSync(join(workspace, rel), { withFileTypes: true });
    } catch {
      continue;
    }
    for (const e of entries) {
      if (!e.isDirectory() || e.name === '.git' || SKIP_DIRS.has(e.name)) continue;
      const child = rel ? `${rel}/${e.name}` : e.name;
      const why = repoHazard(workspace, child);
      if (why) return why;
      if (depth + 1 < MAX_DEPTH) queue.push({ rel: child, depth: depth + 1 });
    }
  }
  return null;
}

/** The hazard of the repository whose work tree is `rel` (if it has a .git), or null. */
function repoHazard(workspace: string, rel: string): string | null {
  const where = rel ? `${rel}/.git` : '.git';
  const gitPath = join(workspace, rel, '.git');
  const st = lstatQuiet(gitPath);
  if (!st) return null;
  if (st.isSymbolicLink()) return `${where} is a symlink`;
  // A gitfile (worktree, submodule checkout) points git at a directory elsewhere.
  if (!st.isDirectory()) return `${where} is a file pointing at another git directory`;
  const configs = ['config', 'config.worktree'];
  const modules = join(gitPath, 'modules');
  if (lstatQuiet(modules)?.isDirectory()) {
    for (const f of readdirSync(modules, { recursive: true, encoding: 'utf8' })) if (f === 'config' || f.endsWith('/config')) configs.push(`modules/${f}`);
  }
  for (const c of configs) {
    const path = join(gitPath, c);
    const cst = lstatQuiet(path);
    if (!cst) continue;
    if (!cst.isFile()) return `${where}/${c} is not a regular file`;
    const key = programKey(readFileSync(path, 'utf8'));
    if (key) return `${where}/${c} sets ${key}, which makes git run a program`;
  }
  const hooks = join(gitPath, 'hooks');
  if (lstatQuiet(hooks)?.isDirectory()) {
    const live = readdirSync(hooks).find((h) => !h.endsWith('.sample'));
    if (live) return `${where}/hooks/${live} is a hook git could run`;
  }
  return null;
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

function lstatQuiet(p: string) {
  try {
    return lstatSync(p);
  } catch {
    return undefined;
  }
}
