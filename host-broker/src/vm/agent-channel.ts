import { connect } from 'node:net';
import { randomBytes } from 'node:crypto';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import type { ResultOf } from '../../../guest-agent/src/protocol/methods.ts';
import { AgentClient } from '../agent-client.ts';
import type { DeadlinePolicy } from '../deadlines.ts';
import type { Vm } from './vmm.ts';
import { connectVsockAgent } from './vsock.ts';

export interface ConnectAgentOptions {
  /** The first handshake's deadline (a cold boot takes minutes under TCG, a restore seconds). */
  timeoutMs: number;
  log: Logger;
  /** Hand the restored guest entropy and the clock, and wait for it (tests; the backend pipelines it). */
  resume?: boolean;
  /** Deadlines on every RPC and a heartbeat (see deadlines.ts); none for a one-off probe. */
  deadlines?: DeadlinePolicy;
  /** With deadlines: how long a silent guest is given while calls wait (default from the policy). */
  deadAfterMs?: number;
}

/**
 * Connects the broker to the agent inside a VM through QEMU's chardev socket. The agent
 * answers our hello once it is up (after a cold boot) or at once (after a restore, where
 * it is waiting on its reopened port; see the epoch handshake in connection.ts). A VM that
 * dies fails the wait, and later fails every call in flight at once.
 */
export async function connectAgent(vm: Vm, opts: ConnectAgentOptions): Promise<AgentClient> {
  let client: AgentClient;
  if (vm.spec.channel?.kind === 'vsock') client = await connectVsockAgent(vm, opts);
  else {
    const sock = connect(vm.channelPath);
    await new Promise<void>((resolve, reject) => {
      sock.once('connect', resolve);
      sock.once('error', (e) => reject(new HutchError('unavailable', `agent channel ${vm.channelPath}: ${e.message}`)));
    });
    client = new AgentClient(sock, {
      log: opts.log.child({ vm: vm.spec.id }),
      handshakeTimeoutMs: opts.timeoutMs,
      resendHelloMs: 250,
      ...(opts.deadlines ? { deadlines: opts.deadlines } : {}),
      ...(opts.deadAfterMs !== undefined ? { deadAfterMs: opts.deadAfterMs } : {}),
    });
  }
  const died = vm.exited.then((e) => {
    const err = new HutchError('guest_crashed', `VM ${vm.spec.id} exited (${e.code ?? e.signal}); console: ${e.console.slice(-5).join(' | ')}`, { vm: vm.spec.id });
    // Calls in flight fail now, not at their deadline.
    client.connection.destroy(err);
    throw err;
  });
  died.catch(() => undefined);
  try {
    await Promise.race([client.ready(), died]);
  } catch (err) {
    client.close();
    // A channel that closed because the VM died says why: the VM's exit and console.
    const exited = await Promise.race([died.then(() => undefined, (e: unknown) => e), new Promise((r) => setTimeout(r, 500, undefined))]);
    if (exited) throw exited;
    // A guest that is alive but silent: what its console said last is the best lead.
    if (err instanceof HutchError) throw new HutchError(err.code, `${err.message}; guest console: ${vm.consoleTail(6).join(' | ') || '(nothing)'}`, { ...err.context, vm: vm.spec.id });
    throw err;
  }
  if (opts.resume) await resumeGuest(client);
  return client;
}

/** After a restore: fresh entropy (clones share RNG state) and the host's clock. */
export function resumeGuest(client: AgentClient, work?: { bytes: number; files: number }): Promise<ResultOf<'agent.resume'>> {
  return client.call('agent.resume', { unixTimeMs: Date.now(), entropy: randomBytes(64), ...(work ? { work } : {}) });
}

/** Ends the agent's session before a snapshot; a guest that cannot answer is snapshotted as it is. */
export async function detachAgent(agent: AgentClient): Promise<void> {
  try {
    await agent.call('agent.detach', {});
    // Let the guest see the host side go away and reopen its port before it is paused.
    await new Promise((r) => setTimeout(r, 100));
  } catch {
    // The epoch handshake makes a restore of any channel state safe; detaching only makes it quicker.
  }
  agent.close();
}
