/**
 * `hutch mcp`: the MCP server on stdio, for an agent that starts it as a child process.
 *
 * With --url/--token (or HUTCH_URL/HUTCH_TOKEN) it speaks to that broker. With neither it
 * runs its own broker in this process (the embedded defaults: the qemu backend) on a free
 * loopback port with a random token, and stops it on exit. stdout carries the MCP stream
 * and nothing else: every log line goes to stderr.
 */
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { StdioServerTransport } from '@modelcontextprotocol/sdk/server/stdio.js';
import { createLogger, parseLogLevel, type Logger } from '../../../guest-agent/src/log.ts';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Broker } from '../broker.ts';
import type { SandboxPolicy } from '../policy/sandbox-policy.ts';
import { Hutch } from '../sdk/index.ts';
import { UNSAFE_LOCAL_ACK_FLAG } from '../backends/registry.ts';
import { loopbackUrl } from './http.ts';
import { createMcpServer, HutchLink } from './server.ts';

export const MCP_HELP = `mcp options (hutch mcp: an MCP server on stdin/stdout for a local agent):
  --url URL         a running broker (ws://HOST:PORT) to use (default: env HUTCH_URL); with no URL,
                    hutch mcp starts its own broker on a free loopback port and stops it on exit
  --token T         that broker's token (default: env HUTCH_TOKEN); required with --url
  own broker only:
  --backend B       as for serve (default qemu); ${UNSAFE_LOCAL_ACK_FLAG} as for serve
  --data-dir D      sessions and workspaces (default: a fresh temporary directory, removed on exit)
  --level L         policy preset, as for serve (default 4)
  --no-build        use the cached guest image only
  --log-level L     debug | info | warn | error (default warn; logs go to stderr)
`;

/** What the CLI lends this command (passed in, so cli.ts and this module do not import each other). */
export interface McpDeps {
  serve(o: {
    port: number;
    host: string;
    token: string;
    dataDir: string;
    backend?: string;
    acknowledgeUnsafeLocal?: boolean;
    policy?: Partial<SandboxPolicy>;
    policyLevel?: string;
    noBuild?: boolean;
    log: Logger;
  }): Promise<Broker>;
  policyFromFlags(level: string | undefined, idleMs: string | undefined, idlePolicy: string | undefined): SandboxPolicy;
}

export async function mcpMain(args: string[], deps: McpDeps): Promise<void> {
  const { values } = parseArgs({
    args,
    options: {
      url: { type: 'string' },
      token: { type: 'string' },
      backend: { type: 'string' },
      'i-know-unsafe-local': { type: 'boolean' },
      'data-dir': { type: 'string' },
      level: { type: 'string' },
      'no-build': { type: 'boolean', default: false },
      'log-level': { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  });
  if (values.help) {
    // Help is asked by a person, not an MCP client: stdout is fine here.
    process.stdout.write(MCP_HELP);
    return;
  }
  const log = createLogger({ name: 'hutch-mcp', level: parseLogLevel(values['log-level'] ?? process.env['HUTCH_LOG_LEVEL'] ?? 'warn') });
  const givenUrl = values.url ?? process.env['HUTCH_URL'];
  if (values.token !== undefined && givenUrl === undefined) throw new HutchError('bad_request', '--token goes with --url (or HUTCH_URL): without a URL hutch mcp runs its own broker with its own token');
  const ownOnly = ['backend', 'i-know-unsafe-local', 'data-dir', 'level'] as const;
  if (givenUrl !== undefined) {
    const stray = ownOnly.filter((k) => values[k] !== undefined);
    if (stray.length) throw new HutchError('bad_request', `--${stray.join(', --')} configure hutch mcp's own broker; with --url the broker is already running`);
  }

  let broker: Broker | undefined;
  let tempDir: string | undefined;
  let url: string;
  let token: string;
  if (givenUrl !== undefined) {
    const t = values.token ?? process.env['HUTCH_TOKEN'];
    if (t === undefined) throw new HutchError('unauthorized', `--url ${givenUrl} needs --token (or HUTCH_TOKEN)`);
    url = givenUrl;
    token = t;
  } else {
    if (values['i-know-unsafe-local'] && values.backend !== 'unsafe-local') throw new HutchError('bad_request', `${UNSAFE_LOCAL_ACK_FLAG} goes with --backend unsafe-local`);
    // Never on argv or in a file: this process is the only client of its broker.
    token = randomBytes(24).toString('hex');
    const dataDir = values['data-dir'] ?? (tempDir = mkdtempSync(join(tmpdir(), 'hutch-mcp-')));
    broker = await deps.serve({
      port: 0,
      host: '127.0.0.1',
      token,
      dataDir,
      ...(values.backend ? { backend: values.backend } : {}),
      ...(values['i-know-unsafe-local'] ? { acknowledgeUnsafeLocal: true } : {}),
      policyLevel: values.level ?? '4',
      policy: deps.policyFromFlags(values.level, undefined, undefined),
      ...(values['no-build'] ? { noBuild: true } : {}),
      log: log.child({ component: 'broker' }),
    });
    url = loopbackUrl('127.0.0.1', broker.port);
  }

  const link = new HutchLink(() => Hutch.connect(url, { token }));
  let stopping = false;
  const stop = async (why: string): Promise<void> => {
    // Set before anything else: closing the server closes the transport, whose onclose calls here again.
    if (stopping) return;
    stopping = true;
    log.info('mcp.stopping', { why });
    await server.close().catch(() => undefined);
    await link.close();
    await broker?.stop().catch((err: unknown) => log.error('mcp.broker_stop_failed', { error: (err as Error).message }));
    if (tempDir) rmSync(tempDir, { recursive: true, force: true });
    process.exit(0);
  };

  try {
    // Fail now, on stderr, rather than on the agent's first tool call: a wrong URL or token is a setup error.
    const h = await link.hutch();
    log.info('mcp.connected', { url, backend: h.backend, principal: h.hello.principal, ownBroker: broker !== undefined });
  } catch (err) {
    await broker?.stop().catch(() => undefined);
    if (tempDir) rmSync(tempDir, { recursive: true, force: true });
    throw err;
  }

  const server = createMcpServer(link);
  const transport = new StdioServerTransport();
  transport.onclose = () => void stop('transport closed');
  await server.connect(transport);
  // The client closing our stdin is how a stdio MCP session ends.
  process.stdin.once('end', () => void stop('stdin closed'));
  process.stdin.once('close', () => void stop('stdin closed'));
  process.on('SIGINT', () => void stop('SIGINT'));
  process.on('SIGTERM', () => void stop('SIGTERM'));
}
