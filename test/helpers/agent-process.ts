import { spawn, type ChildProcess } from 'node:child_process';
import { chmodSync, chownSync, mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { waitForSocket } from '../../host-broker/src/util/wait-for-socket.ts';
import { AGENT_BUNDLE } from '../../guest-agent/build.ts';
import { AgentClient, type AgentClientOptions } from '../../host-broker/src/agent-client.ts';

export interface AgentProcess {
  dir: string;
  root: string;
  socket: string;
  proc: ChildProcess;
  client: AgentClient;
  stderr: () => string;
  stop(): Promise<void>;
}

/** Starts the real agent bundle as a separate process on a Unix socket, with a fresh workspace. */
export async function startAgent(opts: { args?: string[]; client?: AgentClientOptions; owner?: number } = {}): Promise<AgentProcess> {
  const dir = mkdtempSync(join(tmpdir(), 'hutch-agent-test-'));
  chmodSync(dir, 0o755);
  const root = join(dir, 'work');
  mkdirSync(root);
  if (opts.owner !== undefined) chownSync(root, opts.owner, opts.owner);
  const socket = join(dir, 'agent.sock');
  const proc = spawn(process.execPath, [AGENT_BUNDLE, '--listen', `unix:${socket}`, '--root', root, '--log-level', 'warn', '--kill-on-exit', ...(opts.args ?? [])], {
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  let err = '';
  proc.stderr?.on('data', (d: Buffer) => (err += d.toString()));
  await waitForSocket(socket, { proc });
  const client = await AgentClient.connectUnix(socket, opts.client);
  return {
    dir,
    root,
    socket,
    proc,
    client,
    stderr: () => err,
    async stop() {
      client.close();
      if (proc.exitCode === null && proc.signalCode === null) {
        proc.kill('SIGTERM');
        await new Promise((r) => proc.once('exit', r));
      }
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

