/**
 * `hutch gateway` and the flags that make `hutch serve` a cluster member. Kept here so the
 * main CLI only dispatches to it.
 */
import { readFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { createLogger, parseLogLevel } from '../../../guest-agent/src/log.ts';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { Principals, parseTokens } from '../api/principals.ts';
import type { ClusterOptions } from '../catalog/member.ts';
import { Gateway } from './gateway.ts';
import { MCP_HTTP_FLAGS, MCP_HTTP_HELP, mcpHttpFromFlags } from '../mcp/http-origin.ts';

export const GATEWAY_HELP = `gateway options (hutch gateway: one endpoint in front of many brokers):
  --port N          TCP port (default 7080; 0 picks a free one)
  --host ADDR       listen address (default 127.0.0.1)
  --token T / --tokens-file F
                    tenant tokens, as for serve (env HUTCH_TOKEN); checked here, carried to brokers
  --catalog URL     the catalog, redis://host:port or rediss://host:port (TLS; env HUTCH_CATALOG)
  --gateway-token-file F
                    the gateway-to-broker credential (env HUTCH_GATEWAY_TOKEN), shared with the brokers
  --sample K        brokers sampled per placement (default 2)
  --metrics-port N  also serve /metrics without a token on this port; --metrics-host A (default 127.0.0.1)
  --drain-ms N      on SIGTERM, /healthz answers 503 and calls in flight get this long to finish (default 10000)
  --fan-out-ms N    what each broker gets to answer a request asked of all (sessions, the E2B list, a signal
                    passed on) before the answer goes without it, naming it in \`unavailable\` (default 5000)
  --max-connections N, --max-frame-mib N, --log-level L, --ready-json: as for serve
${MCP_HTTP_HELP}
cluster options of serve (a broker behind gateways):
  --catalog URL     register in this catalog, redis:// or rediss:// (TLS) (env HUTCH_CATALOG); without it the broker stands alone
  --broker-id ID    stable id of this broker (default: the host name; its sessions live on this node)
  --advertise-url U where gateways reach this broker (default ws://<host name>:<port>)
  --lease-ms N      registration lease, renewed every third of it (default 10000)
  --advertise-template T
                    a template this broker can create sessions from (repeatable)
  --gateway-token-file F
                    the gateway credential (env HUTCH_GATEWAY_TOKEN): required with --catalog
  --drain-ms N      on SIGTERM, how long calls in flight may take to finish (default 60000)
`;

/** parseArgs options `hutch serve` adds for cluster membership. */
export const CLUSTER_SERVE_FLAGS = {
  catalog: { type: 'string' },
  'broker-id': { type: 'string' },
  'advertise-url': { type: 'string' },
  'lease-ms': { type: 'string' },
  'advertise-template': { type: 'string', multiple: true },
  'gateway-token-file': { type: 'string' },
  'drain-ms': { type: 'string' },
} as const;

type ClusterFlagValues = { [K in keyof typeof CLUSTER_SERVE_FLAGS]?: (typeof CLUSTER_SERVE_FLAGS)[K] extends { multiple: true } ? string[] : string };

/** The broker's cluster options from its flags (undefined: a standalone broker). */
export function clusterFromFlags(v: ClusterFlagValues): { cluster?: ClusterOptions } {
  const catalogUrl = v.catalog ?? process.env['HUTCH_CATALOG'];
  if (!catalogUrl) return {};
  return {
    cluster: {
      catalogUrl,
      gatewayToken: gatewayCredential(v['gateway-token-file']),
      ...(v['broker-id'] ? { brokerId: v['broker-id'] } : {}),
      ...(v['advertise-url'] ? { advertiseUrl: v['advertise-url'] } : {}),
      ...(v['lease-ms'] ? { leaseMs: positiveInt('--lease-ms', v['lease-ms']) } : {}),
      ...(v['advertise-template'] ? { templates: v['advertise-template'] } : {}),
    },
  };
}

/** --drain-ms, default one minute. */
export function drainMsFromFlags(v: ClusterFlagValues): number {
  return v['drain-ms'] !== undefined ? positiveInt('--drain-ms', v['drain-ms']) : 60_000;
}

function gatewayCredential(file: string | undefined): string {
  const token = file ? readText(file, '--gateway-token-file').trim() : process.env['HUTCH_GATEWAY_TOKEN'];
  if (!token) throw new HutchError('bad_request', 'a cluster member needs the gateway credential: --gateway-token-file F or env HUTCH_GATEWAY_TOKEN');
  return token;
}

function readText(path: string, flag: string): string {
  try {
    return readFileSync(path, 'utf8');
  } catch (err) {
    throw new HutchError('not_found', `cannot read ${flag} ${path}: ${(err as Error).message}`);
  }
}

function positiveInt(flag: string, v: string): number {
  const n = Number(v);
  if (!Number.isInteger(n) || n <= 0) throw new HutchError('bad_request', `${flag} must be a whole number > 0, got ${JSON.stringify(v)}`);
  return n;
}

export async function gatewayMain(args: string[]): Promise<void> {
  const { values } = parseArgs({
    args,
    options: {
      port: { type: 'string', default: '7080' },
      host: { type: 'string', default: '127.0.0.1' },
      token: { type: 'string' },
      'tokens-file': { type: 'string' },
      catalog: { type: 'string' },
      'gateway-token-file': { type: 'string' },
      sample: { type: 'string' },
      'metrics-port': { type: 'string' },
      'metrics-host': { type: 'string', default: '127.0.0.1' },
      'max-connections': { type: 'string' },
      'max-frame-mib': { type: 'string' },
      'log-level': { type: 'string' },
      'ready-json': { type: 'boolean', default: false },
      'drain-ms': { type: 'string' },
      'fan-out-ms': { type: 'string' },
      help: { type: 'boolean', short: 'h' },
      ...MCP_HTTP_FLAGS,
    },
  });
  if (values.help) {
    process.stdout.write(GATEWAY_HELP);
    return;
  }
  const log = createLogger({ name: 'hutch-gateway', level: parseLogLevel(values['log-level'] ?? process.env['HUTCH_LOG_LEVEL']) });
  const token = values.token ?? process.env['HUTCH_TOKEN'];
  const tokens = { ...(token !== undefined ? { default: token } : {}), ...(values['tokens-file'] ? parseTokens(readText(values['tokens-file'], '--tokens-file'), values['tokens-file']) : {}) };
  const catalogUrl = values.catalog ?? process.env['HUTCH_CATALOG'];
  if (!catalogUrl) throw new HutchError('bad_request', 'hutch gateway needs --catalog redis://host:port (or env HUTCH_CATALOG)');
  const gw = new Gateway({
    port: Number(values.port),
    host: values.host,
    principals: new Principals(tokens),
    catalogUrl,
    credential: gatewayCredential(values['gateway-token-file']),
    log,
    ...(values.sample !== undefined ? { sampleK: positiveInt('--sample', values.sample) } : {}),
    ...(values['fan-out-ms'] !== undefined ? { fanOutMs: positiveInt('--fan-out-ms', values['fan-out-ms']) } : {}),
    ...mcpHttpFromFlags(values),
    ...(values['metrics-port'] !== undefined ? { metricsListen: { host: values['metrics-host'], port: Number(values['metrics-port']) } } : {}),
    limits: {
      ...(values['max-frame-mib'] !== undefined ? { maxPayloadBytes: positiveInt('--max-frame-mib', values['max-frame-mib']) * 1024 * 1024 } : {}),
      ...(values['max-connections'] !== undefined ? { maxConnectionsPerPrincipal: positiveInt('--max-connections', values['max-connections']) } : {}),
    },
  });
  await gw.start();
  const url = `ws://${values.host}:${gw.port}`;
  const ready = `${JSON.stringify({ url, port: gw.port, host: values.host, ...(gw.metricsPort ? { metricsPort: gw.metricsPort } : {}) })}\n`;
  process.stdout.write(values['ready-json'] ? ready : `hutch gateway on ${url}  catalog ${catalogUrl}\n`);
  let stopping = false;
  const stop = async (sig: string) => {
    if (stopping) return;
    stopping = true;
    log.info('gateway.signal', { signal: sig });
    if (sig === 'SIGTERM') await gw.drain(values['drain-ms'] !== undefined ? positiveInt('--drain-ms', values['drain-ms']) : 10_000);
    await gw.stop();
    process.exit(0);
  };
  process.on('SIGINT', () => void stop('SIGINT'));
  process.on('SIGTERM', () => void stop('SIGTERM'));
}
