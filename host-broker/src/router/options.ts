/**
 * getopt-style argument scanning driven by a rule's option table.
 *
 * The router must know which words are option values and which are operands, or a path
 * hidden behind an option (`sort -o /etc/x`) would go unchecked. Tables are written in a
 * small notation, one token per option, so the rules stay data:
 *
 *   `-n:=`      -n takes one argument, a plain value
 *   `--lines:=` long option with one argument (`--lines=5` or `--lines 5`)
 *   `-o:>`      the argument is a file the command writes (created or truncated)
 *   `-a:+`      the argument is a file the command modifies or removes
 *   `-f:<`      the argument is a file the command reads
 *   `-e:~`      the argument is data (a pattern, a script) and never a path
 *   `-i:?`      optional argument, only when attached (`-i.bak`, `--in-place=.bak`)
 *   `--arg:~~`  two arguments
 *
 * Options not in the table are taken as flags. That is safe because every value the scanner
 * cannot attribute becomes an operand, and operands are checked as paths; the danger is
 * only an unknown option that writes or runs something, which is why each rule lists those
 * as refused. Long options match by unambiguous prefix, as getopt_long does, and a refused
 * long option is refused under any prefix of it.
 */
import type { Expanded } from './words.ts';

export type ArgKind = 'value' | 'read' | 'write' | 'modify' | 'data';

const KIND_CHARS: Record<string, ArgKind> = { '=': 'value', '<': 'read', '>': 'write', '+': 'modify', '~': 'data' };

export interface OptionSpec {
  /** Argument kinds in order; empty for an optional attached argument. */
  args: ArgKind[];
  /** Argument only when attached (`-i.bak`, `--color=auto`). */
  optional: boolean;
}

export interface OptionTable {
  short: ReadonlyMap<string, OptionSpec>;
  long: ReadonlyMap<string, OptionSpec>;
  /** Refused options (`-f`, `--follow`) and why. */
  refuse: ReadonlyMap<string, string>;
}

export function optionTable(notation: string, refuse: Record<string, string> = {}): OptionTable {
  const short = new Map<string, OptionSpec>();
  const long = new Map<string, OptionSpec>();
  for (const token of notation.split(/\s+/).filter(Boolean)) {
    const colon = token.indexOf(':');
    const name = colon < 0 ? token : token.slice(0, colon);
    const kinds = colon < 0 ? '' : token.slice(colon + 1);
    const optional = kinds === '?';
    const args = optional ? [] : [...kinds].map((k) => {
      const kind = KIND_CHARS[k];
      if (!kind) throw new Error(`bad option notation ${token}`);
      return kind;
    });
    const spec: OptionSpec = { args, optional };
    if (name.startsWith('--')) long.set(name.slice(2), spec);
    else if (name.startsWith('-') && name.length === 2) short.set(name.slice(1), spec);
    else throw new Error(`bad option notation ${token}`);
  }
  return { short, long, refuse: new Map(Object.entries(refuse)) };
}

export interface ScannedOption {
  /** As written, without the value: `-o`, `--output`. */
  name: string;
  /** The table's name for it (a long option's full name). */
  canonical: string;
  values: { word: Expanded; kind: ArgKind }[];
}

export interface Scan {
  options: ScannedOption[];
  operands: Expanded[];
  /** Operands seen before `--`, which getopt would have parsed as options had they been. */
  operandsBeforeDashDash: Set<Expanded>;
}

export type ScanResult = { ok: true; scan: Scan } | { ok: false; reason: string };

export interface ScanOptions {
  /** GNU getopt permutes: options may follow operands. POSIX tools stop at the first operand. */
  permute?: boolean;
  /** Command name for reasons. */
  command: string;
}

