/**
 * The fast-path command table: which commands may run in the bubblewrap sandbox, how their
 * arguments are read, and which options are refused. Data, so it can be read, reviewed and
 * tested on its own; the behaviour lives in classify.ts and the per-command analysers.
 *
 * A command belongs here only if, given arguments that stay in the workspace and /tmp, it
 * reads or edits files and nothing else: no network, no other programs, no state in HOME
 * (git's and jq's HOME config is handled by `readsHome`), no dependence on users or the
 * clock that the sandbox would answer differently. Left out on purpose:
 * - awk: programs run commands (`system()`, `cmd | getline`, `print | "cmd"`) and write
 *   files (`print > f`); proving an awk program safe needs an awk parser, and on Debian
 *   /usr/bin/awk resolves through /etc/alternatives, which the sandbox does not mount.
 * - xargs, env, nohup, timeout, nice, command, exec, eval, source: they run other commands
 *   whose arguments come from data the router cannot see.
 * - date, id, whoami, hostname, uname, printenv, which: their answers differ by design.
 * - less/more/pager: interactive; tree, rg: not on the host (checked at init anyway).
 */
import { optionTable, type OptionTable } from './options.ts';

/** What a command's operands are, when no analyser takes them apart. */
export type OperandRole = 'read' | 'write' | 'modify' | 'data';

/** Commands whose arguments need more than an option table. */
export type Analyzer =
  | 'cd'
  | 'chmod'
  | 'cp'
  | 'mv'
  | 'find'
  | 'git'
  | 'grep'
  | 'jq'
  | 'ln'
  | 'sed'
  | 'set'
  | 'tee'
  | 'test'
  | 'uniq'
  | 'xxd';

export interface CommandRule {
  /** What it does here, one line (shown by docs and tests). */
  about: string;
  /** A shell builtin: needs no binary on the host. */
  builtin?: boolean;
  options: OptionTable;
  operands: OperandRole;
  analyzer?: Analyzer;
  /**
   * Options of this command can run programs or write files named in their value, so a
   * glob at the start of an operand (which could match a file named `--output=x`) is
   * refused unless it follows `--`.
   */
  injection?: boolean;
  /** Configuration it reads from HOME (HOME-relative files or directories). */
  readsHome?: readonly string[];
  /** POSIX-style: options end at the first operand. */
  noPermute?: boolean;
  /**
   * Options that together make it follow symbolic links while it walks a tree: one of each
   * list (long options also by a prefix, as getopt takes them), none of `unless`.
   */
  followsLinks?: { when: ReadonlyArray<readonly string[]>; unless?: readonly string[] };
}

const none = optionTable('');

function rule(about: string, operands: OperandRole, notation = '', refuse: Record<string, string> = {}, extra: Partial<CommandRule> = {}): CommandRule {
  return { about, operands, options: optionTable(notation, refuse), ...extra };
}

const RUNS = 'runs a program';
/**
 * Following links while recursing is endless on a tenant's tree: GNU tools stop at a link
 * back to a directory they are in, but not at a fan-out (`l0/x` and `l0/y` both linking to
 * `l1`, and so on down: 2^40 paths from 40 directories), which held `find -L`, `grep -R`,
 * `ls -RL`, `cp -rL` and `diff -r` until the caller gave up, on the fast path's host CPU.
 * In the VM such a walk costs only the tenant's own VM.
 */
export const FOLLOWS_LINKS = 'follows symbolic links while it walks the tree (a fan-out of links makes the walk endless)';
const FOLLOW = 'follows the file forever';
const CHECK = 'reads file names from a checksum list';

const GREP_OPTS =
  '-e:~ --regexp:~ -f:< --file:< -m:= --max-count:= -A:= --after-context:= -B:= --before-context:= -C:= --context:= ' +
  '-d:= --directories:= -D:= --devices:= --include:= --exclude:= --exclude-dir:= --exclude-from:< --color:? --colour:? ' +
  '--label:= --binary-files:= --group-separator:=';

/** grep -r follows only the links it is given; -R every link it meets. */
const GREP_REFUSE = { '-R': FOLLOWS_LINKS, '--dereference-recursive': FOLLOWS_LINKS };

const SUM_OPTS = '-l:= --length:= -a:= --algorithm:=';
const SUM_REFUSE = { '-c': CHECK, '--check': CHECK };

const sumRule = (name: string): CommandRule => rule(`${name} of files`, 'read', SUM_OPTS, SUM_REFUSE);

