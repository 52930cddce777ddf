/**
 * git on the fast path: only subcommands that inspect the repository, with the options that
 * run other programs, write files or bring in configuration refused. Pathspecs and revisions
 * are data (git itself confines pathspecs to the repository, identically on both paths);
 * real file arguments (`diff --no-index`, `blame --contents`) are returned for path checks.
 *
 * What git may still do on its own: a repository's configuration can name programs
 * (diff.external, textconv, filters, core.fsmonitor); the broker reads every configuration
 * git can reach from where it runs before a call goes to the fast path (git-config.ts), and
 * the options here keep git from reaching further: no submodule opened for a log or diff of
 * its commits (`--submodule=log|diff`), no signature checked (`%G` in a format runs gpg).
 */
import { optionTable, scanArgs, hasOption, type ArgKind, type OptionTable } from './options.ts';
import type { Expanded } from './words.ts';

const PAGER = 'starts a pager';
const NO_CONFIG = 'sets configuration that can run programs';

/** Options between `git` and the subcommand. */
const GLOBAL_OK = new Set([
  '--no-pager',
  '-P',
  '--no-optional-locks',
  '--literal-pathspecs',
  '--glob-pathspecs',
  '--noglob-pathspecs',
  '--icase-pathspecs',
  '--no-replace-objects',
  '--version',
]);
const GLOBAL_REFUSED: Record<string, string> = {
  '-c': NO_CONFIG,
  '--config-env': NO_CONFIG,
  '--exec-path': 'changes where git finds its programs',
  '--git-dir': 'points git at another repository',
  '--work-tree': 'points git at another work tree',
  '--namespace': 'changes the ref namespace',
  '-p': PAGER,
  '--paginate': PAGER,
  '--bare': 'treats the directory as a bare repository',
  '-h': 'opens the manual',
  '--help': 'opens the manual',
  '--html-path': 'prints host install paths',
  '--man-path': 'prints host install paths',
  '--info-path': 'prints host install paths',
  '--list-cmds': 'lists host-installed commands',
  '--super-prefix': 'is internal',
  '--attr-source': 'reads attributes from elsewhere',
};

/** Refused in every subcommand. */
const COMMON_REFUSE: Record<string, string> = {
  '--output': 'writes a file',
  '--ext-diff': 'runs an external diff program',
  '--textconv': 'runs textconv filters',
  '--show-signature': 'runs gpg',
  '--open-files-in-pager': PAGER,
  '--paginate': PAGER,
  '--help': 'opens the manual',
};

const DIFF_OPTS =
  '-U:= --unified:= --inter-hunk-context:= -M:? -C:? -B:? -l:= -S:~ -G:~ -O:< --diff-filter:= --find-renames:? --find-copies:? ' +
  '--relative:? --src-prefix:~ --dst-prefix:~ --line-prefix:~ --anchored:~ --stat:? --dirstat:? --color:? --color-moved:? ' +
  '--word-diff:? --word-diff-regex:~ --abbrev:? --submodule:? --ignore-submodules:? -I:~ --ignore-matching-lines:~ --diff-algorithm:= ' +
  '--ws-error-highlight:= --output-indicator-new:~ --output-indicator-old:~ --output-indicator-context:~ --skip-to:~ --rotate-to:~';
const LOG_OPTS =
  `${DIFF_OPTS} -n:= --max-count:= --skip:= --since:~ --after:~ --until:~ --before:~ --author:~ --committer:~ --grep:~ ` +
  '--format:~ --pretty:? --date:= --decorate:? --encoding:= -L:~ --min-parents:= --max-parents:= --branches:? --tags:? --remotes:? ' +
  '--glob:~ --exclude:~ --grep-reflog:~ --notes:? --show-notes:? --since-as-filter:~ --decorate-refs:~ --decorate-refs-exclude:~';

interface Sub {
  options: OptionTable;
  /** Post-scan check: null when fine, or why not. */
  check?: (scan: ReturnType<typeof scanOk>) => string | null;
  /** Operands that are real files, for path checks (default: none; they are revisions/pathspecs). */
  fileOperands?: (scan: ReturnType<typeof scanOk>) => Expanded[];
}

function scanOk(args: readonly Expanded[], table: OptionTable, command: string) {
  const r = scanArgs(args, table, { command });
  if (!r.ok) throw new GitRefusal(r.reason);
  return r.scan;
}

class GitRefusal extends Error {}

const sub = (notation: string, extra: Record<string, string> = {}, rest: Omit<Sub, 'options'> = {}): Sub => ({
  options: optionTable(notation, { ...COMMON_REFUSE, ...extra }),
  ...rest,
});

const BRANCH_WRITES: Record<string, string> = Object.fromEntries(
  ['-d', '-D', '--delete', '-m', '-M', '--move', '-c', '-C', '--copy', '-f', '--force', '-u', '--set-upstream-to', '--unset-upstream', '--edit-description', '-t', '--track', '--no-track', '--create-reflog', '--recurse-submodules'].map((o) => [o, 'changes branches']),
);

