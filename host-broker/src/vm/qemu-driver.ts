import { chownSync, constants, mkdirSync, openSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { constants as osConstants, setPriority } from 'node:os';
import { dirname, join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import { kernelCmdline, microvmMachine } from '../../../kernel-configs/boot-params.ts';
import { processGone, procStat } from '../util/process-gone.ts';
import { startDaemon, type Daemon } from '../util/daemon.ts';
import { waitForSocket } from '../util/wait-for-socket.ts';
import { QmpClient } from './qmp.ts';
import { closeFd, FILTER_FD, openGuardFilter } from './shared-ram-guard.ts';
import { openStateReceiver } from './state-receiver.ts';
import { jailArgs, VmUidPool, wrapperArgv, type QemuJail } from './qemu-jail.ts';
import { processMemory } from './smaps.ts';
import { createSwapDisk, SWAP_FILE } from './swap-disk.ts';
import type { Accel, MemoryBacking, SnapshotFiles, Vm, VmmDriver, VmSpec, VmStats } from './vmm.ts';
import { DEFAULT_GUEST_CID, ensureVhostDeviceVsock, startVhostVsockBackend, validatePort, VHOST_USER_SOCKET_NAME, vsockSnapshotError, VSOCK_UDS_NAME, type VhostDeviceVsock } from './vsock.ts';

/** RAM stays in its file (x-ignore-shared); MIGRATION events report progress. */
const MIGRATION_CAPS = [
  { capability: 'x-ignore-shared', state: true },
  { capability: 'events', state: true },
];

/** Name of the virtio-serial port the guest agent listens on (`--listen vport:hutch-agent`). */
export const AGENT_PORT_NAME = 'hutch-agent';
/** Tag in every VM's QEMU command line, so orphans of a dead broker can be found. */
export const QEMU_TAG = 'hutch-vm';

export interface QemuDriverOptions {
  accel: Accel;
  log: Logger;
  /** TCG translation-buffer size in MiB: the largest private cost of an idle TCG VM. */
  tcgTbMiB?: number;
  qemuBinary?: string;
  /** The host's TSC frequency: under TCG the guest skips calibrating it (see kernel-configs/boot-params.ts). */
  tscKhz?: number;
  /** The vhost-device-vsock backend for VMs with a vsock channel; found or fetched on first use when absent. */
  vhostDeviceVsock?: VhostDeviceVsock;
  /**
   * Drop each QEMU to a user id of its own under a seccomp sandbox once it has started
   * (qemu-jail.ts). Default true; false only to debug QEMU itself.
   */
  jail?: boolean;
  /** First user id VMs run as (DEFAULT_VM_UID_BASE). */
  vmUidBase?: number;
}

/** Opens a disk for QEMU: the -add-fd arguments and the path (`/dev/fdset/N`) to give -drive. */
type DiskFd = (file: string, readonly: boolean) => { args: string[]; path: string };

/**
 * QEMU `microvm` driver. Flags proven on these machines (see design.md): microvm with the
 * legacy PIT/PIC for TCG timer calibration, virtio-mmio devices, the root disk read-only,
 * a sparse swap disk per VM, virtio-serial for the agent, virtio-balloon with free page
 * reporting, QMP for control. Snapshots use migration with x-ignore-shared: RAM lives in
 * a file (share=on while the source runs), restores map it MAP_PRIVATE (share=off), so
 * every restored VM shares the pristine pages until it writes them.
 */
const PDEATHSIG = ['setpriv', '--pdeathsig', 'SIGKILL', '--'];
const PDEATHSIG_PREFIX = PDEATHSIG.length;

export class QemuDriver implements VmmDriver {
  readonly name = 'qemu';
  readonly accel: Accel;
  private vhostDeviceVsock: VhostDeviceVsock | undefined;
  private readonly uids: VmUidPool;

  constructor(private readonly opts: QemuDriverOptions) {
    this.accel = opts.accel;
    this.uids = new VmUidPool(opts.vmUidBase);
  }

  async boot(spec: VmSpec, memory?: MemoryBacking): Promise<Vm> {
    return this.launch(spec, memory, undefined);
  }

  async restore(spec: VmSpec, snap: SnapshotFiles): Promise<Vm> {
    return this.launch(spec, { file: snap.memory, shared: false }, snap);
  }

  private async launch(spec: VmSpec, memory: MemoryBacking | undefined, snap: SnapshotFiles | undefined): Promise<Vm> {
    const vsock = spec.channel?.kind === 'vsock' ? spec.channel : undefined;
    // vhost-user needs shared RAM and cannot be migrated: no memory file, no restore.
    if (vsock && (memory || snap)) throw vsockSnapshotError(spec.id);
    if (vsock) validatePort(vsock.port);
    rmSync(spec.dir, { recursive: true, force: true });
    mkdirSync(spec.dir, { recursive: true });
    const qmpPath = join(spec.dir, 'qmp.sock');
    const channelPath = join(spec.dir, vsock ? VSOCK_UDS_NAME : 'agent.sock');
    if (spec.swapMiB > 0) {
      try {
        await createSwapDisk(spec.dir, spec.swapMiB, snap?.swap);
      } catch (err) {
        rmSync(spec.dir, { recursive: true, force: true });
        throw err;
      }
    }
    // A jailed QEMU opens no file by path once it runs: a snapshot's state and the disks come
    // as descriptors it inherits (children see extraFds[i] as fd 3 + i), and a snapshot it
    // takes goes out through a socket (state-receiver.ts).
    const fds: number[] = [];
    const fdOf = (fd: number) => 3 + fds.push(fd) - 1;
    // A private mapping of a shared memory file: keep QEMU from punching holes in it (bwrap
    // reads the filter from fd 3).
    const guardFd = memory !== undefined && !memory.shared ? openGuardFilter() : undefined;
    if (guardFd !== undefined) fdOf(guardFd);
    let stateIn: number | undefined;
    const jail: QemuJail | undefined = this.opts.jail === false ? undefined : { uid: this.uids.acquire(), spawn: spec.egress !== undefined };
    const releaseUid = () => {
      if (jail) this.uids.release(jail.uid);
    };
    // Disks, too, are handed over as descriptors in fd sets (`/dev/fdset/N`): QEMU opens
    // them again when an incoming migration ends, and a jailed QEMU may not open the path.
    // A writable disk's set holds a read-write and a read-only descriptor, for either mode.
    let sets = 0;
    const diskFd: DiskFd = (file, readonly) => {
      const set = ++sets;
      const modes = readonly ? [constants.O_RDONLY] : [constants.O_RDWR, constants.O_RDONLY];
      const args = modes.flatMap((m) => ['-add-fd', `fd=${fdOf(openSync(file, m))},set=${set}`]);
      return { args, path: `/dev/fdset/${set}` };
    };
    let argv: string[];
    try {
      // The egress relay (socat, started by QEMU per connection) runs as the VM's id.
      if (jail && spec.egress) for (const p of [dirname(spec.egress.proxySocket), spec.egress.proxySocket]) chownSync(p, jail.uid, jail.uid);
      if (snap) stateIn = fdOf(openSync(snap.state, constants.O_RDONLY));
      argv = this.args(spec, memory, qmpPath, channelPath, snap !== undefined, jail, diskFd);
    } catch (err) {
      for (const fd of fds) closeFd(fd);
      releaseUid();
      rmSync(spec.dir, { recursive: true, force: true });
      throw err;
    }
    const guarded = guardFd !== undefined;
    const wrapped = guarded || jail !== undefined;
    if (wrapped) argv = [...argv.slice(0, PDEATHSIG_PREFIX), ...wrapperArgv(argv.slice(PDEATHSIG_PREFIX), { ...(guarded ? { filterFd: FILTER_FD } : {}), jailed: jail !== undefined })];
    // nice execs what follows in the same process, so pdeathsig and the pid stay as they were.
    if (spec.niceness) argv = ['nice', '-n', String(spec.niceness), ...argv];
    const log = this.opts.log.child({ vm: spec.id, ...(jail ? { uid: jail.uid } : {}) });
    let backend: Daemon | undefined;
    if (vsock) {
      try {
        const binary = (this.vhostDeviceVsock ??= this.opts.vhostDeviceVsock ?? (await ensureVhostDeviceVsock({ log: (m) => log.info('vsock.backend', { msg: m }) })));
        backend = (await startVhostVsockBackend({ binary, dir: spec.dir, cid: vsock.cid ?? DEFAULT_GUEST_CID, log })).daemon;
      } catch (err) {
        for (const fd of fds) closeFd(fd);
        releaseUid();
        rmSync(spec.dir, { recursive: true, force: true });
        throw err;
      }
    }
    const console: string[] = [];
    const daemon = startDaemon({
      argv,
      log,
      group: true,
      ...(fds.length ? { extraFds: fds } : {}),
      interesting: /HUTCH_|panic|error|Kernel|qemu-system/i,
      onLine: (l) => {
        spec.onConsole?.(l);
        console.push(l);
        if (console.length > 200) console.shift();
      },
    });
    for (const fd of fds) closeFd(fd); // the child has its own copies
    // Wrapped, the spawned process is bwrap; stats, kills and the wait for the end want QEMU
    // itself, found by its command line once it is up.
    let inner: { pid: number; startTicks: number } | undefined;
    const findInner = () => {
      const pid = wrapped ? qemuPids(spec.dir)[0] : undefined;
      const st = pid === undefined ? undefined : procStat(pid);
      if (pid !== undefined && st) inner ??= { pid, startTicks: st.startTicks };
    };
    // The wrapper's exit is not QEMU's (util/process-gone.ts): the VM has ended once QEMU has.
    const gone = daemon.exited.then(async () => {
      if (!inner) return true;
      const ok = await processGone(inner.pid, inner.startTicks);
      if (!ok) log.error('vm.qemu_lingers', { pid: inner.pid, hint: 'QEMU outlived its wrapper and SIGKILL; its user id stays out of the pool' });
      return ok;
    });
    // The id goes back to the pool only once this QEMU is gone.
    void gone.then((ok) => ok && releaseUid());
    let qmp: QmpClient | undefined;
    try {
      await waitForSocket(qmpPath, { proc: daemon.proc, timeoutMs: 15_000 });
      findInner();
      qmp = await QmpClient.connect(qmpPath);
      if (stateIn !== undefined) await this.loadSnapshot(qmp, stateIn);
      return new QemuVm(spec, daemon, gone, inner?.pid ?? daemon.pid, wrapped, this.accel, channelPath, qmp, console, jail?.uid, backend);
    } catch (err) {
      qmp?.close();
      findInner();
      await daemon.stop(200);
      await gone;
      await backend?.stop(200);
      rmSync(spec.dir, { recursive: true, force: true });
      const tail = daemon.tail().slice(-5).join(' | ');
      throw new HutchError('unavailable', `QEMU ${snap ? 'restore' : 'boot'} of ${spec.id} failed: ${(err as Error).message}${tail ? `; qemu said: ${tail}` : ''}`, { vm: spec.id });
    }
  }

  /** Loads a snapshot's device state from the descriptor QEMU inherited as `fd`. */
  private async loadSnapshot(qmp: QmpClient, fd: number): Promise<void> {
    await qmp.execute('migrate-set-capabilities', { capabilities: MIGRATION_CAPS });
    const done = qmp.waitEvent('MIGRATION', (d) => d['status'] === 'completed' || d['status'] === 'failed', 120_000);
    // Observed now: if the command below fails, nobody awaits `done`, and its timeout must
    // not become an unhandled rejection that takes the broker down.
    done.catch(() => undefined);
    await qmp.execute('migrate-incoming', { uri: `fd:${fd}` });
    const ev = await done;
    if (ev['status'] !== 'completed') throw new HutchError('internal', `incoming migration ${String(ev['status'])}`);
    await qmp.execute('cont');
  }

  private args(spec: VmSpec, memory: MemoryBacking | undefined, qmpPath: string, channelPath: string, incoming: boolean, jail: QemuJail | undefined, diskFd: DiskFd): string[] {
    const img = spec.image;
    const drive = (id: string, file: string, readonly: boolean, opts: string): string[] => {
      const fd = diskFd(file, readonly);
      return [...fd.args, '-drive', `id=${id},file=${fd.path},format=raw,if=none${readonly ? ',readonly=on' : ''}${opts}`];
    };
    const vsock = spec.channel?.kind === 'vsock' ? spec.channel : undefined;
    const machine = [microvmMachine({ smp: spec.cpus, flavor: img.flavor })];
    const a: string[] = [
      ...PDEATHSIG, // never outlive the broker, even if it is SIGKILLed
      this.opts.qemuBinary ?? 'qemu-system-x86_64',
      '-name', `${QEMU_TAG}:${spec.id},debug-threads=off`,
      ...(this.accel === 'kvm' ? ['-accel', 'kvm', '-cpu', 'host'] : ['-accel', `tcg,tb-size=${this.opts.tcgTbMiB ?? 64}`, '-cpu', 'max']),
      '-smp', String(spec.cpus),
      '-m', `${spec.memoryMiB}M`,
      '-nodefaults', '-no-user-config', '-display', 'none', '-no-reboot',
      '-serial', 'stdio',
      '-kernel', img.kernel,
      ...(img.initrd ? ['-initrd', img.initrd] : []),
      '-append', kernelCmdline({
        flavor: img.flavor,
        ...(this.accel === 'tcg' && this.opts.tscKhz ? { tcgTscKhz: this.opts.tscKhz } : {}),
        extra: ['init=/sbin/init', ...(img.cmdline ?? []), ...(vsock ? [`hutch.listen=vsock:${vsock.port}`] : [])],
      }),
      // Device order decides the guest's names (and must match a snapshot's): the agent
      // layer is /dev/vda (the kernel's root), the template's root /dev/vdb, then extra
      // disks, then swap (init takes the first writable disk that is not its root).
      ...drive('layer', img.agentLayer, true, ''),
      '-device', 'virtio-blk-device,drive=layer',
      ...drive('root', img.rootfs, true, ''),
      '-device', 'virtio-blk-device,drive=root',
    ];
    (spec.disks ?? []).forEach((d, i) => {
      a.push(...drive(`disk${i}`, d.file, d.readonly === true, d.readonly ? '' : ',cache=unsafe'), '-device', `virtio-blk-device,drive=disk${i}`);
    });
    if (spec.swapMiB > 0) {
      a.push(...drive('swap', join(spec.dir, SWAP_FILE), false, ',cache=unsafe,discard=unmap'), '-device', 'virtio-blk-device,drive=swap');
    }
    if (vsock) {
      // The guest CID comes from the backend (the device has no guest-cid property in QEMU 7.2).
      a.push('-chardev', `socket,id=vsock,path=${join(spec.dir, VHOST_USER_SOCKET_NAME)}`, '-device', 'vhost-user-vsock-device,chardev=vsock');
    } else {
      a.push(
        '-device', 'virtio-serial-device',
        '-chardev', `socket,id=agent,path=${channelPath},server=on,wait=off`,
        '-device', `virtserialport,chardev=agent,name=${AGENT_PORT_NAME}`,
      );
    }
    a.push(
      '-device', 'virtio-balloon-device,free-page-reporting=on',
      // Entropy for the guest's getrandom() (Node and Python read it at start).
      '-device', 'virtio-rng-device',
      '-qmp', `unix:${qmpPath},server=on,wait=off`,
    );
    if (spec.egress) a.push(...egressNicArgs(spec.egress));
    if (memory) {
      a.push('-object', `memory-backend-file,id=mem,size=${spec.memoryMiB}M,mem-path=${memory.file},share=${memory.shared ? 'on' : 'off'}`);
      machine.push('memory-backend=mem');
    } else if (vsock) {
      // vhost-user maps guest RAM into the backend process: it must be shareable.
      a.push('-object', `memory-backend-memfd,id=mem,size=${spec.memoryMiB}M,share=on`);
      machine.push('memory-backend=mem');
    }
    if (incoming) a.push('-incoming', 'defer');
    if (jail) a.push(...jailArgs(jail));
    a.splice(a.indexOf('-smp'), 0, '-M', machine.join(','));
    return a;
  }
}

/**
 * Pids of QEMU processes (not their wrappers) whose command line mentions `within`
 * (a VM's directory, or a broker's data dir): for stats, and for tests and benches that
 * look for leftovers.
 */
export function qemuPids(within: string): number[] {
  const out: number[] = [];
  for (const p of readdirSync('/proc')) {
    if (!/^\d+$/.test(p)) continue;
    try {
      if (!readFileSync(`/proc/${p}/comm`, 'utf8').startsWith('qemu-system')) continue;
      const c = readFileSync(`/proc/${p}/cmdline`, 'utf8');
      if (c.includes(`${QEMU_TAG}:`) && c.includes(within)) out.push(Number(p));
    } catch {
      // gone
    }
  }
  return out;
}

class QemuVm implements Vm {
  readonly exited: Promise<{ code: number | null; signal: string | null; console: string[] }>;
  private destroying: Promise<void> | undefined;

  constructor(
    readonly spec: VmSpec,
    private readonly daemon: Daemon,
    /** Settles once QEMU itself has exited, after its wrapper (true), or would not die (false). */
    private readonly gone: Promise<boolean>,
    /** QEMU's own pid (the daemon may be a wrapper around it). */
    private readonly qemuPid: number,
    /** Whether the daemon is bwrap around QEMU, which reports QEMU's death by a signal as 128 + its number. */
    wrapped: boolean,
    readonly accel: Accel,
    readonly channelPath: string,
    readonly qmp: QmpClient,
    private readonly console: string[],
    /** The user id a jailed QEMU runs as (undefined: root). */
    private readonly uid: number | undefined,
    /** vhost-device-vsock of a vsock VM: it would outlive QEMU, so it goes when QEMU goes. */
    private readonly backend?: Daemon,
  ) {
    this.exited = daemon.exited.then(async ({ code, signal }) => {
      await gone;
      return { ...(wrapped ? unwrapExit(code, signal) : { code, signal }), console: [...console] };
    });
    if (backend) void gone.then(() => backend.stop(300));
  }

  get pid(): number {
    return this.qemuPid;
  }

  get running(): boolean {
    return this.daemon.running;
  }

  consoleTail(lines = 8): string[] {
    return this.console.slice(-lines);
  }

  async pause(): Promise<void> {
    await this.qmp.execute('stop');
  }

  async resume(): Promise<void> {
    await this.qmp.execute('cont');
  }

  async snapshot(stateFile: string): Promise<{ ms: number; stateBytes: number }> {
    if (this.spec.channel?.kind === 'vsock') {
      // Refuse before pausing the guest, quoting QEMU's reasons (query-migrate blocked-reasons).
      const q = await this.qmp.execute<{ 'blocked-reasons'?: string[] }>('query-migrate').catch(() => undefined);
      throw vsockSnapshotError(this.spec.id, q?.['blocked-reasons']);
    }
    const t0 = performance.now();
    // RAM goes into the stream (a restored VM's is a private mapping), device state is a few MiB.
    const rx = await openStateReceiver(stateFile, this.uid, this.spec.id, { timeoutMs: 120_000, maxBytes: (this.spec.memoryMiB + 64) * 2 ** 20 });
    try {
      await this.qmp.execute('stop');
      await this.qmp.execute('migrate-set-capabilities', { capabilities: MIGRATION_CAPS });
      const done = this.qmp.waitEvent('MIGRATION', (d) => d['status'] === 'completed' || d['status'] === 'failed', 120_000);
      done.catch(() => undefined); // see loadSnapshot
      await this.qmp.execute('migrate', { uri: rx.uri });
      // A stream the receiver refused (past the VM's size) fails the snapshot at once.
      const ev = await Promise.race([done, rx.done.then(() => done)]);
      if (ev['status'] !== 'completed') {
        const q = await this.qmp.execute<{ 'error-desc'?: string }>('query-migrate').catch(() => undefined);
        throw new HutchError('internal', `snapshot migration ${String(ev['status'])}${q?.['error-desc'] ? `: ${q['error-desc']}` : ''}`, { vm: this.spec.id });
      }
      // "completed" means QEMU has sent it all, not that the file holds it all: wait for
      // the write before anyone reads the file or kills the VM.
      const stateBytes = await rx.done;
      return { ms: performance.now() - t0, stateBytes };
    } finally {
      rx.close();
    }
  }

  async stats(): Promise<VmStats> {
    return processMemory(this.pid);
  }

  setNiceness(n: number): string | undefined {
    // Nice values are per thread on Linux: set each of QEMU's (vCPU, I/O, main).
    let tids: string[] = [];
    try {
      tids = readdirSync(`/proc/${this.qemuPid}/task`);
    } catch {
      return undefined; // gone
    }
    let refused: string | undefined;
    for (const tid of tids) {
      try {
        setPriority(Number(tid), n);
      } catch (err) {
        // A thread that ended meanwhile is fine; a refusal (lowering needs CAP_SYS_NICE) is not.
        if ((err as NodeJS.ErrnoException).code !== 'ESRCH') refused ??= `thread ${tid}: ${(err as Error).message}`;
      }
    }
    return refused;
  }

  /** Every caller waits for the same teardown: a second destroy (a broker's shutdown during a release) returns only once QEMU is gone. */
  destroy(): Promise<void> {
    this.destroying ??= (async () => {
      this.qmp.close();
      await this.daemon.stop(300);
      await this.gone;
      await this.backend?.stop(300);
      rmSync(this.spec.dir, { recursive: true, force: true });
    })();
    return this.destroying;
  }
}


/**
 * The build VM's NIC (last, so no other device's virtio-mmio slot moves). restrict=on drops
 * every packet that is not for a guestfwd: no DNS, no 10.0.2.2 (slirp maps it to the host's
 * loopback, where the broker and the catalog listen), no direct connection anywhere. The
 * guestfwd spawns a relay per guest connection to the host-side proxy's Unix socket, which
 * decides where the connection may go.
 */
export function egressNicArgs(e: NonNullable<VmSpec['egress']>): string[] {
  // QEMU's option parser splits on commas; a socket path with one (or a shell metacharacter,
  // since QEMU runs the command with /bin/sh -c) is refused rather than escaped.
  if (!/^[A-Za-z0-9._\/-]+$/.test(e.proxySocket)) throw new HutchError('internal', `egress proxy socket path ${JSON.stringify(e.proxySocket)} has characters QEMU's guestfwd cannot carry`);
  if (!/^10\.0\.2\.\d{1,3}$/.test(e.proxyAddress) || !Number.isInteger(e.proxyPort) || e.proxyPort < 1 || e.proxyPort > 65535) {
    throw new HutchError('internal', `egress proxy address ${e.proxyAddress}:${e.proxyPort} is not in slirp's 10.0.2.0/24`);
  }
  const relay = `socat - UNIX-CONNECT:${e.proxySocket}`;
  return [
    '-netdev', `user,id=egress,restrict=on,ipv6=off,guestfwd=tcp:${e.proxyAddress}:${e.proxyPort}-cmd:${relay}`,
    '-device', 'virtio-net-device,netdev=egress',
  ];
}

/** QEMU's own end as bwrap passed it on: an exit status above 128 is death by signal (status - 128). */
function unwrapExit(code: number | null, signal: string | null): { code: number | null; signal: string | null } {
  if (code === null || code <= 128) return { code, signal };
  const name = Object.entries(osConstants.signals).find(([, n]) => n === code - 128)?.[0];
  return name ? { code: null, signal: name } : { code, signal };
}
