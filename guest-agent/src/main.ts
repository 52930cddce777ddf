#!/usr/bin/env node
import { userInfo } from 'node:os';
import { Agent } from './agent-server.ts';
import { probeCapabilities } from './capabilities.ts';
import { Command, int, isUsageError, logLevel, UsageError } from './cli-options.ts';
import { findVirtioPort, listenUnix, listenVsock, openVirtioPort, parseListenSpec, type Listener, type ListenSpec } from './listen.ts';
import { createLogger } from './log.ts';
import { HutchError } from './protocol/errors.ts';
import { PROTOCOL_VERSION } from './protocol/version.ts';
import { guestNetworkEnv } from './net/tenant-env.ts';
import { GUEST_PROXY_PORT } from './protocol/methods-net.ts';

/** `--env KEY=VALUE`: a malformed one is a startup error, never silently dropped. */
function envPair(text: string, option: string): [string, string] {
  const i = text.indexOf('=');
  if (i <= 0 || !/^[A-Za-z_][A-Za-z0-9_]*$/.test(text.slice(0, i))) throw new UsageError(`${option} expects KEY=VALUE, got ${JSON.stringify(text)}`, option);
  return [text.slice(0, i), text.slice(i + 1)];
}

function runAs(text: string, option: string): { uid: number; gid: number } {
  const m = /^(\d+):(\d+)$/.exec(text);
  if (!m) throw new UsageError(`${option} expects UID:GID, got ${JSON.stringify(text)}`, option);
  return { uid: Number(m[1]), gid: Number(m[2]) };
}

const AGENT = new Command({
  name: 'hutch-agent',
  usage: '--listen SPEC [--listen SPEC ...] [options]',
  summary: `Serves exec, file tools and workspace sync to the hutch broker (protocol v${PROTOCOL_VERSION}).`,
  options: {
    listen: { arg: 'SPEC', help: 'unix:PATH | vport:NAME | vsock:PORT (repeatable; at least one)', multiple: true, parse: (t: string) => parseListenSpec(t) },
    root: { arg: 'DIR', help: 'workspace root (default /work)', default: '/work' },
    'mount-point': { arg: 'DIR', help: 'where tenants see the workspace (default /work)', default: '/work' },
    'run-as': { arg: 'UID:GID', help: "identity for tenant commands and created files (default: the agent's own)", parse: runAs },
    home: { arg: 'DIR', help: "HOME for tenant commands (default: /home/tenant with --run-as, else the agent's)" },
    'timeout-ms': { arg: 'N', help: 'default exec timeout (default 600000)', default: '600000', parse: int(1) },
    'max-output': { arg: 'N', help: 'default bytes kept per output stream (default 16777216)', default: String(16 * 1024 * 1024), parse: int(1) },
    'kill-on-exit': { help: 'kill what a command leaves running when it exits (an agent on a host, not in a VM)' },
    guest: { help: 'this agent owns its machine (a VM): it may set the clock and manage memory' },
    'overlay-upper': { arg: 'DIR', help: "the root overlay's upper directory (dirtiness: writes outside /work, /tmp)" },
    'workload-cgroup': { arg: 'D', help: 'cgroup v2 directory tenant commands run in' },
    env: { arg: 'KEY=VALUE', help: "extra environment for tenant commands (repeatable; a template's --env)", multiple: true, parse: envPair },
    'proxy-port': { arg: 'N', help: `serve the sandbox network's proxy on 127.0.0.1:N (default ${GUEST_PROXY_PORT} with --guest)`, parse: int(1, 65535) },
    'log-level': { arg: 'L', help: 'debug | info | warn | error (default info; env HUTCH_LOG_LEVEL)', env: 'HUTCH_LOG_LEVEL', parse: logLevel },
  },
});

