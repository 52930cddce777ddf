/**
 * The classifier: walks the adapter's steps in order, as bash would run them, and either
 * proves every one of them a read or an in-workspace edit or stops at the first part it
 * cannot prove, with one sentence naming it.
 *
 * State carried across steps, because later words depend on it:
 * - shell variables assigned earlier with static values (`f=a.txt; cat "$f"`);
 * - the lowest directory the shell may be in (`cd sub && cat ../x` is inside; `cd` can
 *   fail, so a deeper directory is never assumed);
 * - /tmp files this command wrote. The fast path's /tmp is private and empty, the VM's
 *   persists, so /tmp is fine only as scratch space: read only what this command wrote
 *   first, and read back everything it writes (else a later call in the VM would miss it);
 * - every directory the shell may be in (`cd` may fail, so each one adds to the set), from
 *   which, with `git -C`, come the directories git may run in: the broker reads the
 *   configuration of every repository git can find from each (git-config.ts). A command
 *   that runs git and writes workspace files goes to the VM: it could write what git reads.
 */
import { depthAfterCd, isWithin, placeOf, READ_DEVICES, WORKSPACE_MOUNT, WRITE_DEVICES } from './paths.ts';
import { analyseFind } from './find.ts';
import { clip } from './parser.ts';
import { analyseGit } from './git.ts';
import { analyseJqFilter } from './jq.ts';
import { hasOption, scanArgs, usesOption, type ArgKind, type Scan } from './options.ts';
import { environmentRefusal, FOLLOWS_LINKS, RULES, type CommandRule } from './rules.ts';
import { analyseSed } from './sed.ts';
import type { Assignment, Redirect, Script, SimpleCommand, Step, TestStep, Word } from './script.ts';
import { expandWord, type Expanded } from './words.ts';

export type RouteCode =
  /** Proven: runs on the fast path. */
  | 'fastpath'
  | 'empty'
  /** Why a command goes to the VM: */
  | 'syntax'
  | 'construct'
  | 'expansion'
  | 'not_allowed'
  | 'option'
  | 'script'
  | 'path'
  | 'tmp'
  | 'environment'
  | 'host'
  | 'home'
  | 'too_long'
  /** More syntax than the router analyses on the broker's loop (too many nodes, too deep). */
  | 'too_complex'
  /** The call's own environment (LD_PRELOAD, GIT_*, PATH...) could change what runs. */
  | 'call_env'
  /** A repository's configuration names a program git would run. */
  | 'git_config'
  /** The caller asked for the VM. */
  | 'forced';

export interface ClassifyContext {
  /** Whether an earlier VM call changed any of these HOME-relative paths. */
  homeChanged: (paths: readonly string[]) => boolean;
  /** Whether the sandbox can run this (non-builtin) binary. */
  canRun: (name: string) => boolean;
}

export interface Verdict {
  ok: boolean;
  code: RouteCode;
  reason: string;
  /** Command names in the order they appear. */
  commands: string[];
  /** Paths the command may create, change or remove, as written. */
  writes: string[];
  /** Workspace-relative directories ('' the root) git may run in, as written (`a/../b` kept: `..` is resolved on the files). */
  gitDirs: string[];
}

type Access = 'read' | 'write' | 'modify';
const VERB: Record<Access, string> = { read: 'reads', write: 'writes', modify: 'modifies' };

class Refusal extends Error {
  constructor(
    readonly code: RouteCode,
    message: string,
  ) {
    super(message);
  }
}

export function classifyScript(script: Script, ctx: ClassifyContext): Verdict {
  const checker = new Checker(ctx);
  try {
    checker.run(script.steps);
    const names = [...new Set(checker.commands)];
    const list = names.length > 0 ? names.map((n) => `\`${n}\``).join(', ') : 'redirections';
    return { ok: true, code: 'fastpath', reason: `only reads or edits workspace files: ${list}`, commands: checker.commands, writes: checker.writes, gitDirs: [...checker.gitDirs] };
  } catch (err) {
    if (!(err instanceof Refusal)) throw err;
    return { ok: false, code: err.code, reason: err.message, commands: checker.commands, writes: checker.writes, gitDirs: [] };
  }
}

