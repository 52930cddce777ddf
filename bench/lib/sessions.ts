/**
 * Recorded agent sessions: loading, workspace preparation, and replays either bare on the
 * host (the baseline) or through hutch. A corpus is a directory of `<id>.jsonl` sessions
 * (line 1 `{session, project, task}`, then one `{think_s, tool, args, expect?}` per call)
 * and a directory of projects, each the initial content of a workspace. The repo carries a
 * small one (examples/sessions, examples/projects) for the demo and the tests; the benches
 * take a bigger one by path.
 */
import { createHash } from 'node:crypto';
import { chmodSync, cpSync, existsSync, mkdirSync, readdirSync, readFileSync, lstatSync, readlinkSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { performance } from 'node:perf_hooks';
import { execFileSync } from 'node:child_process';
import { z } from 'zod';
import { Workspace } from '../../guest-agent/src/workspace/confine.ts';
import { FileTools } from '../../guest-agent/src/workspace/file-tools.ts';
import { runFileTool } from '../../host-broker/src/tools/file-calls.ts';
import { runProcess } from '../../guest-agent/src/process/run-process.ts';
import { walk } from '../../guest-agent/src/workspace/walk.ts';
import type { Sandbox } from '../../host-broker/src/sdk/index.ts';

const here = dirname(fileURLToPath(import.meta.url));
/** The project's own small corpus, in the repo: what the demo and the tests replay. */
export const EXAMPLE_SESSIONS = resolve(here, '../../examples/sessions');
export const EXAMPLE_PROJECTS = resolve(here, '../../examples/projects');
/** The benchmark corpus the benches default to when a checkout has it beside it. */
export const SHARED_BENCH = resolve(here, '../../../shared/bench');
export const SESSIONS_DIR = join(SHARED_BENCH, 'sessions');
export const PROJECTS_DIR = join(SHARED_BENCH, 'projects');

export interface Corpus {
  sessions: string;
  /** Looked up in order. */
  projects: string[];
}

/**
 * The corpus a bench replays: `--sessions DIR` / `--projects DIR` when given, else the
 * benchmark corpus beside the checkout when it exists, else an error naming both flags.
 */
export function benchCorpus(o: { sessions?: string | undefined; projects?: string | undefined }): Corpus {
  const defaults = existsSync(SESSIONS_DIR) && existsSync(PROJECTS_DIR);
  if (o.sessions === undefined && !defaults) {
    throw new Error(
      `no session corpus: pass --sessions DIR --projects DIR (JSON Lines sessions and their starter projects; ` +
        `the repo's own small corpus is --sessions ${EXAMPLE_SESSIONS} --projects ${EXAMPLE_PROJECTS})`,
    );
  }
  const sessions = resolve(o.sessions ?? SESSIONS_DIR);
  if (!existsSync(sessions)) throw new Error(`--sessions ${sessions}: no such directory`);
  const projects = [...(o.projects !== undefined ? [resolve(o.projects)] : []), ...(defaults ? [PROJECTS_DIR] : []), EXAMPLE_PROJECTS];
  return { sessions, projects };
}

const HeaderSchema = z.object({ session: z.string(), project: z.string(), task: z.string() });
const CallSchema = z.object({
  think_s: z.number(),
  tool: z.enum(['read', 'write', 'edit', 'glob', 'grep', 'list', 'bash']),
  args: z.record(z.string(), z.unknown()),
  expect: z.object({ exit_code: z.number().int() }).optional(),
});
export type RecordedCall = z.infer<typeof CallSchema>;
export interface RecordedSession {
  id: string;
  project: string;
  task: string;
  calls: RecordedCall[];
}

export function loadSession(file: string): RecordedSession {
  const lines = readFileSync(file, 'utf8').split('\n').filter((l) => l.trim() !== '');
  const header = HeaderSchema.parse(JSON.parse(lines[0] ?? '{}'));
  return { id: header.session, project: header.project, task: header.task, calls: lines.slice(1).map((l) => CallSchema.parse(JSON.parse(l))) };
}

/** Every session in `dir` (default: the repo's own corpus), sorted by file name. */
export function loadSessions(dir = EXAMPLE_SESSIONS): RecordedSession[] {
  return readdirSync(dir)
    .filter((f) => f.endsWith('.jsonl'))
    .sort()
    .map((f) => loadSession(join(dir, f)));
}

/** Copies the session's project (looked up in `projectDirs` in order) and makes it a one-commit git repository. */
export function prepareWorkspace(project: string, dest: string, projectDirs: string[] = [EXAMPLE_PROJECTS, PROJECTS_DIR]): void {
  const src = projectDirs.map((d) => join(d, project)).find((p) => existsSync(p));
  if (!src) throw new Error(`project ${project} not found in ${projectDirs.join(', ')} (a bench takes its corpus with --sessions DIR --projects DIR)`);
  mkdirSync(dest, { recursive: true });
  cpSync(src, dest, { recursive: true, verbatimSymlinks: true });
  // The shared projects are read-only on disk; a workspace is the agent's to edit.
  makeWritable(dest);
  const git = (...args: string[]) => execFileSync('git', args, { cwd: dest, stdio: 'ignore', env: { ...process.env, GIT_CONFIG_GLOBAL: '/dev/null' } });
  git('init', '-q');
  git('config', 'user.name', 'bench');
  git('config', 'user.email', 'bench@example.com');
  git('config', 'commit.gpgsign', 'false');
  git('add', '-A');
  git('commit', '-q', '-m', 'initial');
}

function makeWritable(dir: string): void {
  for (const e of readdirSync(dir, { withFileTypes: true })) {
    const p = join(dir, e.name);
    if (e.isSymbolicLink()) continue;
    const st = lstatSync(p);
    chmodSync(p, st.mode | 0o200);
    if (e.isDirectory()) makeWritable(p);
  }
}

export interface CallOutcome {
  tool: string;
  ok: boolean;
  exitCode?: number | null;
  ms: number;
  error?: string;
  route?: string;
  addedMs?: number;
  woke?: boolean;
}

/** The tool arguments as the broker takes them (recorded sessions give bash timeouts in seconds). */
export function harnessArgs(c: RecordedCall): Record<string, unknown> {
  return c.args;
}

/** Replays a session bare on the host: file tools in process, bash with `bash -c` in the workspace. */
export async function replayBare(s: RecordedSession, workspace: string, home: string): Promise<CallOutcome[]> {
  mkdirSync(home, { recursive: true });
  const tools = new FileTools(new Workspace(workspace));
  const out: CallOutcome[] = [];
  for (const c of s.calls) {
    const t0 = performance.now();
    try {
      if (c.tool === 'bash') {
        const a = c.args as { command: string; timeout_s?: number };
        const r = await runProcess({
          argv: ['bash', '--norc', '--noprofile', '-c', a.command],
          cwd: workspace,
          env: { PATH: '/usr/local/bin:/usr/bin:/bin', HOME: home, LANG: 'C.UTF-8', TERM: 'dumb' },
          timeoutMs: (a.timeout_s ?? 600) * 1000,
          onStdout: () => undefined,
          onStderr: () => undefined,
          killGroupOnExit: true,
        }).result;
        out.push({ tool: c.tool, ok: r.exitCode === (c.expect?.exit_code ?? 0), exitCode: r.exitCode, ms: performance.now() - t0 });
      } else {
        await runFileTool(tools, c.tool, c.args);
        out.push({ tool: c.tool, ok: true, ms: performance.now() - t0 });
      }
    } catch (err) {
      out.push({ tool: c.tool, ok: false, ms: performance.now() - t0, error: (err as Error).message });
    }
  }
  return out;
}

/** Replays one call through a hutch sandbox. */
export async function replayCall(sb: Sandbox, c: RecordedCall): Promise<CallOutcome> {
  const t0 = performance.now();
  try {
    const r = await sb.call(c.tool, harnessArgs(c));
    const ms = performance.now() - t0;
    const exitCode = c.tool === 'bash' ? (r.result as { exitCode: number | null }).exitCode : undefined;
    const ok = c.tool === 'bash' ? exitCode === (c.expect?.exit_code ?? 0) : true;
    return { tool: c.tool, ok, ...(exitCode !== undefined ? { exitCode } : {}), ms, route: r.route, addedMs: r.timing.addedMs, woke: r.woke };
  } catch (err) {
    return { tool: c.tool, ok: false, ms: performance.now() - t0, error: `${(err as { code?: string }).code ?? ''} ${(err as Error).message}` };
  }
}

/**
 * A comparable picture of a workspace: kind, mode and content hash per path. `.git` is
 * left out (commit objects carry timestamps) as are bytecode caches (they embed source mtimes).
 */
export async function treeDigest(root: string): Promise<Map<string, string>> {
  const m = new Map<string, string>();
  for await (const e of walk(root, { skipDirs: new Set(['.git', '__pycache__']) })) {
    const p = join(root, e.rel);
    const st = lstatSync(p);
    if (e.type === 'file') m.set(e.rel, `file ${(st.mode & 0o111) !== 0 ? 'x' : '-'} ${createHash('sha256').update(readFileSync(p)).digest('hex').slice(0, 16)}`);
    else if (e.type === 'symlink') m.set(e.rel, `link ${readlinkSync(p)}`);
    else if (e.type === 'dir') m.set(e.rel, 'dir');
  }
  return m;
}
