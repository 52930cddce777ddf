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
import { classifyScript, type RouteCode, type Verdict } from './classify.ts';
import type { GitReach } from './git-config.ts';
import { probeHostBinaries } from './host.ts';
import { isWithin } from './paths.ts';
import { initShellParser, parseScript } from './parser.ts';
import { environmentRefusal, FASTPATH_BINARIES } from './rules.ts';
import type { ProblemCode, Script } from './script.ts';

export type { RouteCode } from './classify.ts';
export { gitConfigHazard, type GitReach } from './git-config.ts';
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
  /** Where the command runs git (workspace-relative directories), when it goes to the fast path. */
  gitDirs: string[];
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

/**
 * Longer commands (large here-documents) go to the VM without parsing: a parse is linear
 * in the bytes, and even a here-document's body costs the broker's loop about 0.2 ms a KiB.
 */
export const MAX_ROUTED_LENGTH = 64 * 1024;

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
  too_complex: 'too_complex',
};

export function routeCommand(command: string, opts: RouteOptions = {}): RouteDecision {
  const probe = hostBinaries;
  if (!probe) throw new Error('router not initialised: await initRouter() first');
  if (command.length > MAX_ROUTED_LENGTH) {
    return vm('too_long', `the command is longer than ${MAX_ROUTED_LENGTH / 1024} KiB, too long to analyse`);
  }
  if (command.trim() === '') return { route: 'fastpath', code: 'empty', reason: 'the command is empty', commands: [], writes: [], gitDirs: [] };
  let script: Script;
  let verdict: Verdict;
  try {
    script = parseScript(command);
    const problem = script.problems[0];
    if (problem) return vm(PROBLEM_CODE[problem.code], problem.message);
    if (script.steps.length === 0) return { route: 'fastpath', code: 'empty', reason: 'the command has only comments', commands: [], writes: [], gitDirs: [] };
    const changed = opts.homeChanged ?? false;
    verdict = classifyScript(script, {
      homeChanged: (paths) =>
        changed === true || (Array.isArray(changed) && changed.some((c) => paths.some((p) => isWithin(stripHome(c), p)))),
      canRun: opts.canRun ?? ((name) => probe.get(name) === true),
    });
  } catch (err) {
    // Within the node budget a command can still nest deeper than the analysis recurses.
    if (err instanceof RangeError) return vm('too_complex', 'the command nests too deeply to analyse');
    throw err;
  }
  return {
    route: verdict.ok ? 'fastpath' : 'vm',
    code: verdict.code,
    reason: verdict.reason,
    commands: verdict.commands,
    writes: verdict.ok ? verdict.writes : [],
    gitDirs: verdict.ok ? verdict.gitDirs : [],
  };
}

export interface CallRouteRequest {
  command: string;
  /** The call's environment: part of the decision, checked as inline assignments are. */
  env?: Readonly<Record<string, string>> | undefined;
  /** The caller's wish: `vm` is honoured; `fastpath` only where the router agrees. */
  forced?: Route | undefined;
  homeChanged?: RouteOptions['homeChanged'];
  /**
   * Why git must not run on the fast path in this workspace (a repository it can reach from
   * where it runs names a program), or null; asked only when the command runs git, with
   * the directories it runs git in. See git-config.ts.
   */
  gitHazard?: (reach: GitReach) => Promise<string | null>;
  canRun?: RouteOptions['canRun'];
}

/**
 * The whole routing decision of one bash call: the command, its environment, the caller's
 * forced route (only ever towards the VM) and, for git, the repository's configuration.
 */
export async function routeCall(req: CallRouteRequest): Promise<RouteDecision> {
  if (req.forced === 'vm') return vm('forced', 'route forced to the VM by the caller');
  const asked = req.forced === 'fastpath' ? ' (the caller asked for the fast path; only the VM can be forced)' : '';
  // The same check as an inline `NAME=value` (rules.ts ENV_ALLOWLIST), so both forms route alike.
  for (const [name, value] of Object.entries(req.env ?? {})) {
    const why = environmentRefusal(name, value);
    if (why) return vm('call_env', `the call's environment sets ${name}, which can change what runs: ${'value' in why ? why.value : why.name}${asked}`);
  }
  const d = routeCommand(req.command, {
    ...(req.homeChanged !== undefined ? { homeChanged: req.homeChanged } : {}),
    ...(req.canRun ? { canRun: req.canRun } : {}),
  });
  if (d.route !== 'fastpath') return asked ? { ...d, reason: d.reason + asked } : d;
  if (d.gitDirs.length > 0 && req.gitHazard) {
    const why = await req.gitHazard({ dirs: d.gitDirs });
    if (why) return { route: 'vm', code: 'git_config', reason: why, commands: d.commands, writes: [], gitDirs: [] };
  }
  return d;
}

/** Accepts `~/x`, `./x` and `x` alike. */
function stripHome(p: string): string {
  return p.replace(/^~\//, '').replace(/^\.\//, '');
}

function vm(code: RouteCode, reason: string): RouteDecision {
  return { route: 'vm', code, reason, commands: [], writes: [], gitDirs: [] };
}