export const RULES: ReadonlyMap<string, CommandRule> = new Map<string, CommandRule>([
  // Shell builtins.
  ['echo', rule('print its arguments', 'data', '', {}, { builtin: true, noPermute: true })],
  ['printf', rule('format its arguments', 'data', '-v:~', {}, { builtin: true, noPermute: true })],
  ['true', rule('do nothing, successfully', 'data', '', {}, { builtin: true })],
  ['false', rule('do nothing, unsuccessfully', 'data', '', {}, { builtin: true })],
  [':', rule('do nothing', 'data', '', {}, { builtin: true })],
  ['exit', rule('leave the shell with a status', 'data', '', {}, { builtin: true })],
  ['set', rule('set -e/-u/-x/-o pipefail (error handling and tracing only)', 'data', '', {}, { builtin: true, analyzer: 'set' })],
  ['pwd', rule('print the working directory (/work/... on both paths)', 'data', '', {}, { builtin: true })],
  ['cd', rule('change directory inside the workspace', 'data', '', {}, { builtin: true, analyzer: 'cd' })],
  ['test', rule('test files and strings', 'data', '', {}, { builtin: true, analyzer: 'test', noPermute: true })],
  ['[', rule('test files and strings', 'data', '', {}, { builtin: true, analyzer: 'test', noPermute: true })],

  // Reading and inspecting files.
  ['cat', rule('print files', 'read')],
  ['head', rule('print the first lines', 'read', '-n:= --lines:= -c:= --bytes:=')],
  ['tail', rule('print the last lines', 'read', '-n:= --lines:= -c:= --bytes:= -s:= --sleep-interval:= --pid:= --max-unchanged-stats:=', { '-f': FOLLOW, '-F': FOLLOW, '--follow': FOLLOW, '--retry': FOLLOW })],
  ['wc', rule('count lines, words, bytes', 'read', '--files0-from:<')],
  ['nl', rule('number lines', 'read', '-b:= -d:= -f:= -h:= -i:= -l:= -n:= -s:= -v:= -w:= --body-numbering:= --section-delimiter:= --footer-numbering:= --header-numbering:= --line-increment:= --join-blank-lines:= --number-format:= --number-separator:= --starting-line-number:= --number-width:=')],
  ['ls', rule('list directories', 'read', '-I:= --ignore:= --hide:= -w:= --width:= -T:= --tabsize:= --format:= --sort:= --time:= --time-style:= --color:? --block-size:= --quoting-style:= --indicator-style:= --hyperlink:?', {}, { followsLinks: { when: [['-L', '--dereference'], ['-R', '--recursive']] } })],
  ['stat', rule('show file metadata', 'read', '-c:~ --format:~ --printf:~')],
  // du -L skips a directory it has seen, but with -l (count every link) walks a fan-out whole.
  ['du', rule('show disk usage', 'read', '-d:= --max-depth:= -B:= --block-size:= --exclude:= -X:< --exclude-from:< --files0-from:< -t:= --threshold:= --time:? --time-style:=', { '-L': FOLLOWS_LINKS, '--dereference': FOLLOWS_LINKS })],
  ['file', rule('identify file types', 'read', '-m:< --magic-file:< -f:< --files-from:< -F:= --separator:= -e:= --exclude:= -P:= --parameter:=', { '-C': 'compiles a magic file', '--compile': 'compiles a magic file', '-z': 'may run decompressors', '-Z': 'may run decompressors', '--uncompress': 'may run decompressors', '--uncompress-noreport': 'may run decompressors' })],
  ['realpath', rule('resolve paths', 'read', '--relative-to:< --relative-base:<')],
  ['readlink', rule('print symlink targets', 'read')],
  ['basename', rule('strip directories from names', 'data', '-s:~ --suffix:~')],
  ['dirname', rule('strip the last name component', 'data')],
  ['md5sum', sumRule('MD5 sums')],
  ['sha1sum', sumRule('SHA-1 sums')],
  ['sha224sum', sumRule('SHA-224 sums')],
  ['sha256sum', sumRule('SHA-256 sums')],
  ['sha384sum', sumRule('SHA-384 sums')],
  ['sha512sum', sumRule('SHA-512 sums')],
  ['b2sum', sumRule('BLAKE2 sums')],
  ['cksum', sumRule('CRC checksums')],
  ['sum', sumRule('checksums')],
  ['xxd', rule('hex dump (second operand is written)', 'read', '-s:= -l:= -c:= -g:= -o:= -n:= -R:=', {}, { analyzer: 'xxd' })],
  ['od', rule('octal dump', 'read', '-A:= -j:= -N:= -t:= -w:? -S:? --address-radix:= --skip-bytes:= --read-bytes:= --format:= --width:? --strings:? --endian:=')],
  ['hexdump', rule('hex dump', 'read', '-e:~ -f:< -n:= -s:=')],
  ['base64', rule('encode or decode base64', 'read', '-w:= --wrap:=')],

  // Text filters.
  ['grep', rule('search file contents', 'read', GREP_OPTS, GREP_REFUSE, { analyzer: 'grep' })],
  ['egrep', rule('grep -E', 'read', GREP_OPTS, GREP_REFUSE, { analyzer: 'grep' })],
  ['fgrep', rule('grep -F', 'read', GREP_OPTS, GREP_REFUSE, { analyzer: 'grep' })],
  ['sort', rule('sort lines', 'read', '-o:> --output:> -T:> --temporary-directory:> -k:~ --key:~ -t:~ --field-separator:~ -S:= --buffer-size:= --parallel:= --batch-size:= --files0-from:< --random-source:< --sort:=', { '--compress-program': RUNS }, { injection: true })],
  ['uniq', rule('drop repeated lines (second operand is written)', 'read', '-f:= -s:= -w:= --skip-fields:= --skip-chars:= --check-chars:= --group:? --all-repeated:?', {}, { analyzer: 'uniq' })],
  ['cut', rule('cut fields', 'read', '-b:= -c:= -f:= -d:~ --bytes:= --characters:= --fields:= --delimiter:~ --output-delimiter:~')],
  ['tr', rule('translate characters (stdin only)', 'data')],
  // diff -r follows every link it meets unless told not to.
  ['diff', rule('compare files', 'read', '-x:~ --exclude:~ -X:< --exclude-from:< -I:~ --ignore-matching-lines:~ -F:~ --show-function-line:~ -L:~ --label:~ -U:= -C:= --unified:? --context:? -W:= --width:= --from-file:< --to-file:< --line-format:~ --old-line-format:~ --new-line-format:~ --unchanged-line-format:~ --old-group-format:~ --new-group-format:~ --changed-group-format:~ --unchanged-group-format:~ --ifdef:~ -D:~ --horizon-lines:= --tabsize:= --color:? --palette:~ -S:= --starting-file:=', {}, { followsLinks: { when: [['-r', '--recursive']], unless: ['--no-dereference'] } })],
  ['cmp', rule('compare bytes', 'read', '-i:= --ignore-initial:= -n:= --bytes:=')],
  ['comm', rule('compare sorted files', 'read', '--output-delimiter:~')],
  ['paste', rule('merge lines', 'read', '-d:~ --delimiters:~')],
  ['join', rule('join lines on a field', 'read', '-1:= -2:= -t:~ -e:~ -o:~ -j:= -a:= -v:=')],
  ['column', rule('format columns', 'read', '-s:~ -o:~ -c:= -N:~ -R:~ -E:~ -H:~ -W:~ -O:~ -r:~ -l:= -d:= --separator:~ --output-separator:~ --output-width:= --table-columns:~ --table-name:~ --table-right:~ --table-hide:~ --table-wrap:~ --table-order:~ --table-truncate:~ --table-noextreme:~ --tree:~ --tree-id:~ --tree-parent:~ --table-columns-limit:=')],
  ['fold', rule('wrap lines', 'read', '-w:= --width:=')],
  ['fmt', rule('reflow text', 'read', '-w:= -p:~ -g:= --width:= --prefix:~ --goal:=')],
  ['expand', rule('tabs to spaces', 'read', '-t:= --tabs:=')],
  ['unexpand', rule('spaces to tabs', 'read', '-t:= --tabs:=')],
  ['rev', rule('reverse lines', 'read')],
  ['tac', rule('print lines in reverse order', 'read', '-s:~ --separator:~')],
  ['seq', rule('print a sequence of numbers', 'data', '-f:~ --format:~ -s:~ --separator:~')],
  ['sed', rule('stream edit (-i edits files in place)', 'read', '-e:~ --expression:~ -i:? --in-place:? -l:= --line-length:=', { '-f': 'reads its script from a file the router cannot analyse', '--file': 'reads its script from a file the router cannot analyse', '--follow-symlinks': 'edits through symlinks' }, { analyzer: 'sed', injection: true })],
  ['jq', rule('query JSON', 'read', '--arg:~~ --argjson:~~ --slurpfile:~< --rawfile:~< --indent:= --tab --args --jsonargs', { '-f': 'reads its filter from a file', '--from-file': 'reads its filter from a file', '-L': 'loads modules from a directory', '--library-path': 'loads modules from a directory' }, { analyzer: 'jq', injection: true, readsHome: ['.jq'] })],
  ['find', rule('find files (without -exec and file-writing actions)', 'read', '', {}, { analyzer: 'find', injection: true })],

  // Edits inside the workspace (or scratch files in /tmp).
  ['tee', rule('copy stdin to files', 'write', '--output-error:?', {}, { analyzer: 'tee' })],
  ['touch', rule('create files or set times', 'write', '-d:~ --date:~ -t:= -r:< --reference:< --time:=')],
  ['mkdir', rule('create directories', 'write', '-m:= --mode:= --context:?')],
  ['rmdir', rule('remove empty directories', 'modify')],
  ['rm', rule('remove files', 'modify', '--interactive:?')],
  ['truncate', rule('shrink or extend files', 'modify', '-s:= --size:= -r:< --reference:<')],
  ['cp', rule('copy files', 'read', '-t:> --target-directory:> -S:= --suffix:= --backup:? --reflink:? --sparse:= --preserve:? --no-preserve:=', { '-s': 'creates symlinks', '--symbolic-link': 'creates symlinks' }, { analyzer: 'cp', followsLinks: { when: [['-L', '--dereference'], ['-r', '-R', '--recursive', '-a', '--archive']] } })],
  ['mv', rule('move files', 'modify', '-t:> --target-directory:> -S:= --suffix:= --backup:?', {}, { analyzer: 'mv' })],
  ['ln', rule('create links (symlink targets must stay relative and below the link)', 'read', '-t:> --target-directory:> -S:= --suffix:= --backup:?', {}, { analyzer: 'ln' })],
  ['chmod', rule('change permission bits', 'modify', '--reference:<', {}, { analyzer: 'chmod' })],

  // git, read-only subcommands (see git.ts).
  ['git', { about: 'inspect the repository (read-only subcommands)', operands: 'data', options: none, analyzer: 'git', injection: true, readsHome: ['.gitconfig', '.config/git'] }],
]);