export const GIT_SUBCOMMANDS: ReadonlyMap<string, Sub> = new Map<string, Sub>([
  ['status', sub('-u:? --untracked-files:? --ignore-submodules:? --ignored:? --column:? --find-renames:? -M:?')],
  [
    'diff',
    sub(DIFF_OPTS, {}, {
      fileOperands: (scan) => (hasOption(scan, '--no-index') ? scan.operands : []),
    }),
  ],
  ['log', sub(LOG_OPTS)],
  ['show', sub(LOG_OPTS)],
  ['ls-files', sub('-x:~ --exclude:~ -X:< --exclude-from:< --exclude-per-directory:~ --format:~ --abbrev:?')],
  ['rev-parse', sub('--short:? --abbrev-ref:? --default:~ --prefix:~ --since:~ --after:~ --until:~ --before:~ --disambiguate:~ --branches:? --tags:? --remotes:? --glob:~ --exclude:~ --show-object-format:? --path-format:=')],
  [
    'branch',
    sub('--contains:? --no-contains:? --merged:? --no-merged:? --points-at:~ --sort:~ --format:~ --color:? --column:? --abbrev:?', BRANCH_WRITES, {
      // Listing only: bare names would create a branch unless listing is explicit.
      check: (scan) => (scan.operands.length > 0 && !hasOption(scan, '-l', '--list') ? 'creates a branch' : null),
    }),
  ],
  [
    'blame',
    sub('-L:~ -S:< --contents:< --ignore-rev:~ --ignore-revs-file:< --abbrev:? -C:? -M:? --date:= --since:~', {}, {
      fileOperands: () => [],
    }),
  ],
  ['grep', sub('-e:~ -f:< -A:= -B:= -C:= --after-context:= --before-context:= --context:= -m:= --max-count:= --max-depth:= --threads:= --color:? --exclude-standard', { '-O': PAGER })],
]);

/** Options any subcommand may take whose values make git open other repositories or run gpg. */
function reachRefusal(scan: ReturnType<typeof scanOk>): string | null {
  for (const o of scan.options) {
    const value = o.values[0]?.word.value;
    // `--submodule` alone is `log`: both it and `diff` open the submodule's repository.
    if (o.canonical === '--submodule' && value !== 'short') return `\`${o.name}${value === undefined ? '' : `=${value}`}\` opens submodule repositories`;
    if ((o.canonical === '--format' || o.canonical === '--pretty') && value?.includes('%G')) return `\`${o.name}\` with \`%G\` checks signatures with gpg`;
  }
  return null;
}

export type GitAnalysis =
  | { ok: true; subcommand: string; reads: { word: Expanded; kind: ArgKind }[]; chdir: Expanded | null }
  | { ok: false; reason: string };

/** Analyses `git <args>`; path-valued arguments are returned for the caller to check. */
export function analyseGit(args: readonly Expanded[]): GitAnalysis {
  let i = 0;
  let chdir: Expanded | null = null;
  for (; i < args.length; i++) {
    const a = args[i] as Expanded;
    const v = a.value;
    if (!v.startsWith('-')) break;
    if (v === '-C') {
      const dir = args[++i];
      if (!dir) return { ok: false, reason: '`git -C` is missing its directory' };
      if (chdir) return { ok: false, reason: '`git -C` given twice is not analysed' };
      chdir = dir;
      continue;
    }
    const name = v.includes('=') ? v.slice(0, v.indexOf('=')) : v;
    if (GLOBAL_OK.has(name)) continue;
    for (const [r, why] of Object.entries(GLOBAL_REFUSED)) {
      if (name === r || (r.startsWith('--') && name.startsWith('--') && r.startsWith(name))) return { ok: false, reason: `\`git ${r}\` ${why}` };
    }
    return { ok: false, reason: `\`git ${name}\` is not a known read-only git option` };
  }
  const subName = args[i]?.value;
  if (subName === undefined) return { ok: true, subcommand: '', reads: [], chdir };
  const spec = GIT_SUBCOMMANDS.get(subName);
  if (!spec) return { ok: false, reason: `\`git ${subName}\` is not a read-only git subcommand` };
  try {
    const scan = scanOk(args.slice(i + 1), spec.options, `git ${subName}`);
    const why = reachRefusal(scan) ?? spec.check?.(scan) ?? null;
    if (why) return { ok: false, reason: `\`git ${subName}\` ${why}` };
    const reads: { word: Expanded; kind: ArgKind }[] = [];
    for (const o of scan.options) for (const v of o.values) reads.push(v);
    for (const w of spec.fileOperands?.(scan) ?? []) reads.push({ word: w, kind: 'read' });
    return { ok: true, subcommand: subName, reads, chdir };
  } catch (err) {
    if (err instanceof GitRefusal) return { ok: false, reason: err.message };
    throw err;
  }
}