const SHELL_VAR = /^[a-z_][a-z0-9_]*$/;
// Permission bits only: setuid, setgid and sticky bits on host-owned files are refused.
const CHMOD_MODE = /^(?:0?[0-7]{1,3}|[ugoa]*(?:[-+=](?:[rwxX]*|[ugo]))+(?:,[ugoa]*(?:[-+=](?:[rwxX]*|[ugo]))+)*)$/;
const SET_OPTIONS = new Set(['pipefail', 'errexit', 'nounset', 'xtrace', 'verbose']);
/** Directories the shell may be in that the classifier follows; past it, a later git goes to the VM. */
const MAX_CWDS = 16;

class Checker {
  private readonly vars = new Map<string, string>();
  private depth = 0;
  private readonly tmpWritten: string[] = [];
  private readonly tmpUnread = new Set<string>();
  /** Every directory the shell may be in, workspace-relative as written; null past MAX_CWDS. */
  private cwds: Set<string> | null = new Set(['']);
  private wroteWorkspace = false;
  readonly commands: string[] = [];
  readonly writes: string[] = [];
  readonly gitDirs = new Set<string>();

  constructor(private readonly ctx: ClassifyContext) {}

  run(steps: readonly Step[]): void {
    for (const s of steps) {
      if (s.kind === 'command') this.command(s);
      else if (s.kind === 'test') this.testStep(s);
      else this.assign(s.assignments);
    }
    for (const path of this.tmpUnread) {
      throw new Refusal('tmp', `writes \`${path}\` but never reads it back, and a later call in the VM would not find it`);
    }
    if (this.gitDirs.size > 0 && this.wroteWorkspace) {
      throw new Refusal('git_config', 'runs git and writes workspace files, which could be what git reads as its configuration');
    }
  }

  // ---- steps ----------------------------------------------------------------------------

  private command(c: SimpleCommand): void {
    for (const a of c.env) this.envPrefix(a);
    let words = c.words.flatMap((w) => this.expand(w));
    // `time` is a keyword that reports how long the pipeline took; it runs nothing itself.
    if (words[0]?.value === 'time') {
      words = words.slice(1);
      while (words[0]?.value === '-p') words = words.slice(1);
    }
    const head = words[0];
    if (!head) {
      this.redirects(c.redirects);
      return;
    }
    const name = head.value;
    if (head.glob) throw new Refusal('not_allowed', `command name \`${head.source}\` is a glob`);
    if (name.includes('/')) throw new Refusal('not_allowed', `\`${head.source}\` runs a program by path`);
    const rule = RULES.get(name);
    if (!rule) throw new Refusal('not_allowed', `\`${name}\` is not a read/edit command`);
    this.commands.push(name);
    if (!rule.builtin && !this.ctx.canRun(name)) {
      throw new Refusal('host', `\`${name}\` cannot run in the sandbox (not installed on the host, or only through /etc/alternatives)`);
    }
    if (rule.readsHome && this.ctx.homeChanged(rule.readsHome)) {
      const files = rule.readsHome.map((f) => `~/${f}`).join(' and ');
      throw new Refusal('home', `\`${name}\` reads ${files}, which an earlier call changed in the VM`);
    }
    // Bash opens redirections before the command runs.
    this.redirects(c.redirects);
    const args = words.slice(1);
    const who = `\`${name}\``;
    for (const a of args) {
      // Globbing lists directories, so a glob is a read of where it points.
      if (a.glob) this.access(a, 'read', `glob \`${a.source}\``);
    }
    if (rule.injection) {
      for (const a of args) {
        if (a.value === '--') break;
        if (a.globLeading) throw new Refusal('option', `glob \`${a.source}\` could expand to a file named like an option of \`${name}\`; put it after \`--\``);
      }
    }
    this.arguments(name, rule, args, who);
  }

