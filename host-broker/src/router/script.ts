/**
 * The simplified shell script the parser adapter hands to the classifier.
 *
 * The router never reasons about the parser's own tree: the adapter reduces it to a flat,
 * source-ordered list of steps (simple commands, `[ ]`/`[[ ]]` tests, bare assignments) and
 * a list of problems, the constructs it met that cannot be proven to behave the same on the
 * fast path as in the VM. Words keep their quoting (which characters were quoted) because
 * globbing, brace and tilde expansion apply only to unquoted characters; parameter
 * expansions stay symbolic so the classifier can resolve the few it knows.
 */

/** One piece of a shell word, in source order. */
export type WordPart =
  /** Literal text after quote removal; `quoted` when it came from quotes or a backslash escape. */
  | { kind: 'text'; text: string; quoted: boolean }
  /** `$name`, `${name}` or a special parameter such as `$?`; `quoted` when inside "...". */
  | { kind: 'param'; name: string; quoted: boolean; source: string };

export interface Word {
  parts: WordPart[];
  /** The word as written, for reasons. */
  source: string;
  /** Offset in the command string; orders words that the parser attached to different nodes. */
  start: number;
}

export type RedirectOp =
  | '<' // read
  | '>' // write
  | '>>' // append
  | '>|' // write, ignoring noclobber
  | '&>' // stdout+stderr to a file
  | '&>>'
  | '>&' // duplicate an fd, or (with a non-number target) like &>
  | '<&'
  | '>&-' // close
  | '<&-'
  | '<<' // here-document
  | '<<-'
  | '<<<'; // here-string

export interface Redirect {
  op: RedirectOp;
  /** The explicit file descriptor (`2>`), or null. */
  fd: number | null;
  /** File target, duplicated fd number, or here-string word; null for closes and here-docs. */
  target: Word | null;
  /** Here-document body parts; null when the delimiter was quoted (the body is literal). */
  heredocBody: WordPart[] | null;
  source: string;
}

export interface Assignment {
  name: string;
  value: Word | null;
  append: boolean;
  source: string;
}

export interface SimpleCommand {
  kind: 'command';
  /** `NAME=value` prefixes, which put NAME in this command's environment. */
  env: Assignment[];
  /** The command name followed by its arguments, in source order. */
  words: Word[];
  redirects: Redirect[];
  source: string;
}

/** `[ ... ]`, `[[ ... ]]`: only its operand words matter (they may name files). */
export interface TestStep {
  kind: 'test';
  operands: Word[];
  redirects: Redirect[];
  source: string;
}

/** `name=value` on its own: sets a shell variable for later words. */
export interface AssignStep {
  kind: 'assign';
  assignments: Assignment[];
  source: string;
}

export type Step = SimpleCommand | TestStep | AssignStep;

export type ProblemCode =
  | 'syntax'
  | 'command_substitution'
  | 'process_substitution'
  | 'arithmetic'
  | 'expansion'
  | 'function'
  | 'control_flow'
  | 'background'
  | 'declaration'
  | 'unsupported'
  | 'too_complex';

/** A construct the adapter cannot prove faithful; any problem sends the command to the VM. */
export interface Problem {
  code: ProblemCode;
  /** One short sentence naming the offending part. */
  message: string;
  source: string;
}

export interface Script {
  steps: Step[];
  problems: Problem[];
}
