/**
 * The fast path: runs a read/edit-only shell command (the router has proven it so) on the
 * host-owned workspace inside bubblewrap + seccomp, with a wall-clock timeout, an output
 * cap, and process and memory limits. The router is not the security boundary; this is.
 *
 *   const fp = await FastPath.create();            // once per broker, early (see spawner.ts)
 *   const r = await fp.run({ command: 'git status', workspace: '/srv/ws/t1' });
 *   fp.describe();                                  // what is enforced, and how
 */
import { statSync } from 'node:fs';
import { availableParallelism } from 'node:os';
import { posix } from 'node:path';
import { createLogger, type Logger } from '../../../guest-agent/src/log.ts';
import { runProcess, type RunResult } from '../../../guest-agent/src/process/run-process.ts';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { Workspace } from '../../../guest-agent/src/workspace/confine.ts';
import { bwrapArgv, probeHostLayout, SANDBOX_HOME, SANDBOX_WORKSPACE, type HostLayout } from './bwrap-argv.ts';
import { createLimiter, type LimitDescription, type LimitMechanism, type Limiter, type RunLimitReport } from './limits.ts';
import { createSandboxEtc, type SandboxEtc, type SandboxIdentity } from './sandbox-etc.ts';
import { seccompFilter } from './seccomp-filter.ts';
import { createSpawner, type Spawner, type SpawnerKind } from './spawner.ts';

export interface FastPathRequest {
  /** A bash command line, run as `bash -c`. */
  command: string;
  /** Host directory of the workspace; appears at /work inside. */
  workspace: string;
  /** Workspace-relative (or /work/...) directory to run in; default the workspace root. */
  cwd?: string | undefined;
  /** Added to (and overriding) the sandbox's default environment. */
  env?: Record<string, string> | undefined;
  /**
   * A host directory to bind writable at /home/tenant and use as HOME (the unsafe-local
   * backend's persistent home); without it HOME is the private /tmp.
   */
  home?: string | undefined;
  stdin?: Uint8Array | undefined;
  timeoutMs?: number | undefined;
  /** Per stream; the rest is counted and dropped. */
  maxOutputBytes?: number | undefined;
  /** Largest file the command may write (RLIMIT_FSIZE, hard): the session's remaining quota. */
  fileSizeLimitBytes?: number | undefined;
  onStdout?(chunk: Buffer): void | Promise<void>;
  onStderr?(chunk: Buffer): void | Promise<void>;
  signal?: AbortSignal | undefined;
  /** Receives the function that sends the running command a signal (false when it could not be delivered). */
  onSignalable?: ((send: (sig: NodeJS.Signals) => Promise<boolean>) => void) | undefined;
}

export interface FastPathResult extends RunResult {
  limits: RunLimitReport;
}

export interface FastPathOptions {
  /** Processes the sandbox may hold at once (bwrap's two included). Default 64. */
  maxProcesses?: number;
  /** Default 512 MiB. */
  memoryBytes?: number;
  /**
   * Runs the broker admits at once (its admission holds them to it; default two per CPU,
   * at least 4): with the limits above it makes the pool's totals, which the kernel holds
   * every run of this fast path to together, admitted or not.
   */
  maxConcurrentRuns?: number;
  /** Size cap of the private /tmp (its pages also count against memoryBytes). Default 256 MiB. */
  tmpBytes?: number;
  defaultTimeoutMs?: number;
  defaultMaxOutputBytes?: number;
  /** Force a limit mechanism instead of detecting one. */
  limitMechanism?: LimitMechanism;
  /** A delegated cgroup (v2) to make run cgroups in, instead of the broker's own. */
  cgroupParent?: string;
  /** Default 'helper' (see spawner.ts). */
  spawner?: SpawnerKind;
  bwrapPath?: string;
  log?: Logger;
}

export interface FastPathDescription {
  bwrap: { path: string; version: string; flags: string[] };
  identity: SandboxIdentity;
  tmpBytes: number;
  seccomp: {
    instructions: number;
    allowed: number;
    argFiltered: readonly string[];
    enosys: readonly string[];
    refused: string;
    arch: string;
  };
  limits: LimitDescription;
  spawner: { kind: SpawnerKind; pid: number };
  defaults: { timeoutMs: number; maxOutputBytes: number };
}