  private testStep(t: TestStep): void {
    this.redirects(t.redirects);
    this.testOperands(t.operands.flatMap((w) => this.expand(w)), '`[[ ]]`');
  }

  private assign(list: readonly Assignment[]): void {
    for (const a of list) {
      // A lowercase name is a shell variable (none of them is in the environment); any
      // other may be, and then changes what later commands do, as a prefix would.
      const exported = !SHELL_VAR.test(a.name);
      if (exported && environmentRefusal(a.name)) throw new Refusal('environment', `assigning \`${a.name}\` may change what later commands do`);
      const value = a.value ? this.expandOne(a.value, true).value : '';
      const full = a.append ? (this.vars.get(a.name) ?? '') + value : value;
      if (exported) this.environmentValue(a.name, full, a.source);
      this.vars.set(a.name, full);
    }
  }

  private envPrefix(a: Assignment): void {
    if (environmentRefusal(a.name)) throw new Refusal('environment', `\`${a.name}=\` may change what the command does; only locale and display variables are allowed`);
    this.environmentValue(a.name, a.value ? this.expandOne(a.value, true).value : '', a.source);
  }

  private environmentValue(name: string, value: string, source: string): void {
    const why = environmentRefusal(name, value);
    if (why) throw new Refusal('environment', `\`${clip(source)}\`: ${'value' in why ? why.value : why.name}`);
  }

  // ---- arguments ------------------------------------------------------------------------

  private arguments(name: string, rule: CommandRule, args: Expanded[], who: string): void {
    switch (rule.analyzer) {
      case 'cd':
        return this.cd(args);
      case 'test':
        return this.testOperands(name === '[' && args.at(-1)?.value === ']' ? args.slice(0, -1) : args, who);
      case 'find':
        return this.find(args, who);
      case 'git':
        return this.git(args);
      case 'chmod':
        return this.chmod(args, who);
      case 'set':
        return this.set(args);
      default:
        break;
    }
    const scan = this.scan(name, rule, args);
    const follows = rule.followsLinks;
    if (follows && follows.when.every((any) => usesOption(scan, any)) && !usesOption(scan, follows.unless ?? [])) {
      throw new Refusal('option', `\`${name} ${follows.when.map((any) => any[0]).join(' ')}\` ${FOLLOWS_LINKS}`);
    }
    // sed's `-i` value is a backup suffix, checked by the sed analyser itself.
    if (rule.analyzer !== 'sed') this.optionValues(scan, name);
    const ops = scan.operands;
    switch (rule.analyzer) {
      case 'grep': {
        const explicit = hasOption(scan, '-e', '--regexp', '-f', '--file');
        return this.operands(explicit ? ops : ops.slice(1), 'read', who);
      }
      case 'sed':
        return this.sed(scan, who);
      case 'jq': {
        const filter = ops[0];
        if (filter) {
          const why = analyseJqFilter(filter.value);
          if (why) throw new Refusal('script', why);
        }
        const dataArgs = hasOption(scan, '--args', '--jsonargs');
        return dataArgs ? undefined : this.operands(ops.slice(1), 'read', who);
      }
      case 'tee':
        return this.operands(ops, hasOption(scan, '-a', '--append') ? 'modify' : 'write', who);
      case 'uniq':
      case 'xxd': {
        if (ops.length > 2) throw new Refusal('option', `${who} takes at most an input and an output file`);
        this.operands(ops.slice(0, 1), 'read', who);
        const reverse = rule.analyzer === 'xxd' && hasOption(scan, '-r');
        return this.operands(ops.slice(1), reverse ? 'modify' : 'write', who);
      }
      case 'cp':
      case 'mv': {
        const sourceAccess: Access = rule.analyzer === 'mv' ? 'modify' : 'read';
        if (hasOption(scan, '-t', '--target-directory') || ops.length < 2) return this.operands(ops, sourceAccess, who);
        this.operands(ops.slice(0, -1), sourceAccess, who);
        return this.operands(ops.slice(-1), 'write', who);
      }
      case 'ln':
        return this.ln(scan, who);
      default:
        return this.operands(ops, rule.operands, who);
    }
  }

