/**
 * Shell parser adapter: bash source -> {@link Script} (simple commands, tests, assignments,
 * and the problems that make a command unprovable).
 *
 * Why tree-sitter-bash (through web-tree-sitter), measured on this machine (Node 20):
 * - `sh-syntax` (mvdan/sh compiled to wasm, the maintained successor of `mvdan-sh`): its
 *   API is async only and instantiates a fresh Go wasm instance per call, ~6.5 ms per parse;
 *   its JSON AST drops the Go interface types (a statement's `Cmd` arrives as bare Pos/End),
 *   so the tree cannot be walked without re-deriving node kinds.
 * - `mvdan-sh` (GopherJS): deprecated by its author in 2025, frozen on an old mvdan/sh.
 * - `bash-parser`: unmaintained since 2017, fails on common bash (here-strings, `[[ ]]`).
 * - `web-tree-sitter` + `tree-sitter-bash` (both from the tree-sitter organisation, released
 *   2025): one async init (~50 ms: the runtime and a 1.3 MB grammar wasm), then a
 *   synchronous parse of ~10-60 us per typical agent command with a typed, field-named tree
 *   covering here-docs, `$(...)`, backticks, `[[ ]]`, process substitution and arithmetic.
 *   Only the wasm grammar is used; the package's optional native addon is never built.
 *
 * tree-sitter recovers from syntax errors instead of failing, so any ERROR or MISSING node
 * makes the whole command a `syntax` problem. Two grammar quirks are corrected here:
 * a redirection swallows the words after its target (`echo >&2 hi` gives the redirect two
 * destinations; bash passes `hi` to echo), and a here-document's node holds whatever
 * follows its start on the line (`| cmd`, `&& cmd`, more redirections or arguments).
 * Node kinds this adapter does not know are `unsupported` problems, never ignored.
 */
import { createRequire } from 'node:module';
import { Language, Parser, type Node } from 'web-tree-sitter';
import { decodeAnsiC, dqUnescape, unquotedText } from './quoting.ts';
import type { Assignment, Problem, ProblemCode, Redirect, RedirectOp, Script, Step, Word, WordPart } from './script.ts';

let parser: Parser | null = null;
let initializing: Promise<void> | null = null;

/** Loads the wasm runtime and the bash grammar once; later calls return the same promise. */
export function initShellParser(): Promise<void> {
  initializing ??= (async () => {
    await Parser.init();
    const wasm = createRequire(import.meta.url).resolve('tree-sitter-bash/tree-sitter-bash.wasm');
    const bash = await Language.load(wasm);
    const p = new Parser();
    p.setLanguage(bash);
    parser = p;
  })();
  return initializing;
}

export function shellParserReady(): boolean {
  return parser !== null;
}

/**
 * Syntax nodes one command may have. Parsing and analysis run on the broker's loop, at
 * 1-4 us a node to parse and about 10 us a node to analyse: a tenant's 256 KiB of
 * `ls a a a...` (131,000 nodes) held every session for 3 s, one of `"a""a"...` (350,000
 * nodes) for 1.4 s in the parse alone. Within this budget a command costs the loop 20-30
 * ms at most; an agent's command has tens to a few hundred nodes.
 */
export const MAX_SYNTAX_NODES = 2048;
/**
 * Progress checks a parse may take before it is cancelled: tree-sitter makes one every 100
 * parser operations, about one per 20-40 nodes, so a parse heading far past
 * MAX_SYNTAX_NODES ends after a few milliseconds instead of building the whole tree.
 */
const MAX_PARSE_CHECKS = 100;

/** Parses `source` synchronously; {@link initShellParser} must have resolved first. */
export function parseScript(source: string): Script {
  const p = parser;
  if (!p) throw new Error('shell parser not initialised: await initRouter() first');
  let checks = 0;
  const tree = p.parse(source, null, { progressCallback: () => ++checks > MAX_PARSE_CHECKS });
  const adapter = new Adapter(source);
  if (!tree) {
    // A cancelled parse resumes on the next call unless the parser is reset.
    p.reset();
    adapter.problem('too_complex', `the command has more syntax than the router analyses (over ${MAX_SYNTAX_NODES} nodes)`, null);
    return adapter.result();
  }
  try {
    const root = tree.rootNode;
    if (root.descendantCount > MAX_SYNTAX_NODES) {
      adapter.problem('too_complex', `the command has ${root.descendantCount} syntax nodes, more than the ${MAX_SYNTAX_NODES} the router analyses`, null);
      return adapter.result();
    }
    if (root.hasError) {
      const bad = firstError(root);
      const near = bad ? clip(source.slice(bad.startIndex, Math.max(bad.endIndex, bad.startIndex + 1)) || source.slice(bad.startIndex)) : '';
      adapter.problem('syntax', near ? `the shell parser cannot parse it (near \`${near}\`)` : 'the shell parser cannot parse it', bad ?? root);
      return adapter.result();
    }
    adapter.statement(root);
    return adapter.result();
  } finally {
    tree.delete();
  }
}