/**
 * HOME is an empty directory nothing can write to (the root is read-only): no tool finds a
 * configuration a command planted there. It was /tmp, where a command could write the
 * `.gitconfig` its own `git diff` then read (issue 38).
 */
const IDENTITY: SandboxIdentity = { uid: 1000, gid: 1000, user: 'user', home: SANDBOX_HOME };
const BASE_ENV: Record<string, string> = {
  PATH: '/usr/local/bin:/usr/bin:/bin',
  HOME: IDENTITY.home,
  USER: IDENTITY.user,
  LOGNAME: IDENTITY.user,
  SHELL: '/bin/bash',
  LANG: 'C.UTF-8',
  TMPDIR: '/tmp',
  TERM: 'dumb',
  // Nothing in the sandbox may page or prompt: there is no terminal.
  PAGER: 'cat',
  GIT_PAGER: 'cat',
  GIT_TERMINAL_PROMPT: '0',
};
/**
 * git in a fast-path run reads no system or global configuration (so nothing in HOME,
 * XDG_CONFIG_HOME or /tmp counts) and no system attributes, and every key with a fixed
 * name that starts a program is pinned from the command line's scope, which outranks the
 * repository's: no fsmonitor, hooks, pager, editor, askpass, ssh, gpg or credential helper;
 * no transport at all (a partial clone's lazy fetch), no submodule opened for a log or diff,
 * no submodule summary, no implicit bare repository (a workspace that is one is the
 * router's to see), and no optional index write (which would also make `git status` a
 * writer). Child gits (submodules) inherit all of it. Keys with repository-chosen names
 * (textconv, filters, diff drivers) and diff.external (an empty value breaks `git diff`)
 * cannot be pinned: the router reads every configuration git can reach and sends a
 * repository that names a program to the VM (router/git-config.ts). Not applied to
 * unsafe-local calls (`home`), which stand for the VM.
 */
const GIT_PINNED_KEYS: Array<[string, string]> = [
  ['core.fsmonitor', 'false'],
  ['core.hooksPath', '/dev/null'],
  ['core.pager', 'cat'],
  ['core.editor', 'false'],
  ['sequence.editor', 'false'],
  ['core.askPass', 'false'],
  ['core.sshCommand', 'false'],
  ['credential.helper', ''],
  ['log.showSignature', 'false'],
  ['gpg.program', 'false'],
  ['gpg.openpgp.program', 'false'],
  ['gpg.x509.program', 'false'],
  ['gpg.ssh.program', 'false'],
  ['protocol.allow', 'never'],
  ['diff.submodule', 'short'],
  ['status.submoduleSummary', 'false'],
  ['safe.bareRepository', 'explicit'],
];
const GIT_PINNED: Record<string, string> = {
  GIT_CONFIG_NOSYSTEM: '1',
  GIT_CONFIG_GLOBAL: '/dev/null',
  GIT_ATTR_NOSYSTEM: '1',
  GIT_OPTIONAL_LOCKS: '0',
  GIT_CONFIG_COUNT: String(GIT_PINNED_KEYS.length),
  ...Object.fromEntries(GIT_PINNED_KEYS.flatMap(([k, v], i) => [[`GIT_CONFIG_KEY_${i}`, k], [`GIT_CONFIG_VALUE_${i}`, v]])),
};
const SHELL = '/bin/sh';
const MAX_COMMAND_BYTES = 1024 * 1024;
const ENV_NAME = /^[A-Za-z_][A-Za-z0-9_]*$/;

export class FastPath {
  private closed = false;

  private constructor(
    /** What one run may hold, and how many the broker should admit at once (the pool holds their total). */
    readonly runLimits: { memoryBytes: number; maxConcurrentRuns: number },
    private readonly bwrap: { path: string; version: string },
    private readonly layout: HostLayout,
    private readonly etc: SandboxEtc,
    private readonly limiter: Limiter,
    private readonly spawner: Spawner,
    private readonly opts: Required<Pick<FastPathOptions, 'tmpBytes' | 'defaultTimeoutMs' | 'defaultMaxOutputBytes'>>,
    private readonly log: Logger,
  ) {}

