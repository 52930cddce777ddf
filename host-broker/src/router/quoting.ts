/**
 * Bash quote removal for the three quoting forms the parser hands over as raw text:
 * unquoted words (backslash escapes), double-quoted runs, and ANSI-C `$'...'` strings.
 */
import type { WordPart } from './script.ts';

/** Quote removal for an unquoted word: `\x` is a quoted x, `\<newline>` disappears. */
export function unquotedText(t: string, out: WordPart[], onExpansion: () => void): void {
  let buf = '';
  for (let i = 0; i < t.length; i++) {
    const ch = t[i] as string;
    if (ch === '\\') {
      if (buf) out.push({ kind: 'text', text: buf, quoted: false });
      buf = '';
      const next = t[i + 1];
      i++;
      if (next === undefined) out.push({ kind: 'text', text: '\\', quoted: true });
      else if (next !== '\n') out.push({ kind: 'text', text: next, quoted: true });
    } else if (ch === '$' || ch === '`') {
      // The grammar turns real expansions into their own nodes; one left inside a plain
      // word means we misunderstand it.
      onExpansion();
      return;
    } else buf += ch;
  }
  if (buf) out.push({ kind: 'text', text: buf, quoted: false });
}

export function dqUnescape(t: string): string {
  let out = '';
  for (let i = 0; i < t.length; i++) {
    const ch = t[i] as string;
    const next = t[i + 1];
    if (ch === '\\' && next !== undefined && '$`"\\\n'.includes(next)) {
      if (next !== '\n') out += next;
      i++;
    } else out += ch;
  }
  return out;
}

const ANSI_SIMPLE: Record<string, string> = { a: '\x07', b: '\b', e: '\x1b', E: '\x1b', f: '\f', n: '\n', r: '\r', t: '\t', v: '\v', '\\': '\\', "'": "'", '"': '"', '?': '?' };

/** Decodes the body of `$'...'`; null for escapes we do not decode (\c, \u, ...). */
export function decodeAnsiC(body: string): string | null {
  let out = '';
  for (let i = 0; i < body.length; i++) {
    const ch = body[i] as string;
    if (ch !== '\\') {
      out += ch;
      continue;
    }
    const next = body[i + 1];
    if (next === undefined) return null;
    const simple = ANSI_SIMPLE[next];
    if (simple !== undefined) {
      out += simple;
      i++;
      continue;
    }
    if (next >= '0' && next <= '7') {
      let j = i + 1;
      let digits = '';
      while (j < body.length && digits.length < 3 && (body[j] as string) >= '0' && (body[j] as string) <= '7') digits += body[j++];
      out += String.fromCharCode(parseInt(digits, 8));
      i = j - 1;
      continue;
    }
    if (next === 'x') {
      let j = i + 2;
      let digits = '';
      while (j < body.length && digits.length < 2 && /[0-9a-fA-F]/.test(body[j] as string)) digits += body[j++];
      if (!digits) return null;
      out += String.fromCharCode(parseInt(digits, 16));
      i = j - 1;
      continue;
    }
    return null;
  }
  return out;
}
