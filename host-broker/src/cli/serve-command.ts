/**
 * `hutch serve`: every option is checked here, before anything slow (the guest image, the
 * fast path, the port); the broker itself (serve.ts) is loaded only then.
 */
import { MCP_HTTP_OPTIONS, mcpHttpFrom } from '../mcp/http-origin.ts';
import { closeSync, fstatSync, writeSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { callerPath, Command, int, logLevel, oneOf, port, UsageError, writableDir } from '../../../guest-agent/src/cli-options.ts';
import { BACKEND_NAMES, UNSAFE_LOCAL_ACK_FLAG } from '../backends/names.ts';
import { CLUSTER_OPTIONS, clusterFromFlags } from '../gateway/cli.ts';
import { parseMemorySteps } from '../policy/memory-policy.ts';
import { LEVEL_NAMES, policyForLevel, type SandboxPolicy } from '../policy/sandbox-policy.ts';
import { DEFAULT_SESSION_SIZES, parseSizeList, validateSessionSizes } from '../sessions/session-sizes.ts';
import { defaultDataDir } from '../templates/store.ts';
import { TOKEN_OPTIONS, tokensFrom } from './tokens.ts';
import { EGRESS_MODES, type EgressMode } from '../network/egress-policy.ts';
import { readAllowlistFile } from '../network/allowlist-file.ts';
import type { ServeNetwork } from '../serve.ts';
import { installPackagesForClone } from './host-packages.ts';

const IDLE_POLICIES = ['auto', 'kill', 'snapshot', 'reclaim'] as const;

/** `--backend`: a backend's name (the old `local` is named for what it became). */
function backendName(text: string, option: string): string {
  if (text === 'local') throw new UsageError(`${option} local is now called unsafe-local and needs ${UNSAFE_LOCAL_ACK_FLAG}`, option);
  return oneOf(BACKEND_NAMES)(text, option);
}

/** `--ready-fd`: a descriptor this process inherited open. */
function openFd(text: string, option: string): number {
  const fd = int(3, 65535)(text, option);
  try {
    fstatSync(fd);
  } catch {
    throw new UsageError(`${option} ${fd} is not an open file descriptor of this process (the supervisor opens it: hutch serve --ready-fd 3 3>ready)`, option);
  }
  return fd;
}

export const SERVE = new Command({
  name: 'hutch serve',
  summary: 'Run the broker: the WebSocket API for harnesses, MCP at /mcp, the E2B API at /e2b, /metrics, /healthz, /readyz.',
  options: {
    port: { arg: 'N', help: 'TCP port (default 7070; 0 picks a free one)', default: '7070', parse: port },
    host: { arg: 'ADDR', help: 'listen address (default 127.0.0.1)', default: '127.0.0.1' },
    ...TOKEN_OPTIONS,
    'workspace-root': { arg: 'DIR', help: 'a host directory create({ workspace: { dir } }) may copy from (repeatable;\nnone: directory sources are refused)', multiple: true, parse: (t: string) => callerPath(t) },
    'data-dir': { arg: 'D', help: 'sessions and their workspaces (default: env HUTCH_DATA, else ~/.local/state/hutch)', parse: writableDir },
    backend: { arg: 'B', help: `where VM-routed calls run: ${BACKEND_NAMES.join(' | ')} (default qemu; without QEMU\nthe broker refuses to start rather than pick a weaker backend)`, parse: backendName },
    'i-know-unsafe-local': { help: 'required with --backend unsafe-local: tenants then share the host kernel' },
    level: { arg: 'L', help: `policy preset: ${LEVEL_NAMES.join(' | ')} (default 4: routing, snapshot restore,\n5 s release; 1 = a booted VM per session, never released; README "Policies")`, parse: oneOf(LEVEL_NAMES) },
    'idle-ms': { arg: 'N', help: 'release a VM after N ms without a VM call (overrides the level; 0 = never)', parse: int(0) },
    'idle-policy': { arg: 'P', help: `${IDLE_POLICIES.join(' | ')} (overrides the level)`, parse: oneOf(IDLE_POLICIES) },
    'memory-steps': { arg: 'S', help: "switch steps of the guest's memory policy, e.g. damon=off,prefetch=off", parse: (t: string) => parseMemorySteps(t) },
    'no-build': { help: 'use the cached guest image only: fail clearly instead of building it' },
    standby: { arg: 'N', help: 'VMs kept restored and warmed for the next wake (default 1; 0 = none;\neach costs about one idle VM\'s memory)', parse: int(0, 16) },
    'log-level': { arg: 'L', help: 'debug | info | warn | error (default info; env HUTCH_LOG_LEVEL)', env: 'HUTCH_LOG_LEVEL', parse: logLevel },
    'ready-fd': { arg: 'N', help: 'when listening, write one JSON line {"url","port",...} to descriptor N and close it', parse: openFd },
    'ready-json': { help: 'print that JSON line on stdout instead of the human-readable line' },
    'drain-ms': { arg: 'N', help: 'on SIGTERM, how long calls in flight may take to finish (default 60000)', default: '60000', parse: int(1) },
    'metrics-port': { arg: 'N', help: 'also serve /metrics without a token on this port', parse: port, group: 'limits and metrics' },
    'metrics-host': { arg: 'A', help: 'address for --metrics-port (default 127.0.0.1)', default: '127.0.0.1', group: 'limits and metrics' },
    'max-frame-mib': { arg: 'N', help: 'largest WebSocket message, MiB (default 64)', parse: int(1, 1024), group: 'limits and metrics' },
    'max-connections': { arg: 'N', help: 'open WebSockets per principal (default 32)', parse: int(1), group: 'limits and metrics' },
    'quota-bytes': { arg: 'N', help: 'workspace quota per session, allocated bytes (default 2 GiB)', parse: int(1), group: 'limits and metrics' },
    'quota-files': { arg: 'N', help: 'workspace quota per session, files and directories (default 200000)', parse: int(1), group: 'limits and metrics' },
    'max-sessions': { arg: 'N', help: 'sessions one principal may hold, kept workspaces included (default 128)', parse: int(1), group: 'limits and metrics' },
    'session-memory-mib': { arg: 'LIST', help: `guest memory sizes a session may ask for, MiB (default ${DEFAULT_SESSION_SIZES.memoryMiB.join(',')})`, parse: (t: string, o: string) => parseSizeList(o, t), group: 'limits and metrics' },
    'session-cpus': { arg: 'LIST', help: `vCPU counts a session may ask for (default ${DEFAULT_SESSION_SIZES.cpus.join(',')})`, parse: (t: string, o: string) => parseSizeList(o, t), group: 'limits and metrics' },
    'memory-budget-mib': { arg: 'N', help: 'host memory the VMs may reserve, standbys included (default 75% of RAM)', parse: int(1), group: 'limits and metrics' },
    'principal-memory-mib': { arg: 'N', help: "of that, one principal's share (default: all with one principal, half with several)", parse: int(1), group: 'limits and metrics' },
    'slot-disk-gib': { arg: 'N', help: "disk the snapshot slots may take, GiB (default: half the data dir's filesystem)", parse: int(1), group: 'limits and metrics' },
    'principal-slot-disk-gib': { arg: 'N', help: "of that, one principal's share (default: all with one principal, half with several)", parse: int(1), group: 'limits and metrics' },
    'egress-default': { arg: 'MODE', help: `what a sandbox asking nothing reaches: ${EGRESS_MODES.join(' | ')} (default allowlist: this host's registries)`, parse: oneOf(EGRESS_MODES), group: 'network' },
    'egress-allowlist': { arg: 'FILE', help: 'the default allowlist instead: a rule per line (domain, *.domain, CIDR, :port)', parse: (t: string, o: string) => asUsage(() => readAllowlistFile(callerPath(t)), o), group: 'network' },
    'egress-max': { arg: 'MODE', help: `the most a sandbox may ask for: ${EGRESS_MODES.join(' | ')} (default public)`, parse: oneOf(EGRESS_MODES), group: 'network' },
    'egress-mib-s': { arg: 'N', help: "a sandbox's proxy traffic, MiB/s (default 32)", parse: int(1, 100_000), group: 'network' },
    'egress-connections': { arg: 'N', help: "a sandbox's proxy connections at once (default 64)", parse: int(1, 100_000), group: 'network' },
    ...CLUSTER_OPTIONS,
    ...MCP_HTTP_OPTIONS,
  },
  footer: 'Tokens: --token-file F or env HUTCH_TOKEN keep the token off the command line; with none, one is\ngenerated and printed. Logs are JSON lines on stderr.',
});

/** --level, then --idle-ms and --idle-policy on top. */
export function policyFromFlags(level: string | undefined, idleMs: string | number | undefined, idlePolicy: string | undefined): SandboxPolicy {
  const p = policyForLevel(level ?? '4');
  if (idleMs !== undefined) {
    const n = typeof idleMs === 'number' ? idleMs : int(0)(idleMs, '--idle-ms');
    p.idleMs = n === 0 ? null : n;
  }
  if (idlePolicy !== undefined) p.idlePolicy = oneOf(IDLE_POLICIES)(idlePolicy, '--idle-policy');
  return p;
}

/** --slot-disk-gib and --principal-slot-disk-gib, in bytes; a share above the total is refused. */
export function slotDiskFromFlags(total: string | number | undefined, principal: string | number | undefined): { slotDisk?: { totalBytes?: number; principalBytes?: number } } {
  if (total === undefined && principal === undefined) return {};
  const gib = 1024 ** 3;
  const whole = (v: string | number, flag: string) => (typeof v === 'number' ? v : int(1)(v, flag));
  const totalBytes = total !== undefined ? whole(total, '--slot-disk-gib') * gib : undefined;
  const principalBytes = principal !== undefined ? whole(principal, '--principal-slot-disk-gib') * gib : undefined;
  if (totalBytes !== undefined && principalBytes !== undefined && principalBytes > totalBytes) {
    throw new UsageError(`--principal-slot-disk-gib (${principal}) may be at most --slot-disk-gib (${total})`, '--principal-slot-disk-gib');
  }
  return { slotDisk: { ...(totalBytes !== undefined ? { totalBytes } : {}), ...(principalBytes !== undefined ? { principalBytes } : {}) } };
}

function asUsage<T>(fn: () => T, option: string): T {
  try {
    return fn();
  } catch (err) {
    throw new UsageError((err as Error).message, option);
  }
}

/** The --egress-* options as the broker's network defaults; a default above the maximum is refused. */
function networkFrom(v: { 'egress-default'?: EgressMode | undefined; 'egress-allowlist'?: string[] | undefined; 'egress-max'?: EgressMode | undefined; 'egress-mib-s'?: number | undefined; 'egress-connections'?: number | undefined }): { network?: ServeNetwork } {
  const rank = (m: EgressMode) => EGRESS_MODES.indexOf(m);
  if (v['egress-default'] && v['egress-max'] && rank(v['egress-default']) > rank(v['egress-max'])) throw new UsageError(`--egress-default ${v['egress-default']} is more than --egress-max ${v['egress-max']}`, '--egress-default');
  const network: ServeNetwork = {
    ...(v['egress-default'] ? { mode: v['egress-default'] } : {}),
    ...(v['egress-allowlist'] ? { allowlist: v['egress-allowlist'] } : {}),
    ...(v['egress-max'] ? { max: v['egress-max'] } : {}),
    ...(v['egress-mib-s'] !== undefined || v['egress-connections'] !== undefined
      ? { limits: { bytesPerSecond: (v['egress-mib-s'] ?? 32) * 1024 * 1024, maxConnections: v['egress-connections'] ?? 64 } }
      : {}),
  };
  return Object.keys(network).length ? { network } : {};
}

export async function serveMain(args: string[]): Promise<void> {
  const parsed = SERVE.parse(args);
  if (!parsed) return;
  const v = parsed.values;
  // Everything the options say is checked first: a bad one is refused before any work.
  const { tokens: given, single } = tokensFrom(v);
  const named = v['tokens-file']?.tokens;
  // A generated token only when no principal was configured at all.
  const token = single ?? (named ? undefined : randomBytes(16).toString('hex'));
  const dataDir = v['data-dir'] ?? writableDir(defaultDataDir(), '--data-dir (from HUTCH_DATA or the default)');
  if (v['i-know-unsafe-local'] && v.backend !== 'unsafe-local') throw new UsageError(`${UNSAFE_LOCAL_ACK_FLAG} goes with --backend unsafe-local`, UNSAFE_LOCAL_ACK_FLAG);
  if (v.backend === 'unsafe-local' && !v['i-know-unsafe-local']) throw new UsageError(`--backend unsafe-local runs tenants on the host kernel (no VM boundary); give ${UNSAFE_LOCAL_ACK_FLAG} to acknowledge that`, '--backend');
  if (v['metrics-port'] !== undefined && v['metrics-port'] !== 0 && v['metrics-port'] === v.port) throw new UsageError(`--metrics-port ${v['metrics-port']} is --port too: give it a port of its own`, '--metrics-port');
  let sessionSizes;
  try {
    sessionSizes = validateSessionSizes({ memoryMiB: v['session-memory-mib'] ?? DEFAULT_SESSION_SIZES.memoryMiB, cpus: v['session-cpus'] ?? DEFAULT_SESSION_SIZES.cpus });
  } catch (err) {
    throw new UsageError(`--session-memory-mib / --session-cpus: ${(err as Error).message}`, '--session-memory-mib');
  }
  const slotDisk = slotDiskFromFlags(v['slot-disk-gib'], v['principal-slot-disk-gib']);
  const cluster = clusterFromFlags(v, given);
  const policy = { ...policyFromFlags(v.level, v['idle-ms'], v['idle-policy']), ...(v['memory-steps'] !== undefined ? { memoryPolicy: v['memory-steps'] } : {}) };

  await installPackagesForClone();
  const [{ createLogger }, { serve }, { DEFAULT_QUOTA }] = await Promise.all([import('../../../guest-agent/src/log.ts'), import('../serve.ts'), import('../sessions/workspace-quota.ts')]);
  const log = createLogger({ name: 'hutch-broker', level: v['log-level'] ?? 'info' });
  const broker = await serve({
    port: v.port,
    host: v.host,
    ...(token !== undefined ? { token } : {}),
    ...(named ? { tokens: named } : {}),
    dataDir,
    ...(v.backend ? { backend: v.backend } : {}),
    ...(v['i-know-unsafe-local'] ? { acknowledgeUnsafeLocal: true } : {}),
    ...(v['workspace-root'].length ? { workspaceRoots: v['workspace-root'] } : {}),
    sessionSizes,
    ...(v['max-sessions'] !== undefined ? { maxSessionsPerPrincipal: v['max-sessions'] } : {}),
    ...(v['principal-memory-mib'] !== undefined ? { principalMemoryMiB: v['principal-memory-mib'] } : {}),
    ...slotDisk,
    limits: {
      ...(v['max-frame-mib'] !== undefined ? { maxPayloadBytes: v['max-frame-mib'] * 1024 * 1024 } : {}),
      ...(v['max-connections'] !== undefined ? { maxConnectionsPerPrincipal: v['max-connections'] } : {}),
    },
    ...(v['metrics-port'] !== undefined ? { metricsListen: { host: v['metrics-host'], port: v['metrics-port'] } } : {}),
    policyLevel: v.level ?? '4',
    ...(v['no-build'] ? { noBuild: true } : {}),
    ...(v.standby !== undefined ? { standby: v.standby } : {}),
    ...(v['memory-budget-mib'] !== undefined ? { memoryBudgetMiB: v['memory-budget-mib'] } : {}),
    policy,
    quota: { bytes: v['quota-bytes'] ?? DEFAULT_QUOTA.bytes, files: v['quota-files'] ?? DEFAULT_QUOTA.files },
    ...cluster,
    ...mcpHttpFrom(v),
    ...networkFrom(v),
    log,
  });
  // A file's principals are never printed; a generated token must be, or nobody could connect.
  const generated = single === undefined && token !== undefined;
  const url = `ws://${v.host}:${broker.port}`;
  // For a supervisor: one line of JSON once the port is open (a generated token is in it,
  // since nothing else could tell it to the harness; a given one is not repeated).
  const ready = `${JSON.stringify({ url, port: broker.port, host: v.host, dataDir, ...(generated ? { token } : {}) })}\n`;
  if (v['ready-fd'] !== undefined) writeReadyFd(v['ready-fd'], ready);
  if (v['ready-json']) process.stdout.write(ready);
  else {
    const who = named ? `principals ${Object.keys(named).join(', ')}${single !== undefined ? ' and default' : ''}` : `token ${generated ? token : '(as given)'}`;
    process.stdout.write(`hutch broker on ${url}  ${who}  data ${dataDir}\n`);
  }
  let stopping = false;
  const stop = async (sig: string) => {
    if (stopping) return;
    stopping = true;
    log.info('broker.signal', { signal: sig });
    // Drain first: deregister, refuse new work, let calls in flight finish; stop() then releases VMs to their snapshot slots.
    await broker.drain(v['drain-ms']);
    await broker.stop();
    process.exit(0);
  };
  process.on('SIGINT', () => void stop('SIGINT'));
  process.on('SIGTERM', () => void stop('SIGTERM'));
}

/** Writes the ready line to an inherited descriptor and closes it, so a reader sees EOF. */
function writeReadyFd(fd: number, line: string): void {
  writeSync(fd, line);
  closeSync(fd);
}
