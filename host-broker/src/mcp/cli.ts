/**
 * `hutch mcp`'s options, checked before the MCP server and a broker are loaded (stdio.ts).
 * Help is asked by a person, not an MCP client: it goes to stdout like every command's.
 */
import { Command, fileText, logLevel, oneOf, UsageError, writableDir } from '../../../guest-agent/src/cli-options.ts';
import { BACKEND_NAMES, UNSAFE_LOCAL_ACK_FLAG } from '../backends/names.ts';
import { LEVEL_NAMES } from '../policy/sandbox-policy.ts';
import { installPackagesForClone } from '../cli/host-packages.ts';

function brokerUrl(text: string, option: string): string {
  if (!/^wss?:\/\/[^/]+/.test(text)) throw new UsageError(`${option} must be a broker's ws://HOST:PORT (or wss://), got ${JSON.stringify(text)}`, option);
  return text;
}

const OWN = "hutch mcp's own broker";

export const MCP = new Command({
  name: 'hutch mcp',
  summary: "An MCP server on stdin/stdout for a local agent: a broker's sandboxes as MCP tools. With no --url it runs\nits own broker (the qemu backend, a free loopback port) and stops it on exit. Logs go to stderr.",
  options: {
    url: { arg: 'URL', help: 'a running broker, ws://HOST:PORT (env HUTCH_URL)', env: 'HUTCH_URL', parse: brokerUrl },
    token: { arg: 'T', help: "that broker's token (env HUTCH_TOKEN; visible in ps: prefer --token-file)" },
    'token-file': { arg: 'F', help: "read that broker's token from file F", parse: fileText },
    backend: { arg: 'B', help: `${BACKEND_NAMES.join(' | ')} (default qemu)`, parse: oneOf(BACKEND_NAMES), group: OWN },
    'i-know-unsafe-local': { help: 'required with --backend unsafe-local (tenants share the host kernel)', group: OWN },
    'data-dir': { arg: 'D', help: 'sessions and workspaces (default: a temporary directory, removed on exit)', parse: writableDir, group: OWN },
    level: { arg: 'L', help: `policy preset: ${LEVEL_NAMES.join(' | ')} (default 4)`, parse: oneOf(LEVEL_NAMES), group: OWN },
    'no-build': { help: 'use the cached guest image only', group: OWN },
    'log-level': { arg: 'L', help: 'debug | info | warn | error (default warn; env HUTCH_LOG_LEVEL)', env: 'HUTCH_LOG_LEVEL', parse: logLevel },
  },
});

export async function mcpMain(args: string[]): Promise<void> {
  const p = MCP.parse(args);
  if (!p) return;
  const v = p.values;
  if (v.token !== undefined && v['token-file'] !== undefined) throw new UsageError('give --token or --token-file, not both', '--token-file');
  const ownOnly = (['backend', 'i-know-unsafe-local', 'data-dir', 'level', 'no-build'] as const).filter((k) => v[k] !== undefined && v[k] !== false);
  let remote: { url: string; token: string } | undefined;
  if (v.url !== undefined) {
    if (ownOnly.length) throw new UsageError(`--${ownOnly.join(', --')} configure ${OWN}; with --url the broker is already running`, `--${ownOnly[0]}`);
    const token = v.token ?? v['token-file'] ?? process.env['HUTCH_TOKEN'];
    if (!token) throw new UsageError(`--url ${v.url} needs that broker's token: --token-file F or env HUTCH_TOKEN`, '--token-file');
    remote = { url: v.url, token };
  } else {
    if (v.token !== undefined || v['token-file'] !== undefined) throw new UsageError('--token goes with --url (or HUTCH_URL): without a URL hutch mcp runs its own broker with its own token', v.token !== undefined ? '--token' : '--token-file');
    if (v['i-know-unsafe-local'] && v.backend !== 'unsafe-local') throw new UsageError(`${UNSAFE_LOCAL_ACK_FLAG} goes with --backend unsafe-local`, UNSAFE_LOCAL_ACK_FLAG);
    // stdout is the MCP stream: what installing packages says goes to stderr (installPackagesForClone's default).
    await installPackagesForClone();
  }
  const { runMcp } = await import('./stdio.ts');
  await runMcp({
    ...(remote ? { remote } : {}),
    own: {
      ...(v.backend ? { backend: v.backend } : {}),
      ...(v['i-know-unsafe-local'] ? { acknowledgeUnsafeLocal: true } : {}),
      ...(v['data-dir'] ? { dataDir: v['data-dir'] } : {}),
      ...(v.level ? { level: v.level } : {}),
      ...(v['no-build'] ? { noBuild: true } : {}),
    },
    logLevel: v['log-level'] ?? 'warn',
  });
}