async function main(): Promise<void> {
  const parsed = AGENT.parse(process.argv.slice(2));
  if (!parsed) return;
  const values = parsed.values;
  const log = createLogger({ name: 'hutch-agent', level: values['log-level'] ?? 'info' });
  const specs = values.listen;
  if (specs.length === 0) throw new UsageError('at least one --listen is required (see --help)', '--listen');
  const uid = values['run-as']?.uid;
  const gid = values['run-as']?.gid;
  // The sandbox network's proxy port on loopback: always in a VM, elsewhere only when asked (tests).
  const proxyPort = values['proxy-port'] ?? (values.guest ? GUEST_PROXY_PORT : undefined);
  const home = values.home ?? (uid === undefined ? userInfo().homedir : uid === 0 ? '/root' : '/home/tenant');
  const agent = new Agent({
    root: values.root,
    mountPoint: values['mount-point'],
    owner: uid !== undefined && gid !== undefined ? { uid, gid } : undefined,
    exec: {
      baseEnv: {
        PATH: '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin',
        HOME: home,
        LANG: 'C.UTF-8',
        TERM: 'dumb',
        // In a VM the network is the agent's proxy port (net/tunnels.ts); a template's --env may override.
        ...(proxyPort !== undefined ? guestNetworkEnv(proxyPort) : {}),
        ...Object.fromEntries(values.env),
      },
      uid,
      gid,
      defaultTimeoutMs: values['timeout-ms'],
      defaultMaxOutputBytes: values['max-output'],
      killGroupOnExit: values['kill-on-exit'],
    },
    caps: probeCapabilities(),
    ownsMachine: values.guest,
    overlayUpper: values['overlay-upper'],
    workloadCgroup: values['workload-cgroup'],
    log,
  });

  // Listening before the ready line, so the pristine snapshot holds the port open.
  if (proxyPort !== undefined) await agent.net.listen(proxyPort);
  const listeners: Listener[] = [];
  for (const spec of specs) listeners.push(await listen(agent, spec, log));
  log.info('agent.listening', { listen: specs, root: agent.ws.root, pid: process.pid });

  const stop = async (sig: string) => {
    log.info('agent.stopping', { signal: sig });
    await Promise.all(listeners.map((l) => l.close()));
    process.exit(0);
  };
  process.once('SIGTERM', () => void stop('SIGTERM'));
  process.once('SIGINT', () => void stop('SIGINT'));
}

async function listen(agent: Agent, spec: ListenSpec, log: ReturnType<typeof createLogger>): Promise<Listener> {
  switch (spec.kind) {
    case 'unix':
      return listenUnix(spec.path, (s) => agent.serve(s));
    case 'vsock':
      return listenVsock(spec.port, `/run/hutch-agent-vsock-${spec.port}.sock`, (s) => agent.serve(s), log);
    case 'vport': {
      // One broker per port; when it goes away (host side closed), reopen and wait for the next.
      let stopped = false;
      const loop = async () => {
        while (!stopped) {
          const dev = findVirtioPort(spec.name);
          const port = await openVirtioPort(dev);
          const conn = agent.serve(port, { channel: true });
          await conn.closed;
          // However the session ended (detach, a fatal frame, the host leaving), the port's
          // fd must be closed before it is opened again: end() alone leaves a character
          // device open, and the next open() then fails with EBUSY until the agent gives up.
          port.destroy();
          await new Promise((r) => setTimeout(r, 50));
        }
      };
      void loop().catch((err: unknown) => {
        log.error('agent.vport_failed', { error: (err as Error).message });
        process.exit(1);
      });
      return { close: async () => void (stopped = true) };
    }
  }
}

main().catch((err: unknown) => {
  const e = err instanceof HutchError ? err : new HutchError('internal', (err as Error).message);
  process.stderr.write(JSON.stringify({ level: 'error', name: 'hutch-agent', msg: 'agent.fatal', code: e.code, error: e.message }) + '\n');
  // 2: the command line was wrong; 1: the agent failed.
  process.exit(isUsageError(err) ? 2 : 1);
});
