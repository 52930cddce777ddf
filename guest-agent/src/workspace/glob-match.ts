import { HutchError } from '../protocol/errors.ts';

/**
 * Glob patterns with ripgrep/gitignore semantics, which is what opencode's glob and
 * grep `include` pass to ripgrep: `*` and `?` stay within a path component, `**` spans
 * components, `[...]` classes, `{a,b}` alternatives; a pattern without `/` matches the
 * file name at any depth.
 */
export interface GlobMatcher {
  (relPath: string): boolean;
}

export function compileGlob(pattern: string): GlobMatcher {
  const anchored = pattern.includes('/');
  const p = pattern.startsWith('./') ? pattern.slice(2) : pattern.startsWith('/') ? pattern.slice(1) : pattern;
  const re = new RegExp(`^${translate(p, pattern)}$`, 's');
  if (anchored) return (rel) => re.test(rel);
  return (rel) => re.test(rel.slice(rel.lastIndexOf('/') + 1));
}

function translate(p: string, original: string): string {
  let out = '';
  let i = 0;
  let braceDepth = 0;
  while (i < p.length) {
    const c = p[i] as string;
    if (c === '*') {
      if (p[i + 1] === '*') {
        const atStart = i === 0 || p[i - 1] === '/';
        const atEnd = i + 2 === p.length || p[i + 2] === '/';
        if (atStart && atEnd) {
          if (i + 2 === p.length) out += '.*';
          else out += '(?:.*/)?';
          i += i + 2 === p.length ? 2 : 3;
          continue;
        }
      }
      out += '[^/]*';
      i++;
    } else if (c === '?') {
      out += '[^/]';
      i++;
    } else if (c === '[') {
      const close = p.indexOf(']', i + 2);
      if (close === -1) throw new HutchError('bad_request', `unterminated [ in glob ${original}`, { pattern: original });
      let cls = p.slice(i + 1, close);
      if (cls.startsWith('!')) cls = '^' + cls.slice(1);
      out += `[${cls.replace(/\\/g, '\\\\')}]`;
      i = close + 1;
    } else if (c === '{') {
      braceDepth++;
      out += '(?:';
      i++;
    } else if (c === '}' && braceDepth > 0) {
      braceDepth--;
      out += ')';
      i++;
    } else if (c === ',' && braceDepth > 0) {
      out += '|';
      i++;
    } else if (c === '\\' && i + 1 < p.length) {
      out += escapeRe(p[i + 1] as string);
      i += 2;
    } else {
      out += escapeRe(c);
      i++;
    }
  }
  if (braceDepth > 0) throw new HutchError('bad_request', `unterminated { in glob ${original}`, { pattern: original });
  return out;
}

function escapeRe(c: string): string {
  return /[.*+?^${}()|[\]\\/]/.test(c) ? `\\${c}` : c;
}
