/**
 * `hutch gateway` and the options that make `hutch serve` a cluster member. Options are
 * checked before the gateway (or broker) is loaded; main() then imports it.
 */
import { MCP_HTTP_OPTIONS, mcpHttpFrom } from '../mcp/http-origin.ts';
import { Command, fileText, int, logLevel, port, UsageError, type OptionSpec } from '../../../guest-agent/src/cli-options.ts';
import type { ClusterOptions } from '../catalog/member.ts';
import { TOKEN_OPTIONS, tokensFrom } from '../cli/tokens.ts';
import { GatewayCredential } from './credential.ts';

function catalogUrl(text: string, option: string): string {
  if (!/^rediss?:\/\/[^/]+/.test(text)) throw new UsageError(`${option} must be redis://HOST:PORT or rediss://HOST:PORT (TLS), got ${JSON.stringify(text)}`, option);
  return text;
}

function wsUrl(text: string, option: string): string {
  if (!/^wss?:\/\/[^/]+/.test(text)) throw new UsageError(`${option} must be ws://HOST:PORT or wss://HOST:PORT, got ${JSON.stringify(text)}`, option);
  return text;
}

const CREDENTIAL = {
  'gateway-token-file': { arg: 'F', help: 'the gateway-to-broker credential, shared with the brokers (env HUTCH_GATEWAY_TOKEN)', parse: fileText },
} satisfies Record<string, OptionSpec>;

/** The options `hutch serve` adds for cluster membership. */
export const CLUSTER_OPTIONS = {
  catalog: { arg: 'URL', help: 'register in this catalog, redis:// or rediss:// (env HUTCH_CATALOG); without it the broker stands alone', env: 'HUTCH_CATALOG', parse: catalogUrl, group: 'cluster (a broker behind gateways)' },
  'broker-id': { arg: 'ID', help: "this broker's stable id (default: the host name; its sessions live on this node)", group: 'cluster (a broker behind gateways)' },
  'advertise-url': { arg: 'U', help: 'where gateways reach this broker (default ws://<host name>:<port>)', parse: wsUrl, group: 'cluster (a broker behind gateways)' },
  'lease-ms': { arg: 'N', help: 'registration lease, renewed every third of it (default 10000)', parse: int(1), group: 'cluster (a broker behind gateways)' },
  'advertise-template': { arg: 'T', help: 'a template this broker can create sessions from (repeatable)', multiple: true, group: 'cluster (a broker behind gateways)' },
  'gateway-token-file': { ...CREDENTIAL['gateway-token-file'], help: 'the gateway credential (env HUTCH_GATEWAY_TOKEN): required with --catalog', group: 'cluster (a broker behind gateways)' },
} satisfies Record<string, OptionSpec>;

type ClusterValues = { catalog?: string | undefined; 'broker-id'?: string | undefined; 'advertise-url'?: string | undefined; 'lease-ms'?: number | undefined; 'advertise-template'?: string[]; 'gateway-token-file'?: string | undefined };

/** The gateway credential, checked (at least 32 characters, no tenant's token). */
function gatewayCredential(v: { 'gateway-token-file'?: string | undefined }, tenantTokens: Record<string, string>, env: NodeJS.ProcessEnv = process.env): string | undefined {
  const source = v['gateway-token-file'] !== undefined ? '--gateway-token-file' : 'HUTCH_GATEWAY_TOKEN';
  const token = v['gateway-token-file']?.trim() ?? env['HUTCH_GATEWAY_TOKEN'];
  if (!token) return undefined;
  try {
    new GatewayCredential(token);
  } catch (err) {
    throw new UsageError(`${source}: ${(err as Error).message}`, source);
  }
  if (Object.values(tenantTokens).includes(token)) throw new UsageError(`${source}: the gateway credential must differ from every tenant token`, source);
  return token;
}

/** The broker's cluster options (undefined: a standalone broker). */
export function clusterFromFlags(v: ClusterValues, tenantTokens: Record<string, string>): { cluster?: ClusterOptions } {
  if (!v.catalog) return {};
  const gatewayToken = gatewayCredential(v, tenantTokens);
  if (!gatewayToken) throw new UsageError('a cluster member needs the gateway credential: --gateway-token-file F or env HUTCH_GATEWAY_TOKEN', '--catalog');
  return {
    cluster: {
      catalogUrl: v.catalog,
      gatewayToken,
      ...(v['broker-id'] ? { brokerId: v['broker-id'] } : {}),
      ...(v['advertise-url'] ? { advertiseUrl: v['advertise-url'] } : {}),
      ...(v['lease-ms'] !== undefined ? { leaseMs: v['lease-ms'] } : {}),
      ...(v['advertise-template']?.length ? { templates: v['advertise-template'] } : {}),
    },
  };
}