export function scanArgs(args: readonly Expanded[], table: OptionTable, opts: ScanOptions): ScanResult {
  const options: ScannedOption[] = [];
  const operands: Expanded[] = [];
  const beforeDashDash = new Set<Expanded>();
  let optionsEnded = false;
  const permute = opts.permute ?? true;
  const refused = (name: string, why: string): ScanResult => ({ ok: false, reason: `\`${opts.command} ${name}\` ${why}` });

  for (let i = 0; i < args.length; i++) {
    const a = args[i] as Expanded;
    const v = a.value;
    if (optionsEnded || v === '-' || !v.startsWith('-')) {
      operands.push(a);
      if (!optionsEnded) beforeDashDash.add(a);
      if (!permute) optionsEnded = true;
      continue;
    }
    if (v === '--') {
      optionsEnded = true;
      continue;
    }
    if (v.startsWith('--')) {
      const eq = v.indexOf('=');
      const name = eq < 0 ? v.slice(2) : v.slice(2, eq);
      for (const [r, why] of table.refuse) {
        if (r.startsWith('--') && r.slice(2).startsWith(name)) return refused(r, why);
      }
      const canonical = matchLong(table.long, name);
      const spec = canonical === null ? undefined : table.long.get(canonical);
      const opt: ScannedOption = { name: `--${name}`, canonical: `--${canonical ?? name}`, values: [] };
      if (spec) {
        if (spec.optional) {
          if (eq >= 0) opt.values.push({ word: { ...a, value: v.slice(eq + 1) }, kind: 'value' });
        } else {
          const kinds = [...spec.args];
          if (eq >= 0 && kinds.length > 0) opt.values.push({ word: { ...a, value: v.slice(eq + 1) }, kind: kinds.shift() as ArgKind });
          for (const kind of kinds) {
            const next = args[++i];
            if (!next) return { ok: false, reason: `\`${opts.command} --${canonical}\` is missing its argument` };
            opt.values.push({ word: next, kind });
          }
        }
      } else if (eq >= 0) {
        // An unknown option with an attached value: the value is checked as a maybe-path.
        opt.values.push({ word: { ...a, value: v.slice(eq + 1) }, kind: 'value' });
      }
      options.push(opt);
      continue;
    }
    // A cluster of short options: -rn, -n5, -A 3.
    for (let j = 1; j < v.length; j++) {
      const ch = v[j] as string;
      const why = table.refuse.get(`-${ch}`);
      if (why !== undefined) return refused(`-${ch}`, why);
      const spec = table.short.get(ch);
      const opt: ScannedOption = { name: `-${ch}`, canonical: `-${ch}`, values: [] };
      options.push(opt);
      if (!spec) continue;
      const rest = v.slice(j + 1);
      if (spec.optional) {
        if (rest) opt.values.push({ word: { ...a, value: rest }, kind: 'value' });
        break;
      }
      const kinds = [...spec.args];
      if (rest && kinds.length > 0) opt.values.push({ word: { ...a, value: rest }, kind: kinds.shift() as ArgKind });
      for (const kind of kinds) {
        const next = args[++i];
        if (!next) return { ok: false, reason: `\`${opts.command} -${ch}\` is missing its argument` };
        opt.values.push({ word: next, kind });
      }
      break;
    }
  }
  return { ok: true, scan: { options, operands, operandsBeforeDashDash: beforeDashDash } };
}

/** Exact name, else the unique table entry it abbreviates (getopt_long semantics). */
function matchLong(table: ReadonlyMap<string, OptionSpec>, name: string): string | null {
  if (table.has(name)) return name;
  let found: string | null = null;
  for (const key of table.keys()) {
    if (key.startsWith(name)) {
      if (found !== null) return found; // ambiguous: getopt fails; assume it takes a value (stricter)
      found = key;
    }
  }
  return found;
}

export function hasOption(scan: Scan, ...names: string[]): boolean {
  return scan.options.some((o) => names.includes(o.canonical) || names.includes(o.name));
}

/**
 * Whether the command was given one of `names`, a long one also under a prefix (getopt_long
 * takes `--deref` for `--dereference`; an ambiguous prefix is an error there, so counting it
 * is only stricter). For options without a value, which the table does not list.
 */
export function usesOption(scan: Scan, names: readonly string[]): boolean {
  return scan.options.some((o) => names.some((n) => o.name === n || (n.startsWith('--') && o.name.startsWith('--') && o.name.length > 2 && n.startsWith(o.name))));
}
