import { HutchError } from '../protocol/errors.ts';

/**
 * Glob patterns with ripgrep/gitignore semantics, which is what opencode's glob and
 * grep `include` pass to ripgrep: `*` and `?` stay within a path component, `**` spans
 * components, `[...]` classes (never matching `/`), `{a,b}` alternatives; a pattern
 * without `/` matches the file name at any depth.
 *
 * Matching is linear in the name: the pattern compiles to a Thompson NFA, run as a lazily
 * built DFA (each state is the set of NFA states reachable so far, built once and cached
 * per matcher), the way RE2 does. No backtracking, so `*a*a*a*a*a*a*a*a*a*a*a*a*c` against
 * a long name costs one pass over the name, not exponential time on the event loop.
 */
export interface GlobMatcher {
  (relPath: string): boolean;
}

export function compileGlob(pattern: string): GlobMatcher {
  const anchored = pattern.includes('/');
  const p = pattern.startsWith('./') ? pattern.slice(2) : pattern.startsWith('/') ? pattern.slice(1) : pattern;
  const ast = new Parser(p, pattern).parse();
  const dfa = new LazyDfa(buildNfa(ast));
  if (anchored) return (rel) => dfa.matches(rel);
  return (rel) => dfa.matches(rel.slice(rel.lastIndexOf('/') + 1));
}

// ------------------------------------------------------------------ parsing

type Node =
  | { k: 'lit'; c: number }
  | { k: 'one' } // ?: any character but /
  | { k: 'star' } // *: any run without /
  | { k: 'dirs' } // **/ : zero or more whole components
  | { k: 'all' } // trailing **: anything
  | { k: 'cls'; neg: boolean; ranges: number[] } // [lo, hi, lo, hi, ...]
  | { k: 'alt'; alts: Node[][] };

class Parser {
  private i = 0;
  private readonly cps: number[];

  constructor(
    private readonly p: string,
    private readonly original: string,
  ) {
    this.cps = Array.from(p, (ch) => ch.codePointAt(0) as number);
  }

  parse(): Node[] {
    const seq = this.seq(0);
    return seq;
  }

  /** A sequence up to the end, or (inside braces) up to the `,` or `}` that ends it. */
  private seq(depth: number): Node[] {
    const out: Node[] = [];
    const s = this.cps;
    while (this.i < s.length) {
      const c = s[this.i] as number;
      if (depth > 0 && (c === 0x2c /* , */ || c === 0x7d /* } */)) return out;
      if (c === 0x2a /* * */) {
        if (s[this.i + 1] === 0x2a) {
          const atStart = this.i === 0 || s[this.i - 1] === 0x2f;
          const atEnd = this.i + 2 === s.length || s[this.i + 2] === 0x2f;
          if (atStart && atEnd) {
            if (this.i + 2 === s.length) {
              out.push({ k: 'all' });
              this.i += 2;
            } else {
              out.push({ k: 'dirs' });
              this.i += 3;
            }
            continue;
          }
        }
        out.push({ k: 'star' });
        this.i++;
      } else if (c === 0x3f /* ? */) {
        out.push({ k: 'one' });
        this.i++;
      } else if (c === 0x5b /* [ */) {
        out.push(this.cls());
      } else if (c === 0x7b /* { */) {
        this.i++;
        const alts: Node[][] = [this.seq(depth + 1)];
        while (s[this.i] === 0x2c) {
          this.i++;
          alts.push(this.seq(depth + 1));
        }
        if (s[this.i] !== 0x7d) throw new HutchError('bad_request', `unterminated { in glob ${this.original}`, { pattern: this.original });
        this.i++;
        out.push({ k: 'alt', alts });
      } else if (c === 0x5c /* \ */ && this.i + 1 < s.length) {
        out.push({ k: 'lit', c: s[this.i + 1] as number });
        this.i += 2;
      } else {
        out.push({ k: 'lit', c });
        this.i++;
      }
    }
    return out;
  }

  /** `[...]`: a `]` right after `[` (or `[!`) is literal; `!` or `^` negates; `a-z` ranges. */
  private cls(): Node {
    const s = this.cps;
    let j = this.i + 1;
    let neg = false;
    if (s[j] === 0x21 || s[j] === 0x5e) {
      neg = true;
      j++;
    }
    const first = j;
    while (j < s.length && (s[j] !== 0x5d || j === first)) j++;
    if (j >= s.length) throw new HutchError('bad_request', `unterminated [ in glob ${this.original}`, { pattern: this.original });
    const body = s.slice(first, j);
    const ranges: number[] = [];
    for (let k = 0; k < body.length; k++) {
      const lo = body[k] as number;
      if (body[k + 1] === 0x2d && k + 2 < body.length) {
        ranges.push(lo, body[k + 2] as number);
        k += 2;
      } else ranges.push(lo, lo);
    }
    this.i = j + 1;
    return { k: 'cls', neg, ranges };
  }
}

// ------------------------------------------------------------------ NFA

/** NFA state: `eps` has only epsilon edges; a consuming state tests one code point and goes to `next`. */
type State =
  | { t: 'eps'; out: number[] }
  | { t: 'test'; test: (c: number) => boolean; next: number }
  | { t: 'match' };