  static async create(options: FastPathOptions = {}): Promise<FastPath> {
    const log = options.log ?? createLogger({ name: 'fastpath' });
    if (process.platform !== 'linux' || process.arch !== 'x64') {
      throw new HutchError('unavailable', `the fast path's seccomp filter is for Linux x86_64; this is ${process.platform}/${process.arch}`);
    }
    const bwrapPath = options.bwrapPath ?? '/usr/bin/bwrap';
    const version = await probeBwrap(bwrapPath);
    seccompFilter(); // compile now: a policy error should fail startup, not the first call
    // Spawner first: the helper is forked while this process is as small as it will be.
    const spawner = await createSpawner(options.spawner ?? 'helper', log);
    let etc: SandboxEtc | undefined;
    try {
      etc = createSandboxEtc(IDENTITY);
      const maxProcesses = options.maxProcesses ?? 64;
      const memoryBytes = options.memoryBytes ?? 512 * 1024 * 1024;
      const maxConcurrentRuns = options.maxConcurrentRuns ?? Math.max(4, 2 * availableParallelism());
      const limiter = await createLimiter({
        maxProcesses,
        memoryBytes,
        totalProcesses: maxConcurrentRuns * maxProcesses,
        totalMemoryBytes: maxConcurrentRuns * memoryBytes,
        mechanism: options.limitMechanism,
        cgroupParent: options.cgroupParent,
        shell: SHELL,
        isProtected: (pid) => pid === spawner.forkerPid,
        log,
      });
      const fp = new FastPath(
        { memoryBytes, maxConcurrentRuns },
        { path: bwrapPath, version },
        probeHostLayout(),
        etc,
        limiter,
        spawner,
        {
          tmpBytes: options.tmpBytes ?? 256 * 1024 * 1024,
          defaultTimeoutMs: options.defaultTimeoutMs ?? 60_000,
          defaultMaxOutputBytes: options.defaultMaxOutputBytes ?? 16 * 1024 * 1024,
        },
        log,
      );
      log.info('fastpath.ready', { limits: limiter.describe().mechanism, spawner: spawner.kind, bwrap: version });
      return fp;
    } catch (err) {
      etc?.remove();
      await spawner.close();
      throw err;
    }
  }

  async run(req: FastPathRequest): Promise<FastPathResult> {
    if (this.closed) throw new HutchError('unavailable', 'the fast path is closed');
    const { workspace, cwd } = checkRequest(req);
    const env = req.home !== undefined ? { ...BASE_ENV, HOME: SANDBOX_HOME, ...req.env } : { ...BASE_ENV, ...req.env, ...GIT_PINNED };
    const slot = await this.limiter.acquire();
    // Start inside the slot by the cheapest safe way: the helper's fork from inside it, else the `sh` step.
    const cgroupTasks = this.spawner.threadEntry ? slot.threadEntry : undefined;
    let result: RunResult;
    try {
      const sandbox = bwrapArgv({
        bwrap: this.bwrap.path,
        workspace,
        cwd,
        env,
        etcDir: this.etc.dir,
        emptyDir: this.etc.emptyDir,
        identity: IDENTITY,
        layout: this.layout,
        tmpBytes: this.opts.tmpBytes,
        command: req.command,
        home: req.home,
        fileSizeLimitBytes: req.fileSizeLimitBytes,
      });
      const running = this.spawner.run(
        {
          argv: cgroupTasks ? sandbox : slot.wrap(sandbox),
          cwd: '/',
          env: { PATH: '/usr/bin:/bin' },
          stdin: req.stdin,
          onStdout: req.onStdout,
          onStderr: req.onStderr,
          maxOutputBytes: req.maxOutputBytes ?? this.opts.defaultMaxOutputBytes,
          timeoutMs: req.timeoutMs ?? this.opts.defaultTimeoutMs,
          signal: req.signal,
          extraInputs: [seccompFilter().bpf],
          killGroupOnExit: true,
          onKill: () => slot.kill(),
        },
        cgroupTasks,
      );
      req.onSignalable?.(async (sig) => {
        if (sig !== 'SIGKILL') return slot.signal(sig);
        slot.kill();
        return true;
      });
      result = await running.result;
    } catch (err) {
      slot.kill();
      await slot.release().catch(() => undefined);
      throw err;
    }
    const limits = await slot.release();
    if (limits.oomKilled || limits.processLimitHit || result.timedOut) {
      this.log.info('fastpath.limit_hit', { oomKilled: limits.oomKilled, processLimitHit: limits.processLimitHit, timedOut: result.timedOut });
    }
    return { ...result, limits };
  }

