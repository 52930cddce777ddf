/**
 * The command line of every hutch command (serve, gateway, mcp, template, agent, setup,
 * prepare, demo): each declares its options once, with their help, and gets them parsed by
 * node's util.parseArgs and every value checked and converted before the command does any
 * work. A bad option is a UsageError naming it (the CLIs exit 2 on it); `-h`/`--help`
 * prints the command's own help. The guest agent uses it too, so it lives here, beside
 * the agent's other shared parts.
 */
import { accessSync, constants, existsSync, readFileSync, statSync } from 'node:fs';
import { dirname, resolve } from 'node:path';
import { parseArgs } from 'node:util';
import { HutchError } from './protocol/errors.ts';
import type { LogLevel } from './log.ts';

export interface OptionSpec<T = unknown> {
  /** The value's placeholder in help (`N`, `DIR`); without one the option is a switch. */
  arg?: string;
  /** One line (more only when it must), naming the default when there is one. */
  help: string;
  short?: string;
  /** Repeatable: every value, in order (an empty list when absent). */
  multiple?: boolean;
  /** The text used when the option is absent (checked like a given one). */
  default?: string;
  /** Read when the option is absent and it has no default. */
  env?: string;
  /** Checks and converts the text: throw with the option's name, or anything (it is named). */
  parse?: (text: string, option: string) => T;
  /** Help lists it under this heading (options without one come first). */
  group?: string;
}

export type Options = Record<string, OptionSpec>;

type Converted<S> = S extends { parse: (text: string, option: string) => infer T } ? T : string;
type ValueOf<S> = S extends { arg: string }
  ? S extends { multiple: true }
    ? Converted<S>[]
    : S extends { default: string }
      ? Converted<S>
      : Converted<S> | undefined
  : boolean;
export type Values<O extends Options> = { -readonly [K in keyof O]: ValueOf<O[K]> };

export interface CommandSpec<O extends Options> {
  /** As typed: `hutch serve`. */
  name: string;
  /** What it does, one line. */
  summary: string;
  /** What follows the name in the usage line (default `[options]`). */
  usage?: string;
  options: O;
  /** Positional arguments: how many (default none). */
  positionals?: { min?: number; max?: number };
  /** A few lines after the options: notes, an example. */
  footer?: string;
}

/** A command line the command cannot run with: exit status 2, the message names the option. */
export class UsageError extends HutchError {
  constructor(message: string, option?: string) {
    super('bad_request', message, { usage: true, ...(option ? { option } : {}) });
    this.name = 'UsageError';
  }
}

export function isUsageError(err: unknown): err is HutchError {
  return err instanceof HutchError && err.context?.['usage'] === true;
}

export interface Parsed<O extends Options> {
  values: Values<O>;
  positionals: string[];
}

export class Command<O extends Options> {
  constructor(readonly spec: CommandSpec<O>) {}

