/**
 * Word expansion as bash would do it, for the parts the router can prove: known shell
 * variables, `$?`-style numeric parameters, brace lists, quote removal. Globs are not
 * expanded (that needs the file system) but marked, so callers can check where they look.
 * Anything whose value could differ between the fast path and the VM (`~`, `$HOME`, unset
 * variables) is refused here with a reason.
 */
import type { Word } from './script.ts';

export interface Expanded {
  /** The argument after quote removal; glob characters are kept as written. */
  value: string;
  /** Has unquoted `*`, `?` or `[`: bash replaces it with matching file names. */
  glob: boolean;
  /** A glob at its very start, which may match a file named like an option (`-rf`). */
  globLeading: boolean;
  /** A glob component that could match `..` (`.*`, `[.]*`): treated as leaving its directory. */
  globDotDot: boolean;
  /** The source word, for reasons. */
  source: string;
}

export type ExpandResult = { ok: true; words: Expanded[] } | { ok: false; reason: string };

/** Parameters whose value is a number no matter where the command runs. */
const NUMERIC_PARAMS: Record<string, string> = {
  '?': '0', // last exit status: digits
  '#': '0', // bash -c has no positional parameters
  $: '0', // a pid: digits
};

/** How many words one brace expansion may produce before we give up on it. */
const MAX_BRACE_WORDS = 256;
/** How many characters the words of one brace expansion may add up to, intermediate ones included. */
const MAX_BRACE_CHARS = 64 * 1024;

const GLOB_CHARS = new Set(['*', '?', '[']);

/** A word as characters with a "was quoted" flag each; expansions see only unquoted ones. */
interface Chars {
  text: string[];
  quoted: boolean[];
}

export interface ExpandOptions {
  /** Assignment values and here-strings: no brace expansion, no word splitting, no globbing. */
  assignment?: boolean;
}

export function expandWord(w: Word, vars: ReadonlyMap<string, string>, opts: ExpandOptions = {}): ExpandResult {
  const chars: Chars = { text: [], quoted: [] };
  for (const p of w.parts) {
    if (p.kind === 'text') {
      for (const ch of p.text) {
        chars.text.push(ch);
        chars.quoted.push(p.quoted);
      }
      continue;
    }
    const value = NUMERIC_PARAMS[p.name] ?? vars.get(p.name);
    if (value === undefined) {
      return { ok: false, reason: `\`${p.source}\` is not set by this command, and its value may differ between the fast path and the VM` };
    }
    if (!p.quoted && !opts.assignment && (value === '' || /[\s*?[\]{}~]/.test(value))) {
      return { ok: false, reason: `unquoted \`${p.source}\` would be split or globbed` };
    }
    // The value is inert from here on: no brace, tilde or glob expansion applies to it.
    for (const ch of value) {
      chars.text.push(ch);
      chars.quoted.push(true);
    }
  }
  if (startsWithTilde(chars, opts.assignment === true)) {
    return { ok: false, reason: `\`${w.source}\` refers to HOME, which the fast path does not have` };
  }
  if (opts.assignment) {
    return { ok: true, words: [{ value: chars.text.join(''), glob: false, globLeading: false, globDotDot: false, source: w.source }] };
  }
  const expanded = braceExpand(chars);
  if (expanded === null) return { ok: false, reason: `brace expansion in \`${w.source}\` yields too many words` };
  return { ok: true, words: expanded.map((c) => describe(c, w.source)) };
}

function startsWithTilde(c: Chars, assignment: boolean): boolean {
  for (let i = 0; i < c.text.length; i++) {
    if (c.text[i] !== '~' || c.quoted[i]) continue;
    // Bash expands an unquoted leading `~`, and in assignments also one after `:` or `=`.
    if (i === 0) return true;
    if (assignment && (c.text[i - 1] === ':' || c.text[i - 1] === '=')) return true;
  }
  return false;
}

function describe(c: Chars, source: string): Expanded {
  let glob = false;
  let globDotDot = false;
  let compStart = 0;
  let compGlob = false;
  const closeComponent = (end: number): void => {
    if (compGlob && end > compStart) {
      const first = c.text[compStart];
      if (first === '.' || (first === '[' && !c.quoted[compStart])) globDotDot = true;
    }
  };
  for (let i = 0; i <= c.text.length; i++) {
    const ch = c.text[i];
    if (ch === undefined || ch === '/') {
      closeComponent(i);
      compStart = i + 1;
      compGlob = false;
      continue;
    }
    if (!c.quoted[i] && GLOB_CHARS.has(ch)) {
      glob = true;
      compGlob = true;
    }
  }
  const first = c.text[0];
  return {
    value: c.text.join(''),
    glob,
    globLeading: first !== undefined && !c.quoted[0] && GLOB_CHARS.has(first),
    globDotDot,
    source,
  };
}

/**
 * Bash brace expansion of comma lists (`{a,b}`, nested, with prefix and suffix), on unquoted
 * braces only. `{}` and `{x}` stay literal, as in bash. Null when it would explode: more
 * than MAX_BRACE_WORDS words, or more than MAX_BRACE_CHARS characters built on the way (a
 * 256 KiB word of nested groups is within the first bound and far past the second).
 */
function braceExpand(c: Chars, budget = { chars: MAX_BRACE_CHARS }): Chars[] | null {
  const group = findBraceGroup(c);
  if (!group) return [c];
  const { open, close, commas } = group;
  const bounds = [open, ...commas, close];
  const out: Chars[] = [];
  for (let k = 0; k + 1 < bounds.length; k++) {
    const a = (bounds[k] as number) + 1;
    const b = bounds[k + 1] as number;
    budget.chars -= open + (b - a) + (c.text.length - close - 1);
    if (budget.chars < 0) return null;
    const joined: Chars = {
      text: [...c.text.slice(0, open), ...c.text.slice(a, b), ...c.text.slice(close + 1)],
      quoted: [...c.quoted.slice(0, open), ...c.quoted.slice(a, b), ...c.quoted.slice(close + 1)],
    };
    const sub = braceExpand(joined, budget);
    if (sub === null) return null;
    out.push(...sub);
    if (out.length > MAX_BRACE_WORDS) return null;
  }
  return out;
}

/**
 * The leftmost unquoted `{` whose matching `}` has a comma at its own level, in one pass:
 * every `{` is matched with a stack, each comma belongs to the innermost open one. (Matching
 * from each `{` in turn was quadratic: 144 s of the broker's loop for one word of 85,000
 * unclosed `{a,`.)
 */
function findBraceGroup(c: Chars): { open: number; close: number; commas: number[] } | null {
  const stack: Array<{ open: number; commas: number[] }> = [];
  let best: { open: number; close: number; commas: number[] } | null = null;
  for (let i = 0; i < c.text.length; i++) {
    if (c.quoted[i]) continue;
    const ch = c.text[i];
    if (ch === '{') stack.push({ open: i, commas: [] });
    else if (ch === ',' && stack.length > 0) (stack[stack.length - 1] as { commas: number[] }).commas.push(i);
    else if (ch === '}') {
      const g = stack.pop();
      // `{x}` is literal; of the groups with commas the leftmost opening one goes first.
      if (g && g.commas.length > 0 && (!best || g.open < best.open)) best = { open: g.open, close: i, commas: g.commas };
    }
  }
  return best;
}