  describe(): FastPathDescription {
    const filter = seccompFilter();
    const sample = bwrapArgv({
      bwrap: this.bwrap.path,
      workspace: '<workspace>',
      cwd: SANDBOX_WORKSPACE,
      env: {},
      etcDir: '<etc>',
      emptyDir: '<empty>',
      identity: IDENTITY,
      layout: this.layout,
      tmpBytes: this.opts.tmpBytes,
      command: '<command>',
    });
    return {
      bwrap: { ...this.bwrap, flags: sample.slice(1) },
      identity: IDENTITY,
      tmpBytes: this.opts.tmpBytes,
      seccomp: {
        instructions: filter.instructions,
        allowed: filter.allowed.length,
        argFiltered: filter.argFiltered,
        enosys: filter.enosys,
        refused: 'EPERM',
        arch: 'x86_64 only: other architectures are killed, x32 calls refused',
      },
      limits: this.limiter.describe(),
      spawner: { kind: this.spawner.kind, pid: this.spawner.forkerPid },
      defaults: { timeoutMs: this.opts.defaultTimeoutMs, maxOutputBytes: this.opts.defaultMaxOutputBytes },
    };
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    await this.spawner.close();
    await this.limiter.close();
    this.etc.remove();
  }
}

/** Validates a request; returns the workspace (symlinks resolved) and the cwd as the sandbox sees it. */
function checkRequest(req: FastPathRequest): { workspace: string; cwd: string } {
  if (typeof req.command !== 'string' || req.command.trim() === '') throw new HutchError('bad_request', 'empty command');
  if (Buffer.byteLength(req.command) > MAX_COMMAND_BYTES || req.command.includes('\0')) {
    throw new HutchError('bad_request', 'command too long or contains NUL', { bytes: Buffer.byteLength(req.command) });
  }
  for (const [k, v] of Object.entries(req.env ?? {})) {
    if (!ENV_NAME.test(k) || v.includes('\0')) throw new HutchError('bad_request', `invalid environment variable ${JSON.stringify(k)}`);
  }
  if (req.timeoutMs !== undefined && !(req.timeoutMs > 0)) throw new HutchError('bad_request', 'timeoutMs must be positive');
  let ws: Workspace;
  try {
    if (!statSync(req.workspace).isDirectory()) throw new HutchError('not_a_directory', 'workspace is not a directory');
    ws = new Workspace(req.workspace, SANDBOX_WORKSPACE);
  } catch (err) {
    if (err instanceof HutchError) throw err;
    throw new HutchError('not_found', 'workspace does not exist', { errno: (err as NodeJS.ErrnoException).code });
  }
  // The same confinement as the file tools: `..`, absolute paths outside /work and symlinks
  // out of the workspace are refused before bwrap sees the path.
  const resolved = ws.resolve(req.cwd ?? '', { followFinal: true });
  if (!resolved.stat?.isDirectory()) throw new HutchError('not_a_directory', `cwd is not a directory: ${ws.display(resolved.rel)}`);
  return { workspace: ws.root, cwd: resolved.rel === '' ? SANDBOX_WORKSPACE : posix.join(SANDBOX_WORKSPACE, resolved.rel) };
}

async function probeBwrap(path: string): Promise<string> {
  let out = '';
  try {
    const r = await runProcess({ argv: [path, '--version'], cwd: '/', env: { PATH: '/usr/bin:/bin' }, timeoutMs: 10_000, onStdout: (c) => void (out += c.toString()) }).result;
    if (r.exitCode !== 0) throw new Error(`exit ${r.exitCode}`);
  } catch (err) {
    throw new HutchError('unavailable', `bubblewrap is not usable at ${path} (${(err as Error).message}); install it: apt-get install bubblewrap`, { path });
  }
  return out.trim();
}
