/**
 * GNU sed script analysis: a small tokenizer that walks addresses and commands and refuses
 * the ones that reach outside the input and output streams: `w`/`W` and `s///w` write
 * files, `e` and `s///e` run commands. `r`/`R` read a file, which the caller checks as a
 * path. Unknown commands are refused rather than skipped.
 *
 * Regular expressions may hide the delimiter in a bracket expression (`s/[/]/x/` is valid
 * GNU sed). Rather than trust one reading, the script is tokenized twice, with and without
 * bracket awareness, and accepted only if both readings accept it.
 */

export type SedAnalysis = { ok: true; reads: string[] } | { ok: false; reason: string };

/** Commands that take no argument. */
const PLAIN = new Set(['=', 'd', 'D', 'g', 'G', 'h', 'H', 'n', 'N', 'p', 'P', 'x', 'z', 'F', '{', '}']);
/** Commands with an optional number (`q5`, `l 70`). */
const NUMBERED = new Set(['q', 'Q', 'l', 'L']);

class Refusal extends Error {}

export function analyseSed(script: string): SedAnalysis {
  const a = tokenize(script, true);
  if (!a.ok) return a;
  const b = tokenize(script, false);
  if (!b.ok) return b;
  return { ok: true, reads: [...new Set([...a.reads, ...b.reads])] };
}

function tokenize(s: string, brackets: boolean): SedAnalysis {
  const reads: string[] = [];
  let i = 0;
  const peek = (): string | undefined => s[i];
  const refuse = (why: string): never => {
    throw new Refusal(why);
  };
  const skipBlanks = (): void => {
    while (i < s.length && (s[i] === ' ' || s[i] === '\t')) i++;
  };
  const restOfLine = (): string => {
    const nl = s.indexOf('\n', i);
    const end = nl < 0 ? s.length : nl;
    const out = s.slice(i, end);
    i = end;
    return out;
  };
  /** Reads up to an unescaped delimiter; in a regex, optionally skipping bracket expressions. */
  const delimited = (delim: string, isRegex: boolean): void => {
    while (i < s.length) {
      const ch = s[i] as string;
      if (ch === '\\') {
        i += 2;
        continue;
      }
      if (ch === delim) {
        i++;
        return;
      }
      if (isRegex && brackets && ch === '[') {
        i = skipBracket(s, i);
        continue;
      }
      if (ch === '\n' && !isRegex) {
        i++;
        continue;
      }
      if (ch === '\n') refuse('sed script has an unterminated regular expression');
      i++;
    }
    refuse('sed script has an unterminated `s`, `y` or address');
  };
  /** `s/regex/replacement/` and `y/src/dst/`: a delimiter, then two delimited parts. */
  const twoParts = (cmd: string, firstIsRegex: boolean): void => {
    const d = s[i];
    if (d === undefined || d === '\n' || d === '\\') refuse(`sed \`${cmd}\` has a bad delimiter`);
    i++;
    delimited(d as string, firstIsRegex);
    delimited(d as string, false);
  };
  const address = (): void => {
    const ch = peek();
    if (ch === undefined) return;
    if (/[0-9]/.test(ch)) {
      while (i < s.length && /[0-9~]/.test(s[i] as string)) i++;
    } else if (ch === '$') i++;
    else if (ch === '/') {
      i++;
      delimited('/', true);
      while (peek() === 'I' || peek() === 'M') i++;
    } else if (ch === '\\') {
      const d = s[i + 1];
      if (d === undefined || d === '\n') refuse('sed script has a bad address');
      i += 2;
      delimited(d as string, true);
      while (peek() === 'I' || peek() === 'M') i++;
    }
  };
  const endOfCommand = (): void => {
    skipBlanks();
    const ch = peek();
    if (ch === undefined || ch === ';' || ch === '\n' || ch === '}') return;
    if (ch === '#') {
      restOfLine();
      return;
    }
    refuse(`sed script has unexpected \`${ch}\` after a command`);
  };
  // Labels end at `;` or a newline in GNU sed; stopping also at blanks and `}` can only make
  // us read more of the script as commands, which is the safe direction.
  const label = (): void => {
    skipBlanks();
    while (i < s.length && !';\n \t}'.includes(s[i] as string)) i++;
  };

  try {
    while (i < s.length) {
      const c0 = s[i] as string;
      if (c0 === ' ' || c0 === '\t' || c0 === '\n' || c0 === ';') {
        i++;
        continue;
      }
      if (c0 === '#') {
        restOfLine();
        continue;
      }
      address();
      skipBlanks();
      if (peek() === ',') {
        i++;
        skipBlanks();
        if (peek() === '+' || peek() === '~') {
          i++;
          while (i < s.length && /[0-9]/.test(s[i] as string)) i++;
        } else address();
        skipBlanks();
      }
      while (peek() === '!') {
        i++;
        skipBlanks();
      }
      const cmd = s[i];
      if (cmd === undefined) refuse('sed script ends after an address');
      i++;
      if (PLAIN.has(cmd as string)) {
        if (cmd !== '{') endOfCommand();
        continue;
      }
      if (NUMBERED.has(cmd as string)) {
        skipBlanks();
        while (i < s.length && /[0-9]/.test(s[i] as string)) i++;
        endOfCommand();
        continue;
      }
      switch (cmd) {
        case ':':
        case 'b':
        case 't':
        case 'T':
          label();
          continue;
        case 'a':
        case 'i':
        case 'c': {
          // GNU one-liner `a text` or classic `a\<newline>text`; text runs to an unescaped
          // newline and `;` does not end it.
          skipBlanks();
          if (peek() === '\\') {
            i++;
            if (peek() === '\n') i++;
          }
          while (i < s.length && s[i] !== '\n') i += s[i] === '\\' ? 2 : 1;
          continue;
        }
        case 'r':
        case 'R': {
          skipBlanks();
          const file = restOfLine();
          if (file === '') refuse(`sed \`${cmd}\` needs a file name`);
          reads.push(file);
          continue;
        }
        case 'w':
        case 'W':
          refuse(`sed script uses \`${cmd}\` (writes a file)`);
          break;
        case 'e':
          refuse('sed script uses `e` (runs a command)');
          break;
        case 'v':
          label();
          continue;
        case 's': {
          twoParts('s', true);
          while (i < s.length) {
            const f = s[i] as string;
            if (f === 'e') refuse('sed `s///e` runs the pattern space as a command');
            if (f === 'w') refuse('sed `s///w` writes a file');
            if ('gpiImM0123456789'.includes(f)) {
              i++;
              continue;
            }
            break;
          }
          endOfCommand();
          continue;
        }
        case 'y':
          twoParts('y', false);
          endOfCommand();
          continue;
        default:
          refuse(`sed script command \`${cmd === '\n' ? '\\n' : cmd}\` is not recognised`);
      }
    }
  } catch (err) {
    if (err instanceof Refusal) return { ok: false, reason: err.message };
    throw err;
  }
  return { ok: true, reads };
}

/** Index just past a bracket expression starting at `start` (`[`), or past `[` if unclosed. */
function skipBracket(s: string, start: number): number {
  let i = start + 1;
  if (s[i] === '^') i++;
  if (s[i] === ']') i++;
  while (i < s.length) {
    const ch = s[i];
    if (ch === '[' && (s[i + 1] === ':' || s[i + 1] === '.' || s[i + 1] === '=')) {
      const close = s.indexOf(`${s[i + 1]}]`, i + 2);
      if (close < 0) return start + 1;
      i = close + 2;
      continue;
    }
    if (ch === ']') return i + 1;
    if (ch === '\n') return start + 1;
    i++;
  }
  return start + 1;
}