  /** The options and positionals, each checked; undefined when help was asked for (and printed to `out`). */
  parse(argv: string[], opts: { env?: NodeJS.ProcessEnv; out?: (text: string) => void } = {}): Parsed<O> | undefined {
    const env = opts.env ?? process.env;
    const config: Record<string, { type: 'string' | 'boolean'; multiple?: boolean; short?: string }> = { help: { type: 'boolean', short: 'h' } };
    for (const [name, o] of Object.entries(this.spec.options)) {
      config[name] = { type: o.arg ? 'string' : 'boolean', ...(o.multiple ? { multiple: true } : {}), ...(o.short ? { short: o.short } : {}) };
    }
    let raw: { values: Record<string, string | boolean | Array<string | boolean> | undefined>; positionals: string[] };
    try {
      raw = parseArgs({ args: argv, options: config, allowPositionals: true, strict: true });
    } catch (err) {
      throw this.parseArgsError(err as Error & { code?: string });
    }
    if (raw.values['help']) {
      (opts.out ?? ((t: string) => process.stdout.write(t)))(this.help());
      return undefined;
    }
    const { min = 0, max = 0 } = this.spec.positionals ?? {};
    if (raw.positionals.length < min) throw new UsageError(`missing argument: usage: ${this.spec.name} ${this.spec.usage ?? ''} (see ${this.spec.name} --help)`);
    if (raw.positionals.length > max) throw new UsageError(`unexpected argument ${JSON.stringify(raw.positionals[max])} (see ${this.spec.name} --help)`);
    const values: Record<string, unknown> = {};
    for (const [name, o] of Object.entries(this.spec.options)) {
      const flag = `--${name}`;
      const given = raw.values[name];
      if (!o.arg) {
        values[name] = given === true;
        continue;
      }
      if (o.multiple) {
        values[name] = ((given as string[] | undefined) ?? []).map((t) => convert(o, t, flag));
        continue;
      }
      if (typeof given === 'string') values[name] = convert(o, given, flag);
      else if (o.default !== undefined) values[name] = convert(o, o.default, flag);
      else if (o.env && env[o.env] !== undefined && env[o.env] !== '') values[name] = convert(o, env[o.env] as string, `${flag} (from ${o.env})`);
      else values[name] = undefined;
    }
    return { values: values as Values<O>, positionals: raw.positionals };
  }

  /** The command's own help: usage, what it does, its options by group. */
  help(): string {
    const lines = [`usage: ${this.spec.name} ${this.spec.usage ?? '[options]'}`, '', this.spec.summary, ''];
    const groups = new Map<string, string[]>();
    const entries = [...Object.entries(this.spec.options), ['help', { help: 'this help', short: 'h' }] as const];
    for (const [name, o] of entries) {
      const left = `  ${o.short ? `-${o.short}, ` : ''}--${name}${'arg' in o && o.arg ? ` ${o.arg}` : ''}`;
      const [first, ...more] = o.help.split('\n');
      const head = left.length < 26 ? [`${left.padEnd(26)}${first}`] : [left, `${' '.repeat(26)}${first}`];
      const group = ('group' in o && o.group) || 'options';
      groups.set(group, [...(groups.get(group) ?? []), ...head, ...more.map((m) => `${' '.repeat(26)}${m}`)]);
    }
    for (const [group, rows] of groups) lines.push(`${group}:`, ...rows, '');
    if (this.spec.footer) lines.push(this.spec.footer.trimEnd(), '');
    return `${lines.join('\n').trimEnd()}\n`;
  }

  private parseArgsError(err: Error & { code?: string }): UsageError {
    const see = ` (see ${this.spec.name} --help)`;
    // Node quotes the option as typed ('--prot', '--quiet=yes') or as declared ('-q, --quiet <value>').
    const quoted = /'(-[^']*)'/.exec(err.message)?.[1] ?? '';
    const opt = /--[\w-]+/.exec(quoted)?.[0] ?? quoted.split('=')[0] ?? '';
    switch (err.code) {
      case 'ERR_PARSE_ARGS_UNKNOWN_OPTION': {
        const near = opt ? closest(opt.replace(/^-+/, ''), Object.keys(this.spec.options)) : undefined;
        return new UsageError(`unknown option ${opt}${near ? `; did you mean --${near}?` : ''}${see}`, opt);
      }
      case 'ERR_PARSE_ARGS_INVALID_OPTION_VALUE':
        return new UsageError(this.spec.options[opt.replace(/^-+/, '')]?.arg ? `${opt} needs a value${see}` : `${opt || 'an option'} takes no value${see}`, opt);
      default:
        return new UsageError(`${err.message}${see}`);
    }
  }
}

function convert(o: OptionSpec, text: string, flag: string): unknown {
  if (!o.parse) return text;
  try {
    return o.parse(text, flag);
  } catch (err) {
    if (isUsageError(err)) throw err;
    const msg = (err as Error).message;
    throw new UsageError(msg.includes(flag.split(' ')[0] as string) ? msg : `${flag}: ${msg}`, flag.split(' ')[0]);
  }
}