  private scan(name: string, rule: CommandRule, args: Expanded[]): Scan {
    const r = scanArgs(args, rule.options, { command: name, permute: !rule.noPermute });
    if (!r.ok) throw new Refusal('option', r.reason);
    return r.scan;
  }

  private optionValues(scan: Scan, name: string, skip: ReadonlySet<string> = new Set()): void {
    for (const o of scan.options) {
      if (skip.has(o.canonical)) continue;
      for (const v of o.values) this.argument(v.word, v.kind, `\`${name} ${o.name}\``);
    }
  }

  private argument(w: Expanded, kind: ArgKind, who: string): void {
    if (kind === 'data') return;
    if (kind === 'value') return this.maybePath(w, who);
    this.access(w, kind, who);
  }

  private operands(ops: readonly Expanded[], role: ArgKind, who: string): void {
    for (const o of ops) {
      if (role === 'data') continue;
      if (role === 'read' && o.value === '-') continue; // stdin
      this.argument(o, role, who);
    }
  }

  private cd(args: Expanded[]): void {
    const ops = args.filter((a) => !['-L', '-P', '-e', '-@', '--'].includes(a.value));
    if (ops.length === 0) throw new Refusal('path', '`cd` without a directory goes to HOME');
    if (ops.length > 1) throw new Refusal('path', '`cd` with several directories is an error');
    const dir = ops[0] as Expanded;
    if (dir.value === '-') throw new Refusal('path', '`cd -` goes back to a directory the router cannot see');
    if (dir.glob) throw new Refusal('path', `\`cd ${dir.source}\` uses a glob`);
    const next = depthAfterCd(dir.value, this.depth);
    if (next === null) throw new Refusal('path', `\`cd ${dir.value}\` leaves the workspace`);
    this.depth = next;
    if (!this.cwds) return;
    for (const c of [...this.cwds]) this.cwds.add(joinDir(c, dir.value));
    if (this.cwds.size > MAX_CWDS) this.cwds = null;
  }

  private testOperands(ops: readonly Expanded[], who: string): void {
    for (const o of ops) {
      // Arithmetic operators and `-v` evaluate array subscripts, which may hold `$(...)`.
      if (o.value.includes('$') || o.value.includes('`')) {
        throw new Refusal('expansion', `test operand \`${o.source}\` could run a command through arithmetic evaluation`);
      }
      this.maybePath(o, who);
    }
  }

  private find(args: Expanded[], who: string): void {
    const r = analyseFind(args);
    if (!r.ok) throw new Refusal('option', r.reason);
    for (const s of r.starts) this.access(s, r.deletes ? 'modify' : 'read', who);
    for (const a of r.args) this.argument(a.word, a.kind, who);
  }

  private git(args: Expanded[]): void {
    const r = analyseGit(args);
    if (!r.ok) throw new Refusal('option', r.reason);
    const saved = this.depth;
    if (r.chdir) {
      const next = depthAfterCd(r.chdir.value, this.depth);
      if (next === null || r.chdir.glob) throw new Refusal('path', `\`git -C ${r.chdir.value}\` leaves the workspace`);
      this.depth = next;
    }
    if (!this.cwds) throw new Refusal('path', `changes directory in more ways than the router follows (over ${MAX_CWDS}) to find where git runs`);
    for (const c of this.cwds) this.gitDirs.add(r.chdir ? joinDir(c, r.chdir.value) : c);
    try {
      for (const a of r.reads) this.argument(a.word, a.kind, `\`git ${r.subcommand}\``);
    } finally {
      this.depth = saved;
    }
  }

