/**
 * The router: decides, per `bash` tool call, between the bubblewrap fast path and the VM.
 *
 * The fast path gets a command only when the router can prove it just reads or edits files
 * in the workspace (or scratch files in /tmp), so it behaves there exactly as in the VM.
 * Anything else, including anything the parser cannot read, goes to the VM. The sandbox,
 * not the router, is the security boundary: the router's job is faithful, cheap results.
 *
 *   await initRouter();               // once: loads the parser (wasm), probes host binaries
 *   routeCommand('git diff --stat');  // sync, tens of microseconds
 */
import { classifyScript, type RouteCode } from './classify.ts';
import { probeHostBinaries } from './host.ts';
import { isWithin } from './paths.ts';
import { initShellParser, parseScript } from './parser.ts';
import { FASTPATH_BINARIES } from './rules.ts';
import type { ProblemCode } from './script.ts';

export type { RouteCode } from './classify.ts';
export { FASTPATH_BINARIES, FASTPATH_COMMANDS, RULES } from './rules.ts';

export type Route = 'fastpath' | 'vm';

export interface RouteDecision {
  route: Route;
  /** Machine-readable class of the decision, for metrics. */
  code: RouteCode;
  /** One short sentence; for the VM, it names the part that could not be proven. */
  reason: string;
  /** Command names seen, in order (up to the one that decided). */
  commands: string[];
  /** Paths the command may write (as written), when it goes to the fast path. */
  writes: string[];
}

export interface RouteOptions {
  /**
   * What earlier calls changed in HOME inside this session's VM, as the broker learns it from
   * the guest: `true` when something changed but not what, or the HOME-relative paths
   * (`.gitconfig`, `.cache/x/report.prof`). Tools that read configuration from a changed
   * path (git: ~/.gitconfig, ~/.config/git; jq: ~/.jq) then run in the VM, where it is.
   */
  homeChanged?: boolean | readonly string[];
  /** Overrides the host probe (tests): can the sandbox run this binary? */
  canRun?: (name: string) => boolean;
}

/** Longer commands (large here-documents) go to the VM without parsing. */
export const MAX_ROUTED_LENGTH = 256 * 1024;

let hostBinaries: Map<string, boolean> | null = null;
let initializing: Promise<void> | null = null;

/** Loads the shell parser and probes which fast-path binaries the host has. Idempotent. */
export function initRouter(): Promise<void> {
  initializing ??= (async () => {
    await initShellParser();
    hostBinaries = probeHostBinaries(FASTPATH_BINARIES);
  })();
  return initializing;
}

/** Which fast-path binaries the host can run in the sandbox (after {@link initRouter}). */
export function hostBinaryReport(): ReadonlyMap<string, boolean> {
  if (!hostBinaries) throw new Error('router not initialised: await initRouter() first');
  return hostBinaries;
}

const PROBLEM_CODE: Record<ProblemCode, RouteCode> = {
  syntax: 'syntax',
  command_substitution: 'construct',
  process_substitution: 'construct',
  arithmetic: 'construct',
  expansion: 'expansion',
  function: 'construct',
  control_flow: 'construct',
  background: 'construct',
  declaration: 'construct',
  unsupported: 'construct',
};

export function routeCommand(command: string, opts: RouteOptions = {}): RouteDecision {
  const probe = hostBinaries;
  if (!probe) throw new Error('router not initialised: await initRouter() first');
  if (command.length > MAX_ROUTED_LENGTH) {
    return vm('too_long', `the command is longer than ${MAX_ROUTED_LENGTH / 1024} KiB, too long to analyse`);
  }
  if (command.trim() === '') return { route: 'fastpath', code: 'empty', reason: 'the command is empty', commands: [], writes: [] };
  const script = parseScript(command);
  const problem = script.problems[0];
  if (problem) return vm(PROBLEM_CODE[problem.code], problem.message);
  if (script.steps.length === 0) return { route: 'fastpath', code: 'empty', reason: 'the command has only comments', commands: [], writes: [] };
  const changed = opts.homeChanged ?? false;
  const verdict = classifyScript(script, {
    homeChanged: (paths) =>
      changed === true || (Array.isArray(changed) && changed.some((c) => paths.some((p) => isWithin(stripHome(c), p)))),
    canRun: opts.canRun ?? ((name) => probe.get(name) === true),
  });
  return {
    route: verdict.ok ? 'fastpath' : 'vm',
    code: verdict.code,
    reason: verdict.reason,
    commands: verdict.commands,
    writes: verdict.ok ? verdict.writes : [],
  };
}

/** Accepts `~/x`, `./x` and `x` alike. */
function stripHome(p: string): string {
  return p.replace(/^~\//, '').replace(/^\.\//, '');
}

function vm(code: RouteCode, reason: string): RouteDecision {
  return { route: 'vm', code, reason, commands: [], writes: [] };
}
