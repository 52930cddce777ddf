/**
 * A broker on the embedded defaults: the fast path, the backend (qemu unless told
 * otherwise) and the Broker, started. What `hutch serve` runs once its options are checked,
 * and what the demo, the examples and the benches start.
 */
import type { McpHttpAllowed } from './mcp/http-origin.ts';
import type { Logger } from '../../guest-agent/src/log.ts';
import type { WsLimits } from './api/ws-server.ts';
import { createBackend } from './backends/registry.ts';
import { Broker, type BrokerOptions } from './broker.ts';
import type { ClusterOptions } from './catalog/member.ts';
import type { SandboxPolicy } from './policy/sandbox-policy.ts';
import type { SessionSizes } from './sessions/session-sizes.ts';
import { createFastPath } from './tools/fastpath-factory.ts';

/** One VM restored and warmed ahead of the next wake: about a restored idle VM's memory, for wakes at a fraction of their cold cost. */
export const DEFAULT_STANDBY = 1;

/** Sandboxes' networks: the default egress and its limits (hutch serve --egress-*). */
export type ServeNetwork = NonNullable<BrokerOptions['network']>;

export interface ServeOptions {
  network?: ServeNetwork;
  /** /mcp's browser origins and extra Host names (--allowed-origin, --allowed-host). */
  mcpHttp?: McpHttpAllowed;
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
    ...(o.network ? { network: o.network } : {}),
    ...(o.memoryBudgetMiB !== undefined || o.principalMemoryMiB !== undefined
      ? { admission: { ...(o.memoryBudgetMiB !== undefined ? { memoryBudgetMiB: o.memoryBudgetMiB } : {}), ...(o.principalMemoryMiB !== undefined ? { principalMemoryMiB: o.principalMemoryMiB } : {}) } }
      : {}),
  });
  await broker.start();
  return broker;
}
