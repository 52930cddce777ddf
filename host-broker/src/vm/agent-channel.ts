import { connect } from 'node:net';
import { randomBytes } from 'node:crypto';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import { AgentClient } from '../agent-client.ts';
import type { Vm } from './vmm.ts';
import { connectVsockAgent } from './vsock.ts';

/**
 * Connects the broker to the agent inside a VM through QEMU's chardev socket. The agent
 * answers our hello once it is up (after a cold boot) or at once (after a restore, where
 * it starts a new session on its open port). A VM that dies first fails the wait.
 */
export async function connectAgent(vm: Vm, opts: { timeoutMs: number; log: Logger; resume?: boolean }): Promise<AgentClient> {
  if (vm.spec.channel?.kind === 'vsock') return connectVsockAgent(vm, opts);
  const sock = connect(vm.channelPath);
  await new Promise<void>((resolve, reject) => {
    sock.once('connect', resolve);
    sock.once('error', (e) => reject(new HutchError('unavailable', `agent channel ${vm.channelPath}: ${e.message}`)));
  });
  const client = new AgentClient(sock, { log: opts.log.child({ vm: vm.spec.id }), handshakeTimeoutMs: opts.timeoutMs, resendHelloMs: 500 });
  const died = vm.exited.then((e) => {
    throw new HutchError('guest_crashed', `VM ${vm.spec.id} exited (${e.code ?? e.signal}) before its agent answered; console: ${e.console.slice(-5).join(' | ')}`);
  });
  try {
    await Promise.race([client.ready(), died]);
  } catch (err) {
    client.close();
    throw err;
  }
  died.catch(() => undefined);
  if (opts.resume) await client.call('agent.resume', { unixTimeMs: Date.now(), entropy: randomBytes(64) });
  return client;
}