export const GATEWAY = new Command({
  name: 'hutch gateway',
  summary: 'One endpoint in front of many brokers: routes each session to its broker, places new ones, checks tokens.',
  options: {
    port: { arg: 'N', help: 'TCP port (default 7080; 0 picks a free one)', default: '7080', parse: port },
    host: { arg: 'ADDR', help: 'listen address (default 127.0.0.1)', default: '127.0.0.1' },
    ...TOKEN_OPTIONS,
    catalog: { arg: 'URL', help: 'the catalog, redis://HOST:PORT or rediss://HOST:PORT (TLS) (env HUTCH_CATALOG)', env: 'HUTCH_CATALOG', parse: catalogUrl },
    ...CREDENTIAL,
    sample: { arg: 'K', help: 'brokers sampled per placement (default 2)', parse: int(1, 64) },
    'metrics-port': { arg: 'N', help: 'also serve /metrics without a token on this port', parse: port },
    'metrics-host': { arg: 'A', help: 'address for --metrics-port (default 127.0.0.1)', default: '127.0.0.1' },
    'drain-ms': { arg: 'N', help: 'on SIGTERM, /readyz answers 503 and calls in flight get this long (default 10000)', default: '10000', parse: int(1) },
    'fan-out-ms': { arg: 'N', help: 'what each broker gets to answer a request asked of all (sessions, the E2B list, a signal\npassed on) before the answer goes without it, naming it in `unavailable` (default 5000)', parse: int(1) },
    'max-connections': { arg: 'N', help: 'open WebSockets per principal (default 32)', parse: int(1) },
    'max-frame-mib': { arg: 'N', help: 'largest WebSocket message, MiB (default 64)', parse: int(1, 1024) },
    'log-level': { arg: 'L', help: 'debug | info | warn | error (default info)', env: 'HUTCH_LOG_LEVEL', parse: logLevel },
    'ready-json': { help: 'print one JSON line {"url","port",...} on stdout when listening' },
    ...MCP_HTTP_OPTIONS,
  },
});

export async function gatewayMain(args: string[]): Promise<void> {
  const parsed = GATEWAY.parse(args);
  if (!parsed) return;
  const v = parsed.values;
  const { tokens } = tokensFrom(v);
  if (Object.keys(tokens).length === 0) throw new UsageError('hutch gateway needs tenant tokens: --token-file F, --tokens-file F or env HUTCH_TOKEN', '--tokens-file');
  if (!v.catalog) throw new UsageError('hutch gateway needs --catalog redis://HOST:PORT (or env HUTCH_CATALOG)', '--catalog');
  const credential = gatewayCredential(v, tokens);
  if (!credential) throw new UsageError('hutch gateway needs the gateway credential: --gateway-token-file F or env HUTCH_GATEWAY_TOKEN', '--gateway-token-file');
  if (v['metrics-port'] !== undefined && v['metrics-port'] !== 0 && v['metrics-port'] === v.port) throw new UsageError(`--metrics-port ${v['metrics-port']} is --port too: give it a port of its own`, '--metrics-port');

  const [{ createLogger }, { Principals }, { Gateway }] = await Promise.all([import('../../../guest-agent/src/log.ts'), import('../api/principals.ts'), import('./gateway.ts')]);
  const log = createLogger({ name: 'hutch-gateway', level: v['log-level'] ?? 'info' });
  const gw = new Gateway({
    port: v.port,
    host: v.host,
    principals: new Principals(tokens),
    catalogUrl: v.catalog,
    credential,
    log,
    ...(v.sample !== undefined ? { sampleK: v.sample } : {}),
    ...(v['fan-out-ms'] !== undefined ? { fanOutMs: v['fan-out-ms'] } : {}),
    ...mcpHttpFrom(v),
    ...(v['metrics-port'] !== undefined ? { metricsListen: { host: v['metrics-host'], port: v['metrics-port'] } } : {}),
    limits: {
      ...(v['max-frame-mib'] !== undefined ? { maxPayloadBytes: v['max-frame-mib'] * 1024 * 1024 } : {}),
      ...(v['max-connections'] !== undefined ? { maxConnectionsPerPrincipal: v['max-connections'] } : {}),
    },
  });
  await gw.start();
  const url = `ws://${v.host}:${gw.port}`;
  const ready = `${JSON.stringify({ url, port: gw.port, host: v.host, ...(gw.metricsPort ? { metricsPort: gw.metricsPort } : {}) })}\n`;
  process.stdout.write(v['ready-json'] ? ready : `hutch gateway on ${url}  catalog ${v.catalog}\n`);
  let stopping = false;
  const stop = async (sig: string) => {
    if (stopping) return;
    stopping = true;
    log.info('gateway.signal', { signal: sig });
    if (sig === 'SIGTERM') await gw.drain(v['drain-ms']);
    await gw.stop();
    process.exit(0);
  };
  process.on('SIGINT', () => void stop('SIGINT'));
  process.on('SIGTERM', () => void stop('SIGTERM'));
}
