#!/usr/bin/env node
import { parseArgs } from 'node:util';
import { userInfo } from 'node:os';
import { Agent } from './agent-server.ts';
import { probeCapabilities } from './capabilities.ts';
import { findVirtioPort, listenUnix, listenVsock, openVirtioPort, parseListenSpec, type Listener, type ListenSpec } from './listen.ts';
import { createLogger, parseLogLevel } from './log.ts';
import { HutchError } from './protocol/errors.ts';
import { PROTOCOL_VERSION } from './protocol/version.ts';

const HELP = `hutch-agent: serves exec, file tools and workspace sync to the hutch broker

usage: hutch-agent --listen SPEC [--listen SPEC ...] [options]

  --listen SPEC       unix:PATH | vport:NAME | vsock:PORT (repeatable)
  --root DIR          workspace root (default /work)
  --mount-point DIR   where tenants see the workspace (default /work)
  --run-as UID:GID    identity for tenant commands and created files (default: the agent's own)
  --home DIR          HOME for tenant commands (default: /home/tenant for --run-as, else the agent's)
  --timeout-ms N      default exec timeout (default 600000)
  --max-output N      default bytes kept per output stream (default 16777216)
  --kill-on-exit      kill what a command leaves running when it exits (use when the agent
                      runs on a host rather than in a VM)
  --guest             this agent owns its machine (a VM): it may set the clock after a
                      snapshot restore and manage the guest's memory
  --overlay-upper DIR the root overlay's upper directory (dirtiness: writes outside /work, /tmp)
  --workload-cgroup D cgroup v2 directory tenant commands run in
  --env KEY=VALUE     extra environment for tenant commands (repeatable; a template's --env)
  --log-level L       debug | info | warn | error (default info; env HUTCH_LOG_LEVEL)
  -h, --help          this text

protocol v${PROTOCOL_VERSION}`;

/** `--env KEY=VALUE` pairs; a malformed one is a startup error, never silently dropped. */
function tenantEnv(pairs: string[]): Record<string, string> {
  const out: Record<string, string> = {};
  for (const p of pairs) {
    const i = p.indexOf('=');
    if (i <= 0 || !/^[A-Za-z_][A-Za-z0-9_]*$/.test(p.slice(0, i))) throw new HutchError('bad_request', `--env expects KEY=VALUE, got ${JSON.stringify(p)}`);
    out[p.slice(0, i)] = p.slice(i + 1);
  }
  return out;
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      listen: { type: 'string', multiple: true },
      root: { type: 'string', default: '/work' },
      'mount-point': { type: 'string', default: '/work' },
      'run-as': { type: 'string' },
      home: { type: 'string' },
      'timeout-ms': { type: 'string', default: '600000' },
      'max-output': { type: 'string', default: String(16 * 1024 * 1024) },
      'log-level': { type: 'string' },
      'kill-on-exit': { type: 'boolean', default: false },
      guest: { type: 'boolean', default: false },
      'overlay-upper': { type: 'string' },
      'workload-cgroup': { type: 'string' },
      env: { type: 'string', multiple: true },
      help: { type: 'boolean', short: 'h' },
    },
  });
  if (values.help) {
    process.stdout.write(HELP + '\n');
    return;
  }
  const log = createLogger({ name: 'hutch-agent', level: parseLogLevel(values['log-level'] ?? process.env['HUTCH_LOG_LEVEL']) });
  const specs = (values.listen ?? []).map(parseListenSpec);
  if (specs.length === 0) throw new HutchError('bad_request', 'at least one --listen is required (see --help)');

  let uid: number | undefined;
  let gid: number | undefined;
  if (values['run-as']) {
    const m = /^(\d+):(\d+)$/.exec(values['run-as']);
    if (!m) throw new HutchError('bad_request', `--run-as expects UID:GID, got ${values['run-as']}`);
    uid = Number(m[1]);
    gid = Number(m[2]);
  }
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
        ...tenantEnv(values.env ?? []),
      },
      uid,
      gid,
      defaultTimeoutMs: Number(values['timeout-ms']),
      defaultMaxOutputBytes: Number(values['max-output']),
      killGroupOnExit: values['kill-on-exit'],
    },
    caps: probeCapabilities(),
    ownsMachine: values.guest,
    overlayUpper: values['overlay-upper'],
    workloadCgroup: values['workload-cgroup'],
    log,
  });

  const listeners: Listener[] = [];
  for (const spec of specs) listeners.push(await listen(agent, spec, log));
  log.info('agent.listening', { listen: values.listen, root: agent.ws.root, pid: process.pid });

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
  process.exit(2);
});