/**
 * The environment a fast-path command may be given, one decision whether it comes inline
 * (`LC_ALL=C sort`, `TZ=UTC; date`) or in the call's `env`: only variables that change
 * formatting, each with a value check, and those only where the value names no file. A
 * locale or message catalog name with `/` is a path glibc and gettext load from (the
 * tenant's own files, parsed on the host kernel: `LC_MESSAGES=/work/loc`,
 * `LANGUAGE=../../work/loc`), a TZ beginning with `:` or `/`, or climbing with `..`, a
 * zone file. Anything not listed (LD_*, GCONV_PATH, LOCPATH, NLSPATH, HOSTALIASES,
 * MALLOC_*, GLIBC_TUNABLES, PATH, BASH_ENV, GIT_*...) sends the command to the VM, where
 * the environment is the tenant's own business. A value check returns null when fine, or
 * why not.
 */
const LOCALE_VARIABLES = [
  'LANG', 'LANGUAGE', 'LC_ALL', 'LC_CTYPE', 'LC_COLLATE', 'LC_MESSAGES', 'LC_NUMERIC', 'LC_TIME', 'LC_MONETARY',
  'LC_PAPER', 'LC_NAME', 'LC_ADDRESS', 'LC_TELEPHONE', 'LC_MEASUREMENT', 'LC_IDENTIFICATION',
];
const noPath = (what: string) => (v: string) => (v.includes('/') ? `a ${what} with \`/\` is a path` : null);
const onlyCat = (v: string) => (v === 'cat' || v === '' ? null : 'only `cat` is allowed as a pager');