const SLASH = 0x2f;
const notSlash = (c: number) => c !== SLASH;
const anything = () => true;

function buildNfa(ast: Node[]): { states: State[]; start: number } {
  const states: State[] = [{ t: 'match' }];
  const add = (s: State): number => states.push(s) - 1;
  const eps = (): number => add({ t: 'eps', out: [] });
  const setOut = (id: number, out: number[]) => ((states[id] as { out: number[] }).out = out);

  // Compiled back to front: each node gets the state that follows it.
  const seq = (nodes: Node[], next: number): number => {
    let cur = next;
    for (let i = nodes.length - 1; i >= 0; i--) cur = node(nodes[i] as Node, cur);
    return cur;
  };
  const loop = (test: (c: number) => boolean, next: number): number => {
    const l = eps();
    const body = add({ t: 'test', test, next: l });
    setOut(l, [body, next]);
    return l;
  };
  const node = (n: Node, next: number): number => {
    switch (n.k) {
      case 'lit':
        return add({ t: 'test', test: (c) => c === n.c, next });
      case 'one':
        return add({ t: 'test', test: notSlash, next });
      case 'star':
        return loop(notSlash, next);
      case 'all':
        return loop(anything, next);
      case 'dirs': {
        // (.*/)? : skip, or anything followed by a slash.
        const slash = add({ t: 'test', test: (c) => c === SLASH, next });
        const any = loop(anything, slash);
        const e = eps();
        setOut(e, [next, any]);
        return e;
      }
      case 'cls': {
        const { neg, ranges } = n;
        const inRanges = (c: number) => {
          for (let i = 0; i < ranges.length; i += 2) if (c >= (ranges[i] as number) && c <= (ranges[i + 1] as number)) return true;
          return false;
        };
        return add({ t: 'test', test: (c) => c !== SLASH && inRanges(c) !== neg, next });
      }
      case 'alt': {
        const e = eps();
        setOut(e, n.alts.map((a) => seq(a, next)));
        return e;
      }
    }
  };
  return { states, start: seq(ast, 0) };
}

// ------------------------------------------------------------------ lazy DFA

interface DState {
  /** Consuming NFA states in this set. */
  tests: number[];
  accepting: boolean;
  /** Transitions for code points < 128, filled on first use. */
  ascii: Array<DState | undefined>;
  other: Map<number, DState>;
}

/** Above this many cached DFA states the cache is dropped and rebuilt as needed (memory bound). */
const MAX_DFA_STATES = 4096;

class LazyDfa {
  private cache = new Map<string, DState>();
  private start: DState;
  private readonly mark: Int32Array;
  private gen = 0;

  constructor(private readonly nfa: { states: State[]; start: number }) {
    this.mark = new Int32Array(nfa.states.length);
    this.start = this.state([nfa.start]);
  }

  matches(s: string): boolean {
    let d = this.start;
    for (let i = 0; i < s.length; i++) {
      let c = s.charCodeAt(i);
      if (c >= 0xd800 && c <= 0xdbff && i + 1 < s.length) {
        const lo = s.charCodeAt(i + 1);
        if (lo >= 0xdc00 && lo <= 0xdfff) {
          c = (c - 0xd800) * 0x400 + (lo - 0xdc00) + 0x10000;
          i++;
        }
      }
      d = this.step(d, c);
      if (d.tests.length === 0) return d.accepting && i === s.length - 1;
    }
    return d.accepting;
  }

  private step(d: DState, c: number): DState {
    const cached = c < 128 ? d.ascii[c] : d.other.get(c);
    if (cached) return cached;
    const targets: number[] = [];
    for (const id of d.tests) {
      const st = this.nfa.states[id] as { test: (c: number) => boolean; next: number };
      if (st.test(c)) targets.push(st.next);
    }
    if (this.cache.size > MAX_DFA_STATES) {
      // Dropping the cache keeps memory bounded; `d` stays valid as a detached state.
      this.cache = new Map();
      this.start = this.state([this.nfa.start]);
    }
    const next = this.state(targets);
    if (c < 128) d.ascii[c] = next;
    else d.other.set(c, next);
    return next;
  }

  /** The DFA state for the epsilon closure of `seeds`. */
  private state(seeds: number[]): DState {
    const g = ++this.gen;
    const tests: number[] = [];
    let accepting = false;
    const stack = [...seeds];
    while (stack.length > 0) {
      const id = stack.pop() as number;
      if (this.mark[id] === g) continue;
      this.mark[id] = g;
      const st = this.nfa.states[id] as State;
      if (st.t === 'match') accepting = true;
      else if (st.t === 'test') tests.push(id);
      else for (let k = st.out.length - 1; k >= 0; k--) stack.push(st.out[k] as number);
    }
    tests.sort((a, b) => a - b);
    const key = `${accepting ? 1 : 0}:${tests.join(',')}`;
    let d = this.cache.get(key);
    if (!d) {
      d = { tests, accepting, ascii: new Array(128), other: new Map() };
      this.cache.set(key, d);
    }
    return d;
  }
}