function firstError(n: Node): Node | null {
  if (n.isError || n.isMissing) return n;
  for (const c of n.children) {
    if (c.hasError || c.isMissing || c.isError) {
      const hit = firstError(c);
      if (hit) return hit;
    }
  }
  return null;
}

/** Shortens source excerpts quoted in reasons. */
export function clip(s: string, max = 40): string {
  const one = s.replace(/\s+/g, ' ').trim();
  return one.length > max ? `${one.slice(0, max - 1)}…` : one;
}

/** Statement kinds whose tokens only sequence or group commands. */
const SEPARATORS: Record<string, ReadonlySet<string>> = {
  program: new Set([';', '&&', '||', '\n']),
  list: new Set([';', '&&', '||', '\n']),
  pipeline: new Set(['|', '|&']),
  negated_command: new Set(['!']),
  subshell: new Set(['(', ')', ';', '\n']),
  compound_statement: new Set(['{', '}', ';', '\n']),
};

const CONTROL_FLOW = new Set(['if_statement', 'while_statement', 'for_statement', 'c_style_for_statement', 'case_statement']);

const REDIRECT_OPS = new Set<string>(['<', '>', '>>', '>|', '&>', '&>>', '>&', '<&', '>&-', '<&-']);

interface PendingRedirects {
  redirects: Redirect[];
  /** Words bash gives to the command although the grammar put them under a redirection. */
  extraWords: Word[];
  /** Statements the grammar nested inside a here-document node (`cat <<EOF | grep x`). */
  trailing: Node[];
}

class Adapter {
  private readonly steps: Step[] = [];
  private readonly problems: Problem[] = [];

  constructor(private readonly src: string) {}

  result(): Script {
    return { steps: this.steps, problems: this.problems };
  }

  /** `node` null: the whole command. */
  problem(code: ProblemCode, message: string, node: Node | null): void {
    this.problems.push({ code, message, source: node ? this.text(node) : this.src });
  }

  private text(n: Node): string {
    return this.src.slice(n.startIndex, n.endIndex);
  }

  statement(n: Node): void {
    const t = n.type;
    if (t === 'comment') return;
    const seps = SEPARATORS[t];
    if (seps) {
      if (t === 'compound_statement' && n.child(0)?.type === '((') {
        this.problem('arithmetic', `arithmetic command \`${clip(this.text(n))}\` cannot be proven safe`, n);
        return;
      }
      this.sequence(n, seps, (c) => this.statement(c));
      return;
    }
    switch (t) {
      case 'command':
        this.command(n, { redirects: [], extraWords: [], trailing: [] });
        return;
      case 'redirected_statement':
        this.redirected(n);
        return;
      case 'test_command':
        this.test(n, []);
        return;
      case 'variable_assignment':
      case 'variable_assignments': {
        const list = t === 'variable_assignment' ? [n] : n.namedChildren;
        const assignments = list.map((a) => this.assignment(a)).filter((a): a is Assignment => a !== null);
        this.steps.push({ kind: 'assign', assignments, source: this.text(n) });
        return;
      }
      case 'function_definition':
        this.problem('function', `function definition \`${clip(this.text(n))}\` cannot be proven safe`, n);
        return;
      case 'declaration_command':
      case 'unset_command':
        this.problem('declaration', `\`${n.child(0)?.type ?? t}\` changes shell state`, n);
        return;
      default:
        if (CONTROL_FLOW.has(t)) {
          const kw = n.child(0)?.type ?? t;
          this.problem('control_flow', `\`${kw}\` blocks are not analysed (loops and conditionals go to the VM)`, n);
          return;
        }
        this.problem('unsupported', `shell construct \`${t}\` is not supported`, n);
    }
  }

  /** Visits the statements of a list, pipeline or group; its operators must be in `seps`. */
  private sequence(n: Node, seps: ReadonlySet<string>, visit: (c: Node, isLast: boolean) => void): void {
    const kids = n.children;
    let last = -1;
    kids.forEach((c, i) => {
      if (c.isNamed && c.type !== 'comment') last = i;
    });
    kids.forEach((c, i) => {
      if (c.isNamed) {
        if (c.type !== 'comment') visit(c, i === last);
      } else if (c.type === '&') this.problem('background', 'background job `&` may outlive the call', n);
      else if (!seps.has(c.type)) this.problem('unsupported', `shell operator \`${c.type}\` is not supported`, n);
    });
  }

