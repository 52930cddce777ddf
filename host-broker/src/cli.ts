#!/usr/bin/env node
/**
 * hutch's command line: `hutch <command> [options]`. Each command's options are checked
 * (and its help printed) before any of its modules load, so `--help`, `--version` and a
 * mistyped option answer at once. Exit status: 0, 1 for a failure, 2 for a command line the
 * command cannot run with.
 */
import { readFileSync, realpathSync } from 'node:fs';
import { UsageError } from '../../guest-agent/src/cli-options.ts';
import { runMain } from './cli/terminal.ts';
import type { Broker } from './broker.ts';
import type { ServeOptions } from './serve.ts';

export { policyFromFlags, slotDiskFromFlags } from './cli/serve-command.ts';
export type { ServeOptions };

/** A broker on the embedded defaults (serve.ts), loaded on first use: the CLI's help and option checks load none of it. */
export async function serve(o: ServeOptions): Promise<Broker> {
  return (await import('./serve.ts')).serve(o);
}

/** The package's version (package.json, one level above dist/ in the package). */
export const VERSION = (JSON.parse(readFileSync(new URL('../../package.json', import.meta.url), 'utf8')) as { version: string }).version;

const COMMANDS: Record<string, { summary: string; main: (args: string[]) => Promise<void> }> = {
  serve: { summary: 'run the broker (WebSocket API for harnesses, MCP at /mcp, E2B at /e2b)', main: async (a) => (await import('./cli/serve-command.ts')).serveMain(a) },
  gateway: { summary: 'one endpoint in front of many brokers (routes by session, places new ones)', main: async (a) => (await import('./gateway/cli.ts')).gatewayMain(a) },
  mcp: { summary: "MCP server on stdio for a local agent (a broker's sandboxes as MCP tools)", main: async (a) => (await import('./mcp/cli.ts')).mcpMain(a) },
  template: { summary: 'build | ls | inspect | rm | prune templates: root filesystems a session boots', main: async (a) => (await import('./templates/cli.ts')).templateMain(a) },
  setup: { summary: 'install the Debian packages hutch uses, then build (or find cached) the guest image', main: async (a) => (await import('./cli/setup-command.ts')).setupMain(a) },
  prepare: { summary: "build (or find cached) the guest image alone (a container's init step)", main: async (a) => (await import('./cli/setup-command.ts')).prepareMain(a) },
};

const HELP = `usage: hutch <command> [options]

hutch: sandboxes for AI agents, packed densely on one host.

commands:
${Object.entries(COMMANDS)
  .map(([name, c]) => `  ${name.padEnd(10)}${c.summary}`)
  .join('\n')}

  hutch <command> --help    that command's options
  hutch --version           the version (${VERSION})
`;

async function main(): Promise<void> {
  const [cmd, ...rest] = process.argv.slice(2);
  if (cmd === undefined || cmd === '-h' || cmd === '--help' || cmd === 'help') {
    process.stdout.write(HELP);
    return;
  }
  if (cmd === '-V' || cmd === '--version' || cmd === 'version') {
    process.stdout.write(`${VERSION}\n`);
    return;
  }
  const c = Object.hasOwn(COMMANDS, cmd) ? COMMANDS[cmd] : undefined;
  if (!c) throw new UsageError(`unknown command ${JSON.stringify(cmd)}: one of ${Object.keys(COMMANDS).join(', ')} (see hutch --help)`);
  await c.main(rest);
}

// Run when executed, not when imported (tests import policyFromFlags): as
// host-broker/src/cli.ts under tsx, or as the package's bin (a symlink to dist/cli.js).
function invokedPath(): string {
  try {
    return realpathSync(process.argv[1] ?? '');
  } catch {
    return '';
  }
}
if (/cli\.(ts|js|mjs)$/.test(invokedPath())) runMain('hutch', main);
