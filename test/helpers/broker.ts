import { execFileSync } from 'node:child_process';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { randomBytes } from 'node:crypto';
import { createLogger, type Logger } from '../../guest-agent/src/log.ts';
import { Broker, type BrokerOptions } from '../../host-broker/src/broker.ts';
import { createBackend } from '../../host-broker/src/backends/registry.ts';
import type { VmBackend } from '../../host-broker/src/backends/backend.ts';
import { createFastPath } from '../../host-broker/src/tools/fastpath-factory.ts';
import { Hutch } from '../../host-broker/src/sdk/index.ts';
import type { SandboxPolicy } from '../../host-broker/src/policy/sandbox-policy.ts';
import type { WsLimits } from '../../host-broker/src/api/ws-server.ts';
import type { AdmissionOptions } from '../../host-broker/src/admission.ts';
import type { SessionSizes } from '../../host-broker/src/sessions/session-sizes.ts';

export interface TestBroker {
  broker: Broker;
  backend: VmBackend;
  url: string;
  token: string;
  dataDir: string;
  connect(opts?: { encoding?: 'json' | 'msgpack' }): Promise<Hutch>;
  stop(opts?: { keepData?: boolean }): Promise<void>;
}

/** A real broker on a free port with a fresh data dir (or a given one, to test restarts). */
export async function startBroker(
  o: {
    /** Default unsafe-local (acknowledged here: tests run it on purpose). */
    backend?: string;
    dataDir?: string;
    maxFileBytes?: number;
    /** How long a fast-path command may run (default the broker's 30 s). */
    fastPathMaxMs?: number;
    idleMs?: number;
    policy?: Partial<SandboxPolicy>;
    /** More principals beside the default token's. */
    tokens?: Record<string, string>;
    workspaceRoots?: string[];
    limits?: Partial<WsLimits>;
    /** A second, token-less listener for /metrics. */
    metricsListen?: { host: string; port: number };
    /** The broker's workspace quota per session. */
    quota?: { bytes: number; files: number };
    /** qemu: standby VMs kept warm (default none in tests, so VM counts stay what each test starts). */
    standby?: number;
    /** Admission limits (the memory budget, queue timeout) instead of the host-sized defaults. */
    admission?: Partial<AdmissionOptions>;
    /** The VM sizes sessions may ask for. */
    sessionSizes?: SessionSizes;
    /** Sessions plus kept workspaces per principal. */
    maxSessionsPerPrincipal?: number;
    /** Disk the snapshot slots may take. */
    slotDisk?: BrokerOptions['slotDisk'];
    /** The broker's logger (default: warnings and errors on stderr). */
    log?: Logger;
    /** /mcp's allowed browser origins and extra Host names. */
    mcpHttp?: BrokerOptions['mcpHttp'];
    /** Sandbox networks (qemu): default egress, limits. */
    network?: BrokerOptions['network'];
  } = {},
): Promise<TestBroker> {
  const dataDir = o.dataDir ?? mkdtempSync(join(tmpdir(), 'hutch-broker-test-'));
  const token = randomBytes(12).toString('hex');
  const log = o.log ?? createLogger({ name: 'hutch-broker', level: 'warn' });
  const fastPath = await createFastPath(log);
  const backend = await createBackend(o.backend ?? 'unsafe-local', { log, dataDir, fastPath, acknowledgeUnsafeLocal: true, ...(o.standby !== undefined ? { standby: o.standby } : {}) });
  const broker = new Broker({
    port: 0,
    token,
    dataDir,
    backend,
    fastPath,
    log,
    ...(o.maxFileBytes ? { maxFileBytes: o.maxFileBytes } : {}),
    ...(o.fastPathMaxMs ? { fastPathMaxMs: o.fastPathMaxMs } : {}),
    ...(o.idleMs ? { idleMs: o.idleMs } : {}),
    ...(o.policy ? { policy: o.policy } : {}),
    ...(o.tokens ? { tokens: o.tokens } : {}),
    ...(o.workspaceRoots ? { workspaceRoots: o.workspaceRoots } : {}),
    ...(o.limits ? { limits: o.limits } : {}),
    ...(o.metricsListen ? { metricsListen: o.metricsListen } : {}),
    ...(o.quota ? { quota: o.quota } : {}),
    ...(o.admission ? { admission: o.admission } : {}),
    ...(o.sessionSizes ? { sessionSizes: o.sessionSizes } : {}),
    ...(o.maxSessionsPerPrincipal !== undefined ? { maxSessionsPerPrincipal: o.maxSessionsPerPrincipal } : {}),
    ...(o.slotDisk ? { slotDisk: o.slotDisk } : {}),
    ...(o.mcpHttp ? { mcpHttp: o.mcpHttp } : {}),
    ...(o.network ? { network: o.network } : {}),
  });
  const port = await broker.start();
  const url = `ws://127.0.0.1:${port}`;
  const clients: Hutch[] = [];
  return {
    broker,
    backend,
    url,
    token,
    dataDir,
    async connect(opts = {}) {
      const h = await Hutch.connect(url, { token, ...opts });
      clients.push(h);
      return h;
    },
    async stop(opts = {}) {
      for (const c of clients) c.close();
      await broker.stop();
      // GNU rm walks by fds: a workspace deeper than PATH_MAX a test left behind goes too (fs.rm fails on it).
      if (!opts.keepData) execFileSync('rm', ['-rf', '--', dataDir]);
    },
  };
}