  private redirected(n: Node): void {
    const pending: PendingRedirects = { redirects: [], extraWords: [], trailing: [] };
    const body = this.collectRedirects(n, pending);
    if (!body) {
      // `> file` alone: bash opens (creates or truncates) the file and runs nothing.
      if (pending.extraWords.length > 0) this.problem('unsupported', 'words after a redirection without a command', n);
      else this.steps.push({ kind: 'test', operands: [], redirects: pending.redirects, source: this.text(n) });
      for (const s of pending.trailing) this.statement(s);
      return;
    }
    this.withRedirects(body, pending, n);
    for (const s of pending.trailing) this.statement(s);
  }

  /** Reads a redirected_statement's own redirections into `pending`; returns its body. */
  private collectRedirects(n: Node, pending: PendingRedirects): Node | null {
    let body: Node | null = null;
    for (let i = 0; i < n.childCount; i++) {
      const c = n.child(i);
      if (!c) continue;
      if (n.fieldNameForChild(i) === 'body') body = c;
      else if (c.type === 'file_redirect' || c.type === 'herestring_redirect' || c.type === 'heredoc_redirect') this.redirect(c, pending);
      else if (c.isNamed && c.type !== 'comment') this.problem('unsupported', `unexpected \`${c.type}\` in a redirection`, c);
    }
    return body;
  }

  /**
   * Applies redirections to the statement they belong to. The grammar attaches a trailing
   * redirection to a whole list or pipeline (`a && b > x` parses as `(a && b) > x`), but in
   * bash it belongs to the last command, so it is pushed down the right-hand side.
   */
  private withRedirects(body: Node, pending: PendingRedirects, at: Node): void {
    switch (body.type) {
      case 'command':
        this.command(body, pending);
        return;
      case 'test_command':
        this.test(body, pending.redirects);
        return;
      case 'list':
      case 'pipeline':
      case 'negated_command': {
        this.sequence(body, SEPARATORS[body.type] as ReadonlySet<string>, (c, isLast) =>
          isLast ? this.withRedirects(c, pending, at) : this.statement(c),
        );
        return;
      }
      case 'redirected_statement': {
        // Nested redirections: the inner ones are opened first, then these.
        const inner: PendingRedirects = { redirects: [], extraWords: [], trailing: [] };
        this.collectRedirects(body, inner);
        const innerBody = body.childForFieldName('body');
        const merged: PendingRedirects = {
          redirects: [...inner.redirects, ...pending.redirects],
          extraWords: [...inner.extraWords, ...pending.extraWords],
          trailing: [...inner.trailing, ...pending.trailing],
        };
        if (!innerBody) this.problem('unsupported', 'redirection without a command', body);
        else this.withRedirects(innerBody, { ...merged, trailing: [] }, at);
        pending.trailing.splice(0, pending.trailing.length, ...merged.trailing);
        return;
      }
      default:
        if (pending.extraWords.length > 0) {
          this.problem('syntax', `words after a redirection of a compound command`, at);
          return;
        }
        // A group's redirections are opened before its commands run.
        if (pending.redirects.length > 0) this.steps.push({ kind: 'test', operands: [], redirects: pending.redirects, source: this.text(at) });
        this.statement(body);
    }
  }

  private command(n: Node, pending: PendingRedirects): void {
    const env: Assignment[] = [];
    const words: Word[] = [];
    for (let i = 0; i < n.childCount; i++) {
      const c = n.child(i);
      if (!c) continue;
      const field = n.fieldNameForChild(i);
      if (c.type === 'variable_assignment') {
        const a = this.assignment(c);
        if (a) env.push(a);
      } else if (c.type === 'file_redirect' || c.type === 'herestring_redirect') {
        this.redirect(c, pending);
      } else if (c.type === 'command_name') {
        const inner = c.namedChild(0);
        const w = inner ? this.word(inner) : null;
        if (w) words.push(w);
        else if (!inner) this.problem('unsupported', 'empty command name', c);
      } else if (field === 'argument') {
        const next = n.child(i + 1);
        if (!c.isNamed && c.type === '$' && next?.type === 'string' && next.startIndex === c.endIndex) {
          // `$"..."`: the grammar splits a locale-translated string into `$` and "...".
          this.problem('expansion', `locale string \`$${this.text(next)}\` depends on the environment`, c);
          i++;
          continue;
        }
        const w = c.isNamed ? this.word(c) : this.literalWord(c);
        if (w) words.push(w);
      } else if (c.type === 'comment') {
        continue;
      } else {
        this.problem('unsupported', `unexpected \`${c.type}\` in a command`, c);
      }
    }
    words.push(...pending.extraWords);
    words.sort((a, b) => a.start - b.start);
    this.steps.push({ kind: 'command', env, words, redirects: pending.redirects, source: this.text(n) });
  }

