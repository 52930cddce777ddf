#!/usr/bin/env node
/**
 * hutch command line: `hutch serve` runs the broker.
 */
import { parseArgs } from 'node:util';
import { closeSync, readFileSync, realpathSync, writeSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { createLogger, parseLogLevel, type Logger } from '../../guest-agent/src/log.ts';
import { HutchError } from '../../guest-agent/src/protocol/errors.ts';
import { parseMemorySteps } from './policy/memory-policy.ts';
import { Broker } from './broker.ts';
import { cacheDir, createBackend, BACKEND_NAMES, UNSAFE_LOCAL_ACK_FLAG } from './backends/registry.ts';
import { parseTokens } from './api/principals.ts';
import type { WsLimits } from './api/ws-server.ts';
import { QemuBackend } from './backends/qemu-backend.ts';
import { createFastPath } from './tools/fastpath-factory.ts';
import { LEVEL_NAMES, policyForLevel, type SandboxPolicy } from './policy/sandbox-policy.ts';
import { MCP_HELP, mcpMain } from './mcp/stdio.ts';
import { DEFAULT_QUOTA } from './sessions/workspace-quota.ts';
import { CLUSTER_SERVE_FLAGS, clusterFromFlags, drainMsFromFlags, gatewayMain, GATEWAY_HELP } from './gateway/cli.ts';
import type { ClusterOptions } from './catalog/member.ts';
import { templateMain } from './templates/cli.ts';
import { MCP_HTTP_FLAGS, MCP_HTTP_HELP, mcpHttpFromFlags, type McpHttpAllowed } from './mcp/http-origin.ts';
import { defaultDataDir } from './templates/store.ts';
import { DEFAULT_MAX_SESSIONS_PER_PRINCIPAL } from './sessions/session-manager.ts';
import { DEFAULT_SESSION_SIZES, parseSizeList, validateSessionSizes, type SessionSizes } from './sessions/session-sizes.ts';

/** One VM restored and warmed ahead of the next wake: about a restored idle VM's memory, for wakes at a fraction of their cold cost. */
export const DEFAULT_STANDBY = 1;

const HELP = `hutch: sandboxes for AI agents, packed densely on one host

usage:
  hutch serve [options]     run the broker (WebSocket API for harnesses)
  hutch prepare [options]   build (or find cached) the guest kernel, rootfs and pristine snapshot
  hutch template ...        build | ls | inspect | rm templates: root filesystems the agent is baked into
                            (see hutch template --help)
  hutch gateway [options]   one endpoint in front of many brokers (routes by session, places new ones)
  hutch mcp [options]       MCP server on stdio for a local agent (a broker's sandboxes as MCP tools;
                            the broker also serves MCP over Streamable HTTP at /mcp)

serve options:
  --port N          TCP port (default 7070; 0 picks a free one)
  --host ADDR       listen address (default 127.0.0.1)
  --token T         bearer token harnesses must present, the principal "default"
                    (default: env HUTCH_TOKEN, else generated and printed unless --tokens-file is given)
  --tokens-file F   named principals, one "name:token" per line (or a JSON object name -> token); each
                    principal sees only the sessions it created
  --workspace-root DIR
                    host directory that create({ workspace: { dir } }) may copy from (repeatable;
                    none = directory sources refused)
  --metrics-port N  also serve /metrics without a token on this port (on the main port it needs a token)
  --metrics-host A  address for --metrics-port (default 127.0.0.1)
  --max-frame-mib N largest WebSocket message (default 64)
  --max-connections N
                    open WebSockets per principal (default 32)
  --quota-bytes N   workspace quota per session in allocated bytes (default 2 GiB); a create may ask less
  --quota-files N   workspace quota per session in files and directories (default 200000)
  --data-dir D      sessions and their workspaces (default: env HUTCH_DATA, else ~/.local/state/hutch)
  --backend B       where VM-routed calls run: ${BACKEND_NAMES.join(' | ')} (default: qemu; without QEMU
                    the broker refuses to start rather than pick a weaker backend)
  ${UNSAFE_LOCAL_ACK_FLAG}
                    required with --backend unsafe-local: tenants then share the host kernel (a bubblewrap
                    sandbox per call, no VM boundary); for development only
  --level L         policy preset: ${LEVEL_NAMES.join(' | ')} (default 4: routing, snapshot restore, 5 s release, cost model)
                    1 = a booted VM per session, never released; 2 = killed after 30 s idle, cold boot;
                    3 = snapshot restore without routing; reclaim/prefetch = keep idle VMs, reclaim memory
  --idle-ms N       release a VM after N ms without a VM call (overrides the level; 0 = never)
  --idle-policy P   auto | kill | snapshot | reclaim (overrides the level)
  --memory-steps S  switch steps of the guest's memory policy on or off, e.g. damon=off,prefetch=off
                    (damon zswap mglru activationSet reclaim hotSetLast prefetch reporting dropCaches)
  --log-level L     debug | info | warn | error (default info)
  --no-build        use the cached guest image only: fail clearly instead of building it
  --standby N       VMs kept restored and warmed for the next wake (default ${DEFAULT_STANDBY}; 0 = none;
                    each costs about one idle VM's memory)
  --max-sessions N  sessions one principal may hold, workspaces kept at close included (default
                    ${DEFAULT_MAX_SESSIONS_PER_PRINCIPAL}; each may fill its quota of the data dir's disk)
  --session-memory-mib LIST
                    guest memory sizes a session may ask for, MiB, comma-separated (default
                    ${DEFAULT_SESSION_SIZES.memoryMiB.join(',')}; 512 when a create names none and it is listed, else the
                    smallest); each size first woken costs a pristine snapshot (a cold boot, its image cached)
  --session-cpus LIST
                    vCPU counts a session may ask for (default ${DEFAULT_SESSION_SIZES.cpus.join(',')}; 1 when listed, else the smallest)
  --memory-budget-mib N
                    host memory the VMs may reserve, each its full size, standbys included (default 75%
                    of RAM); a wake past it stops a standby or waits, then fails busy
  --principal-memory-mib N
                    of that, what one principal's VMs may reserve (default: all of it with one principal,
                    half with several); its wake past it waits for one of its own VMs, then fails busy
  --slot-disk-gib N disk the snapshot slots may take in the data dir, GiB (default: half its filesystem);
                    a release with no room keeps its VM reclaimed instead of writing a slot
  --principal-slot-disk-gib N
                    of that, what one principal's slots may take (default: all of it with one principal,
                    half with several)
${MCP_HTTP_HELP}  --ready-fd N      when listening, write one JSON line {"url","port",...} to file descriptor N and close it
  --ready-json      print that JSON line on stdout instead of the human-readable line
  -h, --help        this text

${MCP_HELP}
${GATEWAY_HELP}`;

export interface ServeOptions {
  port: number;
  host: string;
  /** The single-token case (principal "default"). */
  token?: string;
  /** Named principals (name -> token). */
  tokens?: Record<string, string>;
  dataDir: string;
  backend?: string;
  /** Given with backend unsafe-local: the operator knows tenants share the host kernel. */
  acknowledgeUnsafeLocal?: boolean;
  workspaceRoots?: string[];
  limits?: Partial<WsLimits>;
  metricsListen?: { host: string; port: number };
  policy?: Partial<SandboxPolicy>;
  policyLevel?: string;
  log: Logger;
  /** Use the cached guest image only (fail with `unavailable` when it is missing). */
  noBuild?: boolean;
  /** Workspace quota per session (default 2 GiB and 200,000 entries). */
  quota?: { bytes: number; files: number };
  /** A broker behind gateways (catalog registration, /load, the gateway credential). */
  cluster?: ClusterOptions;
  /** Standby VMs kept warm for the next wake (qemu backend; default DEFAULT_STANDBY, 0 for none). */
  standby?: number;
  /** Host memory the VMs may reserve, MiB (default: 75% of RAM). */
  memoryBudgetMiB?: number;
  /** The VM sizes sessions may ask for (default DEFAULT_SESSION_SIZES). */
  sessionSizes?: SessionSizes;
  /** Sessions plus kept workspaces per principal (default DEFAULT_MAX_SESSIONS_PER_PRINCIPAL). */
  maxSessionsPerPrincipal?: number;
  /** VM memory one principal may reserve, MiB (default: the budget; half of it with several principals). */
  principalMemoryMiB?: number;
  /** Disk the snapshot slots may take, in all and per principal, bytes (default: half the data dir's filesystem). */
  slotDisk?: { totalBytes?: number; principalBytes?: number };
  /** /mcp's browser origins and extra Host names (--allowed-origin, --allowed-host). */
  mcpHttp?: McpHttpAllowed;
}

/** Starts a broker with the embedded defaults; used by the CLI, the demo and benches. */
export async function serve(o: ServeOptions): Promise<Broker> {
  // The fast path first: its spawn helper forks while the process is small, and unsafe-local runs through it.
  const fastPath = await createFastPath(o.log);
  const backend = await createBackend(o.backend, {
    log: o.log,
    dataDir: o.dataDir,
    fastPath,
    standby: o.standby ?? DEFAULT_STANDBY,
    ...(o.noBuild ? { noBuild: true } : {}),
    ...(o.acknowledgeUnsafeLocal ? { acknowledgeUnsafeLocal: true } : {}),
  }).catch(async (err: unknown) => {
    await fastPath.close();
    throw err;
  });
  const broker = new Broker({
    port: o.port,
    host: o.host,
    ...(o.token !== undefined ? { token: o.token } : {}),
    ...(o.tokens ? { tokens: o.tokens } : {}),
    ...(o.workspaceRoots ? { workspaceRoots: o.workspaceRoots } : {}),
    ...(o.sessionSizes ? { sessionSizes: o.sessionSizes } : {}),
    ...(o.maxSessionsPerPrincipal !== undefined ? { maxSessionsPerPrincipal: o.maxSessionsPerPrincipal } : {}),
    ...(o.limits ? { limits: o.limits } : {}),
    ...(o.metricsListen ? { metricsListen: o.metricsListen } : {}),
    ...(o.policyLevel ? { policyLevel: o.policyLevel } : {}),
    dataDir: o.dataDir,
    backend,
    fastPath,
    log: o.log,
    ...(o.policy ? { policy: o.policy } : {}),
    ...(o.quota ? { quota: o.quota } : {}),
    ...(o.cluster ? { cluster: o.cluster } : {}),
    ...(o.slotDisk ? { slotDisk: o.slotDisk } : {}),
    ...(o.mcpHttp ? { mcpHttp: o.mcpHttp } : {}),
    ...(o.memoryBudgetMiB !== undefined || o.principalMemoryMiB !== undefined
      ? { admission: { ...(o.memoryBudgetMiB !== undefined ? { memoryBudgetMiB: o.memoryBudgetMiB } : {}), ...(o.principalMemoryMiB !== undefined ? { principalMemoryMiB: o.principalMemoryMiB } : {}) } }
      : {}),
  });
  await broker.start();
  return broker;
}

/** --slot-disk-gib and --principal-slot-disk-gib, in bytes; a share above the total is refused. */
export function slotDiskFromFlags(total: string | undefined, principal: string | undefined): { slotDisk?: { totalBytes?: number; principalBytes?: number } } {
  if (total === undefined && principal === undefined) return {};
  const gib = 1024 ** 3;
  const totalBytes = total !== undefined ? positiveInt('--slot-disk-gib', total) * gib : undefined;
  const principalBytes = principal !== undefined ? positiveInt('--principal-slot-disk-gib', principal) * gib : undefined;
  if (totalBytes !== undefined && principalBytes !== undefined && principalBytes > totalBytes) {
    throw new HutchError('bad_request', `--principal-slot-disk-gib (${principal}) may be at most --slot-disk-gib (${total})`);
  }
  return { slotDisk: { ...(totalBytes !== undefined ? { totalBytes } : {}), ...(principalBytes !== undefined ? { principalBytes } : {}) } };
}

/** --level, then --idle-ms and --idle-policy on top, each checked. */
export function policyFromFlags(level: string | undefined, idleMs: string | undefined, idlePolicy: string | undefined): SandboxPolicy {
  const p = policyForLevel(level ?? '4');
  if (idleMs !== undefined) {
    const n = Number(idleMs);
    if (!Number.isInteger(n) || n < 0) throw new HutchError('bad_request', `--idle-ms must be a whole number of milliseconds >= 0, got ${JSON.stringify(idleMs)}`);
    p.idleMs = n === 0 ? null : n;
  }
  if (idlePolicy !== undefined) {
    const allowed = ['auto', 'kill', 'snapshot', 'reclaim'] as const;
    if (!(allowed as readonly string[]).includes(idlePolicy)) throw new HutchError('bad_request', `--idle-policy must be one of ${allowed.join(', ')}, got ${JSON.stringify(idlePolicy)}`);
    p.idlePolicy = idlePolicy as SandboxPolicy['idlePolicy'];
  }
  return p;
}

/** Builds what the qemu backend needs, so the first tenant does not wait for it. */
async function prepare(args: string[]): Promise<void> {
  const { values } = parseArgs({ args, options: { kernel: { type: 'string' }, 'memory-mib': { type: 'string', default: '512' }, cpus: { type: 'string', default: '1' } } });
  const log = createLogger({ name: 'hutch-prepare', level: 'info' });
  const t0 = Date.now();
  const backend = await QemuBackend.create({
    dataDir: join(cacheDir(), 'prepare'),
    cacheDir: cacheDir(),
    log,
    ...(values.kernel === 'debian' || values.kernel === 'hutch' ? { kernel: values.kernel } : {}),
  });
  await backend.prepare({ memoryMiB: Number(values['memory-mib']), cpus: Number(values.cpus) });
  await backend.shutdown();
  process.stderr.write(`hutch: guest ready (accel ${backend.accel}: ${backend.accelReason}) in ${((Date.now() - t0) / 1000).toFixed(1)} s\n`);
}

async function main(): Promise<void> {
  const [cmd, ...rest] = process.argv.slice(2);
  if (!cmd || cmd === '-h' || cmd === '--help' || cmd === 'help') {
    process.stdout.write(HELP);
    return;
  }
  if (cmd === 'prepare') {
    await prepare(rest);
    return;
  }
  if (cmd === 'mcp') {
    await mcpMain(rest, { serve, policyFromFlags });
    return;
  }
  if (cmd === 'gateway') {
    await gatewayMain(rest);
    return;
  }
  if (cmd === 'template') {
    await templateMain(rest);
    return;
  }
  if (cmd !== 'serve') throw new HutchError('bad_request', `unknown command ${cmd} (see hutch --help)`);
  const { values } = parseArgs({
    args: rest,
    options: {
      port: { type: 'string', default: '7070' },
      host: { type: 'string', default: '127.0.0.1' },
      token: { type: 'string' },
      'tokens-file': { type: 'string' },
      'workspace-root': { type: 'string', multiple: true },
      'metrics-port': { type: 'string' },
      'metrics-host': { type: 'string', default: '127.0.0.1' },
      'max-frame-mib': { type: 'string' },
      'max-connections': { type: 'string' },
      'quota-bytes': { type: 'string' },
      'quota-files': { type: 'string' },
      'data-dir': { type: 'string' },
      backend: { type: 'string' },
      'i-know-unsafe-local': { type: 'boolean' },
      level: { type: 'string' },
      'idle-ms': { type: 'string' },
      'idle-policy': { type: 'string' },
      'memory-steps': { type: 'string' },
      'log-level': { type: 'string' },
      'no-build': { type: 'boolean', default: false },
      standby: { type: 'string' },
      'memory-budget-mib': { type: 'string' },
      'session-memory-mib': { type: 'string' },
      'session-cpus': { type: 'string' },
      'max-sessions': { type: 'string' },
      'principal-memory-mib': { type: 'string' },
      'slot-disk-gib': { type: 'string' },
      'principal-slot-disk-gib': { type: 'string' },
      'ready-fd': { type: 'string' },
      'ready-json': { type: 'boolean', default: false },
      help: { type: 'boolean', short: 'h' },
      ...CLUSTER_SERVE_FLAGS,
      ...MCP_HTTP_FLAGS,
    },
  });
  if (values.help) {
    process.stdout.write(HELP);
    return;
  }
  const log = createLogger({ name: 'hutch-broker', level: parseLogLevel(values['log-level'] ?? process.env['HUTCH_LOG_LEVEL']) });
  const tokens = values['tokens-file'] ? parseTokens(readTokensFile(values['tokens-file']), values['tokens-file']) : undefined;
  const givenToken = values.token ?? process.env['HUTCH_TOKEN'];
  // A generated token only when no principal was configured at all.
  const token = givenToken ?? (tokens ? undefined : randomBytes(16).toString('hex'));
  const dataDir = defaultDataDir(values['data-dir']);
  // Checked before any work (the guest image, the port): a bad list fails at once.
  const sessionSizes = validateSessionSizes({
    memoryMiB: values['session-memory-mib'] !== undefined ? parseSizeList('--session-memory-mib', values['session-memory-mib']) : DEFAULT_SESSION_SIZES.memoryMiB,
    cpus: values['session-cpus'] !== undefined ? parseSizeList('--session-cpus', values['session-cpus']) : DEFAULT_SESSION_SIZES.cpus,
  });
  if (values['i-know-unsafe-local'] && values.backend !== 'unsafe-local') throw new HutchError('bad_request', `${UNSAFE_LOCAL_ACK_FLAG} goes with --backend unsafe-local`);
  const limits: Partial<WsLimits> = {
    ...(values['max-frame-mib'] !== undefined ? { maxPayloadBytes: positiveInt('--max-frame-mib', values['max-frame-mib']) * 1024 * 1024 } : {}),
    ...(values['max-connections'] !== undefined ? { maxConnectionsPerPrincipal: positiveInt('--max-connections', values['max-connections']) } : {}),
  };
  const broker = await serve({
    port: Number(values.port),
    host: values.host,
    ...(token !== undefined ? { token } : {}),
    ...(tokens ? { tokens } : {}),
    dataDir,
    ...(values.backend ? { backend: values.backend } : {}),
    ...(values['i-know-unsafe-local'] ? { acknowledgeUnsafeLocal: true } : {}),
    ...(values['workspace-root'] ? { workspaceRoots: values['workspace-root'] } : {}),
    sessionSizes,
    ...(values['max-sessions'] !== undefined ? { maxSessionsPerPrincipal: positiveInt('--max-sessions', values['max-sessions']) } : {}),
    ...(values['principal-memory-mib'] !== undefined ? { principalMemoryMiB: positiveInt('--principal-memory-mib', values['principal-memory-mib']) } : {}),
    ...slotDiskFromFlags(values['slot-disk-gib'], values['principal-slot-disk-gib']),
    limits,
    ...(values['metrics-port'] !== undefined ? { metricsListen: { host: values['metrics-host'], port: Number(values['metrics-port']) } } : {}),
    policyLevel: values.level ?? '4',
    ...(values['no-build'] ? { noBuild: true } : {}),
    ...(values.standby !== undefined ? { standby: nonNegativeInt('--standby', values.standby, 16) } : {}),
    ...(values['memory-budget-mib'] !== undefined ? { memoryBudgetMiB: positiveInt('--memory-budget-mib', values['memory-budget-mib']) } : {}),
    policy: { ...policyFromFlags(values.level, values['idle-ms'], values['idle-policy']), ...(values['memory-steps'] !== undefined ? { memoryPolicy: parseMemorySteps(values['memory-steps']) } : {}) },
    quota: {
      bytes: values['quota-bytes'] !== undefined ? positiveInt('--quota-bytes', values['quota-bytes']) : DEFAULT_QUOTA.bytes,
      files: values['quota-files'] !== undefined ? positiveInt('--quota-files', values['quota-files']) : DEFAULT_QUOTA.files,
    },
    ...clusterFromFlags(values),
    ...mcpHttpFromFlags(values),
    log,
  });
  // A file's principals are never printed; a generated token must be, or nobody could connect.
  const tokenGiven = Boolean(givenToken) || token === undefined;
  const url = `ws://${values.host}:${broker.port}`;
  // For a supervisor: one line of JSON once the port is open (a generated token is in it,
  // since nothing else could tell it to the harness; a given one is not repeated).
  const ready = `${JSON.stringify({ url, port: broker.port, host: values.host, dataDir, ...(tokenGiven ? {} : { token }) })}\n`;
  if (values['ready-fd'] !== undefined) writeReadyFd(values['ready-fd'], ready);
  if (values['ready-json']) process.stdout.write(ready);
  else {
    const who = tokens ? `principals ${Object.keys(tokens).join(', ')}${givenToken ? ' and default' : ''}` : `token ${tokenGiven ? '(as given)' : token}`;
    process.stdout.write(`hutch broker on ${url}  ${who}  data ${dataDir}\n`);
  }
  let stopping = false;
  const stop = async (sig: string) => {
    if (stopping) return;
    stopping = true;
    log.info('broker.signal', { signal: sig });
    // Drain first: deregister, refuse new work, let calls in flight finish; stop() then releases VMs to their snapshot slots.
    await broker.drain(drainMsFromFlags(values));
    await broker.stop();
    process.exit(0);
  };
  process.on('SIGINT', () => void stop('SIGINT'));
  process.on('SIGTERM', () => void stop('SIGTERM'));
}

function readTokensFile(path: string): string {
  try {
    return readFileSync(path, 'utf8');
  } catch (err) {
    throw new HutchError('not_found', `cannot read --tokens-file ${path}: ${(err as Error).message}`);
  }
}

function positiveInt(flag: string, v: string): number {
  const n = Number(v);
  if (!Number.isInteger(n) || n <= 0) throw new HutchError('bad_request', `${flag} must be a whole number > 0, got ${JSON.stringify(v)}`);
  return n;
}

function nonNegativeInt(flag: string, v: string, max: number): number {
  const n = Number(v);
  if (!Number.isInteger(n) || n < 0 || n > max) throw new HutchError('bad_request', `${flag} must be a whole number from 0 to ${max}, got ${JSON.stringify(v)}`);
  return n;
}

/** Writes the ready line to an inherited descriptor and closes it, so a reader sees EOF. */
function writeReadyFd(spec: string, line: string): void {
  const fd = Number(spec);
  if (!Number.isInteger(fd) || fd < 3) throw new HutchError('bad_request', `--ready-fd must be an open file descriptor number >= 3, got ${JSON.stringify(spec)}`);
  try {
    writeSync(fd, line);
    closeSync(fd);
  } catch (err) {
    throw new HutchError('bad_request', `--ready-fd ${fd}: ${(err as Error).message}`);
  }
}

// Run when executed, not when imported (the demo and benches import serve()): as
// host-broker/src/cli.ts under tsx, or as the package's bin (a symlink to dist/cli.js).
function invokedPath(): string {
  try {
    return realpathSync(process.argv[1] ?? '');
  } catch {
    return '';
  }
}
if (/cli\.(ts|js|mjs)$/.test(invokedPath())) {
  main().catch((err: unknown) => {
    const e = err instanceof HutchError ? err : new HutchError('internal', (err as Error).message);
    process.stderr.write(`hutch: ${e.code}: ${e.message}\n`);
    process.exit(2);
  });
}
