/**
 * git's configuration file syntax, read the way git 2.39's config.c reads it, so the router
 * sees exactly the entries git would. Anything this reader does not take (a stray byte, an
 * unterminated quote, an unknown escape) is an error, and the caller sends git to the VM:
 * git itself stops on a bad line, but a reader more lenient than git about structure could
 * miss a key git sees, so this one is never more lenient.
 *
 * Bytes are read as latin1 so every byte is one character; names are ASCII by the syntax.
 */

export interface ConfigEntry {
  /** Lowercased section name: `diff` for `[diff "pdf"]` and for the older `[diff.pdf]`. */
  section: string;
  /** The subsection (`[diff "Pdf"]`: `Pdf`, case kept; `[diff.Pdf]`: `pdf`), or null. */
  sub: string | null;
  /** Lowercased key name. */
  key: string;
  /** The value after unquoting, or null for a bare key (boolean true). */
  value: string | null;
}

export type ParsedConfig = { ok: true; entries: ConfigEntry[] } | { ok: false; error: string };

const isAlpha = (c: string): boolean => (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
const isKeyChar = (c: string): boolean => isAlpha(c) || (c >= '0' && c <= '9') || c === '-';
/** git's sane ctype: space, tab, newline, carriage return. */
const isSpace = (c: string): boolean => c === ' ' || c === '\t' || c === '\n' || c === '\r';

class Reader {
  private i: number;
  constructor(private readonly s: string) {
    this.i = s.startsWith('\xef\xbb\xbf') ? 3 : 0; // a UTF-8 BOM, skipped as git does
  }

  /** The next character, `\r\n` read as `\n`; undefined at the end. */
  next(): string | undefined {
    const c = this.s[this.i];
    if (c === undefined) return undefined;
    this.i++;
    if (c === '\r' && this.s[this.i] === '\n') {
      this.i++;
      return '\n';
    }
    return c;
  }

  get at(): number {
    return this.i;
  }
}

export function parseGitConfig(text: string): ParsedConfig {
  const r = new Reader(text);
  const entries: ConfigEntry[] = [];
  let stem: string | null = null;
  let comment = false;
  const fail = (why: string): ParsedConfig => ({ ok: false, error: `${why} (byte ${r.at})` });
  for (;;) {
    const c = r.next();
    if (c === undefined) return { ok: true, entries };
    if (c === '\n') {
      comment = false;
      continue;
    }
    if (comment || isSpace(c)) continue;
    if (c === '#' || c === ';') {
      comment = true;
      continue;
    }
    if (c === '[') {
      const head = readSection(r);
      if ('error' in head) return fail(head.error);
      stem = head.stem;
      continue;
    }
    if (!isAlpha(c)) return fail('a line that is neither a section, a key nor a comment');
    if (stem === null) return fail('a key before any section');
    const entry = readEntry(r, c);
    if ('error' in entry) return fail(entry.error);
    entries.push(splitName(`${stem}.${entry.key}`, entry.value));
  }
}

/** `section.sub.key` as git splits it: at the first and the last dot. */
function splitName(full: string, value: string | null): ConfigEntry {
  const first = full.indexOf('.');
  const last = full.lastIndexOf('.');
  return { section: full.slice(0, first), sub: last > first ? full.slice(first + 1, last) : null, key: full.slice(last + 1), value };
}

/** After `[`: the header's stem (`diff`, `diff.Pdf`, `a.b`) up to `]`. */
function readSection(r: Reader): { stem: string } | { error: string } {
  let name = '';
  for (;;) {
    const c = r.next();
    if (c === undefined || c === '\n') return { error: 'an unterminated section header' };
    if (isSpace(c)) {
      const sub = readSubsection(r);
      if ('error' in sub) return sub;
      return name ? { stem: `${name}.${sub.sub}` } : { error: 'an empty section name' };
    }
    if (c === ']') return name ? { stem: name } : { error: 'an empty section name' };
    if (!isKeyChar(c) && c !== '.') return { error: `a section name with ${JSON.stringify(c)}` };
    name += c.toLowerCase();
  }
}

/** After `[name `: the quoted subsection (case kept) and the closing `]`. */
function readSubsection(r: Reader): { sub: string } | { error: string } {
  let c: string | undefined;
  do c = r.next();
  while (c !== undefined && c !== '\n' && isSpace(c));
  if (c !== '"') return { error: 'a section header without a quoted subsection' };
  let sub = '';
  for (;;) {
    c = r.next();
    if (c === undefined || c === '\n') return { error: 'an unterminated subsection name' };
    if (c === '"') break;
    if (c === '\\') {
      c = r.next();
      if (c === undefined || c === '\n') return { error: 'an unterminated subsection name' };
    }
    sub += c;
  }
  return r.next() === ']' ? { sub } : { error: 'a subsection not followed by `]`' };
}

/** A key starting with `first`, and its value to the end of its (continued) line. */
function readEntry(r: Reader, first: string): { key: string; value: string | null } | { error: string } {
  let key = first.toLowerCase();
  let c: string | undefined;
  for (;;) {
    c = r.next();
    if (c === undefined || !isKeyChar(c)) break;
    key += c.toLowerCase();
  }
  while (c === ' ' || c === '\t') c = r.next();
  if (c === undefined || c === '\n') return { key, value: null };
  if (c !== '=') return { error: `key ${key} followed by ${JSON.stringify(c)} instead of \`=\`` };
  const value = readValue(r);
  return value === null ? { error: `the value of ${key} has an unterminated quote or an unknown escape` } : { key, value };
}

const ESCAPES: Record<string, string> = { '\\': '\\', '"': '"', n: '\n', t: '\t', b: '\b' };

/** A value to the end of its line, unquoted and unescaped; null where git refuses it. */
function readValue(r: Reader): string | null {
  let value = '';
  let quoted = false;
  let comment = false;
  let spaces = 0;
  for (;;) {
    const c = r.next();
    if (c === undefined || c === '\n') return quoted ? null : value;
    if (comment) continue;
    if (isSpace(c) && !quoted) {
      if (value.length > 0) spaces++;
      continue;
    }
    if (!quoted && (c === ';' || c === '#')) {
      comment = true;
      continue;
    }
    value += ' '.repeat(spaces);
    spaces = 0;
    if (c === '\\') {
      const e = r.next();
      if (e === '\n') continue; // a continued line
      const v = e === undefined ? undefined : ESCAPES[e];
      if (v === undefined) return null;
      value += v;
    } else if (c === '"') quoted = !quoted;
    else value += c;
  }
}