  private test(n: Node, redirects: Redirect[]): void {
    const operands: Word[] = [];
    const collect = (e: Node): void => {
      switch (e.type) {
        case 'unary_expression':
        case 'binary_expression':
        case 'parenthesized_expression':
          for (const c of e.namedChildren) collect(c);
          return;
        case 'test_operator':
        case 'regex':
        case 'extglob_pattern':
          // Operators, and patterns that are matched against strings, never name files.
          return;
        case 'redirected_statement':
          this.problem('unsupported', `redirection inside a test`, e);
          return;
        default: {
          const w = this.word(e);
          if (w) operands.push(w);
        }
      }
    };
    for (const c of n.namedChildren) collect(c);
    this.steps.push({ kind: 'test', operands, redirects, source: this.text(n) });
  }

  private assignment(n: Node): Assignment | null {
    const nameNode = n.childForFieldName('name');
    if (!nameNode || nameNode.type !== 'variable_name') {
      this.problem('expansion', `array assignment \`${clip(this.text(n))}\` is not supported`, n);
      return null;
    }
    const valueNode = n.childForFieldName('value');
    let value: Word | null = null;
    if (valueNode) {
      if (valueNode.type === 'array') {
        this.problem('expansion', `array assignment \`${clip(this.text(n))}\` is not supported`, n);
        return null;
      }
      value = this.word(valueNode);
      if (!value) return null;
    }
    const append = n.children.some((c) => !c.isNamed && c.type === '+=');
    return { name: this.text(nameNode), value, append, source: this.text(n) };
  }