export const ENV_ALLOWLIST: ReadonlyMap<string, (value: string) => string | null> = new Map<string, (value: string) => string | null>([
  ...LOCALE_VARIABLES.map((n) => [n, noPath('locale name')] as const),
  ['TZ', (v: string) => (v.startsWith(':') || v.startsWith('/') || v.includes('..') ? 'a TZ file path' : null)],
  // ncurses looks a terminal name up as a file below its terminfo directories.
  ['TERM', noPath('terminal name')],
  ...['NO_COLOR', 'FORCE_COLOR', 'CLICOLOR', 'CLICOLOR_FORCE', 'COLUMNS', 'LINES', 'GREP_COLOR', 'GREP_COLORS'].map((n) => [n, () => null] as const),
  ['GIT_PAGER', onlyCat],
  ['PAGER', onlyCat],
]);

/**
 * Why the variable `name=value` keeps a command off the fast path, or null: the one check
 * for inline and call environments. Without a value, whether the name may be set at all
 * (the classifier asks before it expands the value).
 */
export function environmentRefusal(name: string, value?: string): { name: string } | { value: string } | null {
  const check = ENV_ALLOWLIST.get(name);
  if (!check) return { name: 'only locale and display variables are allowed' };
  const why = value === undefined ? null : check(value);
  return why === null ? null : { value: why };
}

/** Every command the fast path may run, for the rootfs and fast-path owners to check against. */
export const FASTPATH_COMMANDS: readonly string[] = [...RULES.keys()].sort();

/** Commands that need a binary on the host (not shell builtins). */
export const FASTPATH_BINARIES: readonly string[] = [...RULES.entries()].filter(([, r]) => !r.builtin).map(([n]) => n).sort();