  private sed(scan: Scan, who: string): void {
    const scripts = scan.options.filter((o) => o.canonical === '-e' || o.canonical === '--expression').map((o) => o.values[0]?.word);
    let files = scan.operands;
    if (scripts.length === 0) {
      scripts.push(files[0]);
      files = files.slice(1);
    }
    for (const s of scripts) {
      if (!s) continue;
      const r = analyseSed(s.value);
      if (!r.ok) throw new Refusal('script', r.reason);
      for (const f of r.reads) this.access({ value: f, glob: false, globLeading: false, globDotDot: false, source: f }, 'read', 'sed `r`');
    }
    const inPlace = scan.options.find((o) => o.canonical === '-i' || o.canonical === '--in-place');
    const suffix = inPlace?.values[0]?.word.value;
    if (suffix !== undefined && suffix.includes('/')) throw new Refusal('option', `\`sed -i${suffix}\` puts backups in another directory`);
    this.optionValues(scan, 'sed', new Set(['-i', '--in-place']));
    this.operands(files, inPlace ? 'modify' : 'read', who);
  }

  private ln(scan: Scan, who: string): void {
    const symbolic = hasOption(scan, '-s', '--symbolic');
    const ops = scan.operands;
    const targetDir = hasOption(scan, '-t', '--target-directory');
    const targets = targetDir || ops.length < 2 ? ops : ops.slice(0, -1);
    for (const t of targets) {
      if (symbolic) {
        // A symlink's target is read relative to the link, not the cwd: allow only targets
        // that cannot climb, so the link resolves inside the workspace wherever it is.
        if (t.value.startsWith('/') || t.value.split('/').includes('..') || t.glob) {
          throw new Refusal('path', `\`ln -s ${t.source}\` could point outside the workspace`);
        }
      } else this.access(t, 'read', who);
    }
    if (!targetDir && ops.length >= 2) this.operands(ops.slice(-1), 'write', who);
  }

  private chmod(args: Expanded[], who: string): void {
    let mode: Expanded | null = null;
    let reference = false;
    const files: Expanded[] = [];
    for (const a of args) {
      const v = a.value;
      if (mode === null && !reference && CHMOD_MODE.test(v)) mode = a;
      else if (['-R', '-c', '-f', '-v', '--recursive', '--changes', '--silent', '--quiet', '--verbose', '--preserve-root'].includes(v)) continue;
      else if (v.startsWith('--reference=')) {
        reference = true;
        this.access({ ...a, value: v.slice('--reference='.length) }, 'read', who);
      } else if (v.startsWith('-')) throw new Refusal('option', `\`chmod ${v}\` is not a recognised chmod option or mode`);
      else files.push(a);
    }
    if (mode === null && !reference) throw new Refusal('option', '`chmod` mode is not plain permission bits (setuid, setgid and sticky bits are refused)');
    this.operands(files, 'modify', who);
  }

  private set(args: Expanded[]): void {
    for (let i = 0; i < args.length; i++) {
      const v = (args[i] as Expanded).value;
      if (/^[-+][eux]+$/.test(v)) continue;
      if (/^[-+][eux]*o$/.test(v)) {
        const opt = args[++i]?.value;
        if (opt !== undefined && SET_OPTIONS.has(opt)) continue;
        throw new Refusal('option', `\`set -o ${opt ?? ''}\` changes shell behaviour the router does not model`);
      }
      throw new Refusal('option', `\`set ${v}\` changes shell behaviour the router does not model`);
    }
  }

  // ---- redirections ---------------------------------------------------------------------

  private redirects(list: readonly Redirect[]): void {
    for (const r of list) {
      const who = `redirection \`${clip(r.source)}\``;
      switch (r.op) {
        case '<':
          this.access(this.redirectTarget(r), 'read', who);
          break;
        case '>':
        case '>|':
        case '&>':
          this.access(this.redirectTarget(r), 'write', who);
          break;
        case '>>':
        case '&>>':
          this.access(this.redirectTarget(r), 'modify', who);
          break;
        case '>&':
        case '<&': {
          const t = this.redirectTarget(r);
          if (/^\d+$/.test(t.value) || t.value === '-') break; // duplicate or close an fd
          if (r.op === '<&') throw new Refusal('path', `${who} is not a file descriptor`);
          this.access(t, 'write', who);
          break;
        }
        case '>&-':
        case '<&-':
          break;
        case '<<':
        case '<<-':
          for (const p of r.heredocBody ?? []) this.expandOne({ parts: [p], source: p.kind === 'param' ? p.source : p.text, start: 0 }, true);
          break;
        case '<<<':
          if (r.target) this.expandOne(r.target, true);
          break;
      }
    }
  }