  private redirect(n: Node, pending: PendingRedirects): void {
    let fd: number | null = null;
    let op: string | null = null;
    const targets: Word[] = [];
    let heredocBody: WordPart[] | null = null;
    let heredocQuoted = false;
    for (let i = 0; i < n.childCount; i++) {
      const c = n.child(i);
      if (!c) continue;
      const field = n.fieldNameForChild(i);
      if (c.type === 'file_descriptor') fd = Number(this.text(c));
      else if (!c.isNamed && op === null && (REDIRECT_OPS.has(c.type) || c.type === '<<' || c.type === '<<-' || c.type === '<<<')) op = c.type;
      else if (field === 'destination' || (n.type === 'herestring_redirect' && c.isNamed)) {
        const w = this.word(c);
        if (w) targets.push(w);
      } else if (c.type === 'heredoc_start') {
        heredocQuoted = /['"\\]/.test(this.text(c));
      } else if (c.type === 'heredoc_body') {
        heredocBody = heredocQuoted ? null : this.heredocBody(c);
      } else if (c.type === 'heredoc_end') {
        continue;
      } else if (c.type === 'file_redirect' || c.type === 'herestring_redirect') {
        this.redirect(c, pending);
      } else if (field === 'argument') {
        const w = this.word(c);
        if (w) pending.extraWords.push(w);
      } else if (c.type === 'pipeline' || field === 'right') {
        // `cat <<EOF | grep x`: the grammar nests the rest of the pipeline or list here.
        if (c.type === 'pipeline') for (const s of c.namedChildren) pending.trailing.push(s);
        else pending.trailing.push(c);
      } else if (!c.isNamed && (c.type === '&&' || c.type === '||' || c.type === '|' || c.type === '|&')) {
        continue;
      } else if (c.type === 'comment') {
        continue;
      } else {
        this.problem('unsupported', `unexpected \`${c.type}\` in a redirection`, c);
      }
    }
    if (op === null) {
      this.problem('unsupported', `redirection \`${clip(this.text(n))}\` is not supported`, n);
      return;
    }
    const first = targets.shift() ?? null;
    pending.extraWords.push(...targets);
    const heredoc = op === '<<' || op === '<<-';
    pending.redirects.push({
      op: op as RedirectOp,
      fd,
      target: heredoc ? null : first,
      heredocBody: heredoc ? heredocBody : null,
      source: this.text(n),
    });
  }

  private heredocBody(n: Node): WordPart[] {
    const parts: WordPart[] = [];
    for (const c of n.namedChildren) {
      if (c.type === 'heredoc_content') continue; // literal data; only expansions matter
      if (c.type === 'simple_expansion' || c.type === 'expansion') {
        const p = this.param(c, true);
        if (p) parts.push(p);
      } else this.wordProblem(c);
    }
    return parts;
  }

  /** A token the grammar keeps anonymous but bash passes as an argument (`$`, `==`). */
  private literalWord(n: Node): Word {
    return { parts: [{ kind: 'text', text: this.text(n), quoted: true }], source: this.text(n), start: n.startIndex };
  }

  /** Converts a word-like node; returns null (after recording a problem) when it cannot. */
  word(n: Node): Word | null {
    const parts: WordPart[] = [];
    const before = this.problems.length;
    this.wordParts(n, parts);
    if (this.problems.length > before) return null;
    return { parts, source: this.text(n), start: n.startIndex };
  }

  private wordParts(n: Node, out: WordPart[]): void {
    switch (n.type) {
      case 'word':
      case 'number': {
        if (n.namedChildCount > 0) {
          this.wordProblem(n.namedChild(0) ?? n);
          return;
        }
        unquotedText(this.text(n), out, () => this.problem('expansion', `word \`${clip(this.text(n))}\` has an expansion the parser did not mark`, n));
        return;
      }
      case 'raw_string': {
        const t = this.text(n);
        out.push({ kind: 'text', text: t.slice(1, -1), quoted: true });
        return;
      }
      case 'ansi_c_string': {
        const decoded = decodeAnsiC(this.text(n).slice(2, -1));
        if (decoded === null) this.problem('expansion', `\`${clip(this.text(n))}\` uses an escape the router does not decode`, n);
        else out.push({ kind: 'text', text: decoded, quoted: true });
        return;
      }
      case 'string': {
        // Inside "...": only \$ \` \" \\ and \newline are escapes.
        let pos = n.startIndex + 1;
        const end = n.endIndex - 1;
        for (const c of n.namedChildren) {
          if (c.startIndex > pos) out.push({ kind: 'text', text: dqUnescape(this.src.slice(pos, c.startIndex)), quoted: true });
          if (c.type === 'string_content') out.push({ kind: 'text', text: dqUnescape(this.text(c)), quoted: true });
          else if (c.type === 'simple_expansion' || c.type === 'expansion') {
            const p = this.param(c, true);
            if (p) out.push(p);
          } else this.wordProblem(c);
          pos = Math.max(pos, c.endIndex);
        }
        if (end > pos) out.push({ kind: 'text', text: dqUnescape(this.src.slice(pos, end)), quoted: true });
        return;
      }
      case 'concatenation':
        for (const c of n.children) {
          if (c.isNamed) this.wordParts(c, out);
          else out.push({ kind: 'text', text: this.text(c), quoted: false });
        }
        return;
      case 'simple_expansion':
      case 'expansion': {
        const p = this.param(n, false);
        if (p) out.push(p);
        return;
      }
      default:
        this.wordProblem(n);
    }
  }

  /** `$name`, `${name}`, `$?`; any other `${...}` form is a problem. */
  private param(n: Node, quoted: boolean): WordPart | null {
    const kids = n.children;
    const simple = n.type === 'simple_expansion' && kids.length === 2 && kids[0]?.type === '$';
    const braced = n.type === 'expansion' && kids.length === 3 && kids[0]?.type === '${' && kids[2]?.type === '}';
    const nameNode = simple ? kids[1] : braced ? kids[1] : undefined;
    if (nameNode && (nameNode.type === 'variable_name' || nameNode.type === 'special_variable_name')) {
      return { kind: 'param', name: this.text(nameNode), quoted, source: this.text(n) };
    }
    this.problem('expansion', `parameter expansion \`${clip(this.text(n))}\` cannot be proven safe`, n);
    return null;
  }

  private wordProblem(n: Node): void {
    const s = clip(this.text(n));
    switch (n.type) {
      case 'command_substitution':
        this.problem('command_substitution', `command substitution \`${s}\` cannot be proven safe`, n);
        return;
      case 'process_substitution':
        this.problem('process_substitution', `process substitution \`${s}\` cannot be proven safe`, n);
        return;
      case 'arithmetic_expansion':
        this.problem('arithmetic', `arithmetic expansion \`${s}\` cannot be proven safe`, n);
        return;
      case 'brace_expression':
        this.problem('expansion', `brace sequence \`${s}\` is not expanded by the router`, n);
        return;
      case 'translated_string':
        this.problem('expansion', `locale string \`${s}\` depends on the environment`, n);
        return;
      default:
        this.problem('unsupported', `\`${s}\` (${n.type}) is not supported in a word`, n);
    }
  }
}
