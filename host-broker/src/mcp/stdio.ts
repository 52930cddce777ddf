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
import { StdioServerTransport } from '@modelcontextprotocol/sdk/server/stdio.js';
import { createLogger, type LogLevel } from '../../../guest-agent/src/log.ts';
import type { Broker } from '../broker.ts';
import { policyFromFlags } from '../cli/serve-command.ts';
import { serve } from '../serve.ts';
import { Hutch } from '../sdk/index.ts';
import { loopbackUrl } from './http.ts';
import { createMcpServer, HutchLink } from './server.ts';

/** What `hutch mcp` was told, its options checked (mcp/cli.ts). */
export interface McpRun {
  /** A running broker and its token; without one, hutch mcp runs its own. */
  remote?: { url: string; token: string };
  own: { backend?: string; acknowledgeUnsafeLocal?: boolean; dataDir?: string; level?: string; noBuild?: boolean };
  logLevel: LogLevel;
}

export async function runMcp(o: McpRun): Promise<void> {
  const log = createLogger({ name: 'hutch-mcp', level: o.logLevel });
  let broker: Broker | undefined;
  let tempDir: string | undefined;
  let url: string;
  let token: string;
  if (o.remote) {
    url = o.remote.url;
    token = o.remote.token;
  } else {
    // Never on argv or in a file: this process is the only client of its broker.
    token = randomBytes(24).toString('hex');
    const dataDir = o.own.dataDir ?? (tempDir = mkdtempSync(join(tmpdir(), 'hutch-mcp-')));
    broker = await serve({
      port: 0,
      host: '127.0.0.1',
      token,
      dataDir,
      ...(o.own.backend ? { backend: o.own.backend } : {}),
      ...(o.own.acknowledgeUnsafeLocal ? { acknowledgeUnsafeLocal: true } : {}),
      policyLevel: o.own.level ?? '4',
      policy: policyFromFlags(o.own.level, undefined, undefined),
      ...(o.own.noBuild ? { noBuild: true } : {}),
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