  private redirectTarget(r: Redirect): Expanded {
    if (!r.target) throw new Refusal('syntax', `redirection \`${clip(r.source)}\` has no target`);
    const w = this.expandOne(r.target, false);
    if (w.glob) throw new Refusal('path', `redirection target \`${w.source}\` is a glob`);
    return w;
  }

  // ---- paths ----------------------------------------------------------------------------

  /** Option values that are usually not paths, but are checked if they look like one. */
  private maybePath(w: Expanded, who: string): void {
    const v = w.value;
    if (v.startsWith('/') || v.split('/').includes('..') || w.glob) this.access(w, 'read', who);
  }

  private access(w: Expanded, access: Access, who: string): void {
    const place = placeOf(w, this.depth);
    const verb = VERB[access];
    switch (place.kind) {
      case 'outside':
        throw new Refusal('path', `${who} ${verb} ${place.why}`);
      case 'device': {
        const allowed = access === 'read' ? READ_DEVICES.has(place.path) : access === 'write' && WRITE_DEVICES.has(place.path);
        if (!allowed) throw new Refusal('path', `${who} ${verb} device \`${place.path}\``);
        return;
      }
      case 'tmp':
        return this.tmp(place.path, w, access, who);
      case 'workspace':
        if (access !== 'read') {
          this.writes.push(w.value);
          this.wroteWorkspace = true;
        }
        return;
    }
  }

  private tmp(path: string, w: Expanded, access: Access, who: string): void {
    if (w.glob) throw new Refusal('tmp', `${who} globs \`${w.source}\` in /tmp, which holds other files in the VM`);
    const written = this.tmpWritten.some((p) => isWithin(path, p));
    if (access === 'write') {
      const parent = path.slice(0, path.lastIndexOf('/')) || '/';
      if (path === '/tmp' || (parent !== '/tmp' && !this.tmpWritten.some((p) => isWithin(parent, p)))) {
        throw new Refusal('tmp', `${who} writes \`${path}\` into a /tmp directory this command did not create`);
      }
      this.tmpWritten.push(path);
      this.tmpUnread.add(path);
      this.writes.push(path);
      return;
    }
    if (!written) {
      throw new Refusal('tmp', `${who} ${VERB[access]} \`${path}\`, which this command did not write (the fast path's /tmp starts empty)`);
    }
    for (const p of [...this.tmpUnread]) {
      if (isWithin(p, path) || isWithin(path, p)) this.tmpUnread.delete(p);
    }
    if (access === 'modify') this.writes.push(path);
  }

  // ---- words ----------------------------------------------------------------------------

  private expand(w: Word): Expanded[] {
    const r = expandWord(w, this.vars);
    if (!r.ok) throw new Refusal('expansion', r.reason);
    return r.words;
  }

  private expandOne(w: Word, assignment: boolean): Expanded {
    const r = expandWord(w, this.vars, { assignment });
    if (!r.ok) throw new Refusal('expansion', r.reason);
    if (r.words.length !== 1) throw new Refusal('expansion', `\`${w.source}\` expands to several words`);
    return r.words[0] as Expanded;
  }
}


/** `dir` (as written to `cd` or `git -C`) from the workspace-relative `from`; an absolute one is inside /work (checked before). */
function joinDir(from: string, dir: string): string {
  if (dir.startsWith('/')) return dir.slice(WORKSPACE_MOUNT.length).replace(/^\/+/, '');
  return from === '' ? dir : `${from}/${dir}`;
}
