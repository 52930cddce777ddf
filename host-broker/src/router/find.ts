/**
 * find's expression language: start points, then tests and actions. Actions that run
 * commands (-exec, -execdir, -ok, -okdir) or write files (-fprint*, -fls) are refused, and
 * so is anything not in these tables, since find has no getopt to fall back on. `-delete`
 * is an edit of the start points, which the caller checks as modified paths.
 */
import type { ArgKind } from './options.ts';
import { FOLLOWS_LINKS } from './rules.ts';
import type { Expanded } from './words.ts';

const RUNS = 'runs a command for each file';
const WRITES = 'writes a file';
const USERS = 'looks up user and group names, which the sandbox does not have';

const REFUSED: Record<string, string> = {
  '-exec': RUNS,
  '-execdir': RUNS,
  '-ok': RUNS,
  '-okdir': RUNS,
  '-fprint': WRITES,
  '-fprint0': WRITES,
  '-fprintf': WRITES,
  '-fls': WRITES,
  '-user': USERS,
  '-group': USERS,
  '-nouser': USERS,
  '-nogroup': USERS,
  '-follow': FOLLOWS_LINKS,
};

/** Primaries without an argument. */
const NULLARY = new Set([
  '-print', '-print0', '-ls', '-prune', '-quit', '-delete', '-true', '-false', '-empty', '-readable', '-writable',
  '-executable', '-depth', '-d', '-xdev', '-mount', '-noleaf', '-daystart', '-ignore_readdir_race',
  '-noignore_readdir_race', '-nowarn', '-warn', '-not', '-a', '-and', '-o', '-or', '!', '(', ')', ',', '-help', '--help', '-version', '--version',
]);

/** Primaries with one argument, and what it is. */
const UNARY: Record<string, ArgKind> = {
  '-name': 'data', '-iname': 'data', '-path': 'data', '-ipath': 'data', '-wholename': 'data', '-iwholename': 'data',
  '-regex': 'data', '-iregex': 'data', '-lname': 'data', '-ilname': 'data', '-type': 'value', '-xtype': 'value',
  '-size': 'value', '-perm': 'value', '-links': 'value', '-inum': 'value', '-uid': 'value', '-gid': 'value',
  '-mtime': 'value', '-mmin': 'value', '-atime': 'value', '-amin': 'value', '-ctime': 'value', '-cmin': 'value',
  '-used': 'value', '-maxdepth': 'value', '-mindepth': 'value', '-regextype': 'value', '-fstype': 'value',
  '-context': 'data', '-printf': 'data', '-newer': 'read', '-anewer': 'read', '-cnewer': 'read', '-samefile': 'read',
  '-files0-from': 'read',
};

export type FindAnalysis =
  | { ok: true; starts: Expanded[]; args: { word: Expanded; kind: ArgKind }[]; deletes: boolean }
  | { ok: false; reason: string };

export function analyseFind(args: readonly Expanded[]): FindAnalysis {
  let i = 0;
  // Leading options: -H -L -P, -D debugopts, -Olevel. -H follows only the start points' links.
  while (i < args.length) {
    const v = (args[i] as Expanded).value;
    if (v === '-L') return { ok: false, reason: `\`find -L\` ${FOLLOWS_LINKS}` };
    if (v === '-H' || v === '-P' || /^-O\d*$/.test(v)) i++;
    else if (v === '-D') i += 2;
    else break;
  }
  const starts: Expanded[] = [];
  while (i < args.length) {
    const a = args[i] as Expanded;
    if (a.value.startsWith('-') || a.value === '(' || a.value === '!' || a.value === ',') break;
    if (a.globLeading) return { ok: false, reason: `\`find\` start point \`${a.source}\` could expand to an expression` };
    starts.push(a);
    i++;
  }
  const out: { word: Expanded; kind: ArgKind }[] = [];
  let deletes = false;
  for (; i < args.length; i++) {
    const a = args[i] as Expanded;
    const v = a.value;
    const why = REFUSED[v];
    if (why) return { ok: false, reason: `\`find ${v}\` ${why}` };
    if (NULLARY.has(v)) {
      if (v === '-delete') deletes = true;
      continue;
    }
    // -newerXY: X and Y from a, B, c, m, t; with Y = t the argument is a date, else a file.
    const newer = /^-newer([aBcm])([aBcmt])$/.exec(v);
    const kind = newer ? (newer[2] === 't' ? 'data' : 'read') : UNARY[v];
    if (kind) {
      const next = args[++i];
      if (!next) return { ok: false, reason: `\`find ${v}\` is missing its argument` };
      out.push({ word: next, kind });
      continue;
    }
    if (a.glob) return { ok: false, reason: `\`find\` expression word \`${a.source}\` is an unquoted glob` };
    return { ok: false, reason: `\`find ${v}\` is not a recognised find primary` };
  }
  return { ok: true, starts, args: out, deletes };
}
