import { randomInt } from 'node:crypto';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';

/**
 * What a QEMU process may do once the guest runs. QEMU is the piece of hutch a VM tenant
 * attacks directly (every device model, and under TCG the whole CPU emulator), and the
 * broker starts it as root: an escape into QEMU was an escape to root on the host, with
 * every host file, every other tenant's VM and the broker within reach.
 *
 * So each QEMU, after it has opened everything it needs (its disks, its RAM file, its
 * sockets, the migration descriptors), drops to a user id of its own (`-runas uid:gid`:
 * no capabilities, no_new_privs, a uid no file and no other VM has), and runs under its
 * own seccomp filter (`-sandbox`): no obsolete system calls, no scheduler or resource
 * changes, and no new processes. Nothing hutch asks of a running QEMU needs more: snapshots
 * go through descriptors opened before the drop (qemu-driver.ts), never through a shell.
 *
 * `elevateprivileges=deny` is left out: it forbids the set*id calls `-runas` itself makes
 * (QEMU dies of SIGSYS at start); once dropped, a process without capabilities cannot
 * regain them anyway. A template build's VM keeps `spawn` (its egress NIC starts a relay
 * per connection); the directory of the egress proxy's socket is handed to its id, so that
 * relay, running as that id, can connect.
 */
export interface QemuJail {
  /** The user and group id QEMU runs as. */
  uid: number;
  /** Whether QEMU may start processes (a build VM's egress relay). */
  spawn: boolean;
}

/** First of the ids VMs run as: above the ranges distributions and subuid files hand out. */
export const DEFAULT_VM_UID_BASE = 2_100_000_000;
/** Ids in the range: one per VM alive at once. */
export const VM_UID_COUNT = 10_000;

export function jailArgs(jail: QemuJail): string[] {
  const sandbox = `on,obsolete=deny,resourcecontrol=deny,spawn=${jail.spawn ? 'allow' : 'deny'}`;
  return ['-runas', `${jail.uid}:${jail.uid}`, '-sandbox', sandbox];
}

/**
 * The ids of VMs alive in this broker, one each: two QEMUs with one uid could signal each
 * other, so an id is only handed out again once its VM has exited. The walk starts at a
 * random place so that brokers sharing a host (tests, a restart beside a draining one)
 * rarely meet; an operator running several for real gives each its own `vmUidBase`.
 */
export class VmUidPool {
  private readonly used = new Set<number>();
  private next: number;

  constructor(
    readonly base = DEFAULT_VM_UID_BASE,
    readonly count = VM_UID_COUNT,
  ) {
    if (!Number.isInteger(base) || base < 1000 || base + count > 2 ** 31) throw new HutchError('bad_request', `VM uid range ${base}+${count} must lie within 1000..2^31`);
    this.next = randomInt(count);
  }

  acquire(): number {
    for (let i = 0; i < this.count; i++) {
      const uid = this.base + ((this.next + i) % this.count);
      if (this.used.has(uid)) continue;
      this.used.add(uid);
      this.next = (this.next + i + 1) % this.count;
      return uid;
    }
    throw new HutchError('busy', `all ${this.count} VM user ids are in use`, { limit: this.count });
  }

  release(uid: number): void {
    this.used.delete(uid);
  }

  get inUse(): number {
    return this.used.size;
  }
}

/**
 * bwrap around QEMU: the whole host visible as it is (devices too), optionally the shared
 * RAM guard's filter (shared-ram-guard.ts), and for a jailed QEMU a pid and a network
 * namespace of its own.
 *
 * The pid namespace is what keeps a jailed QEMU from outliving the broker: changing user
 * id clears a process's parent-death signal, so `setpriv --pdeathsig` no longer reaches
 * QEMU; bwrap's init in the namespace stays root and keeps it, and when that init dies the
 * kernel kills everything in the namespace, a stopped QEMU included.
 *
 * The network namespace (loopback only) takes the host's network from an escaped QEMU: the
 * broker's port, other hosts, cloud metadata. QEMU needs none of it: QMP, the agent's
 * channel, vhost-user and the snapshot socket are Unix sockets named by path, which work
 * across network namespaces, and a build VM's NIC (slirp, restrict=on) only runs guestfwd
 * relays to the egress proxy's Unix socket.
 */
export function wrapperArgv(argv: string[], opts: { filterFd?: number; jailed: boolean }): string[] {
  return [
    'bwrap', '--dev-bind', '/', '/', '--die-with-parent',
    ...(opts.jailed ? ['--unshare-pid', '--unshare-net'] : []),
    ...(opts.filterFd !== undefined ? ['--seccomp', String(opts.filterFd)] : []),
    '--', ...argv,
  ];
}