/** The known name nearest a mistyped one (at most two edits away), for "did you mean". */
function closest(typed: string, known: string[]): string | undefined {
  let best: { name: string; d: number } | undefined;
  for (const name of known) {
    const d = editDistance(typed, name);
    if (d <= 2 && (!best || d < best.d)) best = { name, d };
  }
  return best?.name;
}

function editDistance(a: string, b: string): number {
  let prev = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    const row = [i];
    for (let j = 1; j <= b.length; j++) row[j] = Math.min((prev[j] as number) + 1, (row[j - 1] as number) + 1, (prev[j - 1] as number) + (a[i - 1] === b[j - 1] ? 0 : 1));
    prev = row;
  }
  return prev[b.length] as number;
}

/* Value checks: each returns the converted value or throws a UsageError naming the option. */

/** A whole number from `min` to `max`. */
export function int(min: number, max = Number.MAX_SAFE_INTEGER): (text: string, option: string) => number {
  return (text, option) => {
    const n = /^-?\d+$/.test(text.trim()) ? Number(text) : NaN;
    if (!Number.isSafeInteger(n) || n < min || n > max) {
      const range = max === Number.MAX_SAFE_INTEGER ? (min === 1 ? '> 0' : `>= ${min}`) : `from ${min} to ${max}`;
      throw new UsageError(`${option} must be a whole number ${range}, got ${JSON.stringify(text)}`, option);
    }
    return n;
  };
}

/** A TCP port; 0 lets the system pick a free one. */
export function port(text: string, option: string): number {
  const n = /^\d+$/.test(text) ? Number(text) : NaN;
  if (!(n >= 0 && n <= 65535)) throw new UsageError(`${option} must be a port number from 0 to 65535 (0 picks a free one), got ${JSON.stringify(text)}`, option);
  return n;
}

/** One of a fixed list. */
export function oneOf<const T extends string>(choices: readonly T[]): (text: string, option: string) => T {
  return (text, option) => {
    if (!(choices as readonly string[]).includes(text)) throw new UsageError(`${option} must be one of ${choices.join(', ')}, got ${JSON.stringify(text)}`, option);
    return text as T;
  };
}

export const LOG_LEVELS = ['debug', 'info', 'warn', 'error'] as const satisfies readonly LogLevel[];
export const logLevel = oneOf(LOG_LEVELS);

/**
 * A path as the user meant it: relative to where they typed the command (`./hutch` runs
 * from the clone and passes its caller's directory as HUTCH_CALLER_CWD).
 */
export function callerPath(text: string): string {
  return resolve(process.env['HUTCH_CALLER_CWD'] ?? process.cwd(), text);
}

/** A directory the command may write, or create: not under /proc, /sys or /dev; returned absolute. */
export function writableDir(text: string, option: string): string {
  const dir = callerPath(text);
  if (/^\/(proc|sys|dev)(\/|$)/.test(dir)) throw new UsageError(`${option} ${dir} is under /${dir.split('/')[1]}, a kernel filesystem: give a directory on a disk`, option);
  let at = dir;
  while (!existsSync(at)) at = dirname(at);
  if (!statSync(at).isDirectory()) throw new UsageError(`${option} ${dir}: ${at} is not a directory`, option);
  try {
    accessSync(at, constants.W_OK | constants.X_OK);
  } catch (err) {
    throw new UsageError(`${option} ${dir}: ${at} is not writable (${(err as NodeJS.ErrnoException).code ?? (err as Error).message})`, option);
  }
  return dir;
}

/** A file's text (its trailing newline dropped): a token file, say. */
export function fileText(text: string, option: string): string {
  try {
    return readFileSync(callerPath(text), 'utf8').replace(/\r?\n$/, '');
  } catch (err) {
    throw new UsageError(`${option} ${text}: cannot read it (${(err as NodeJS.ErrnoException).code ?? (err as Error).message})`, option);
  }
}
