import type { QmpClient } from './qmp.ts';

/**
 * The VMM driver interface (modelled on Firecracker's lifecycle: configure, boot, pause,
 * snapshot, load-and-resume, destroy). A VM here is a process the driver owns; the agent
 * channel is a host Unix socket the broker connects to.
 */
export type Accel = 'kvm' | 'tcg';

export interface GuestImage {
  /** Kernel to boot directly (vmlinux with PVH entry, or bzImage). */
  kernel: string;
  /** Initramfs, for kernels that need one (Debian's). */
  initrd?: string;
  /** 'hutch' kernels have drivers built in and take devices from the command line. */
  flavor: 'hutch' | 'debian';
  /** The template's read-only root filesystem image (ext4): the guest's second disk, /dev/vdb. */
  rootfs: string;
  /**
   * hutch's read-only agent layer (ext4: init, Node, the agent; rootfs/agent-layer.ts): the
   * first disk and the kernel's root, /dev/vda. Its init mounts `rootfs` and pivots into it.
   */
  agentLayer: string;
  /** Extra kernel command line pieces (e.g. hutch.* settings for the guest init). */
  cmdline?: readonly string[];
}

/**
 * How the broker reaches the guest agent. virtio-serial (the default) survives snapshots;
 * vsock is Firecracker's hybrid vsock through QEMU's vhost-user-vsock-device, which QEMU
 * cannot snapshot (see vsock.ts). `port` is the guest's AF_VSOCK port; `cid` defaults to 3.
 */
export type AgentChannel = { kind: 'virtio-serial' } | { kind: 'vsock'; port: number; cid?: number };

export interface VmSpec {
  /** Short id: names the runtime directory and tags the process for orphan cleanup. */
  id: string;
  /** Runtime directory: sockets, swap disk, console log. Created by the driver. */
  dir: string;
  image: GuestImage;
  memoryMiB: number;
  cpus: number;
  /** Size of the sparse per-VM swap disk; 0 for none. */
  swapMiB: number;
  /** Agent channel; default virtio-serial. */
  channel?: AgentChannel;
  /** Further disks after the template's root (template builds: target, spec, layers). */
  disks?: readonly { file: string; readonly: boolean }[];
  /** Every console line as it arrives (template builds read their progress from it). */
  onConsole?: (line: string) => void;
  /**
   * A NIC whose only reachable peer is an egress proxy (template build VMs only; tenant VMs
   * never get one). QEMU's user network runs with restrict=on, so the guest reaches neither
   * the host's loopback (slirp's 10.0.2.2) nor anything else directly: its one route out is
   * a TCP port at `proxyAddress`, relayed per connection to `proxySocket` on the host.
   * A jailed QEMU's relay runs as the VM's user id: the socket and its directory (one of
   * its own) are handed to that id when the VM starts.
   */
  egress?: { proxySocket: string; proxyAddress: string; proxyPort: number };
  /**
   * Start the VMM at this nice value (every thread inherits it): a standby VM being
   * prepared yields the CPU to VMs serving calls. `Vm.setNiceness` changes it later.
   */
  niceness?: number;
}

export interface MemoryBacking {
  /** Guest RAM file. `shared` writes go to the file (a snapshot source); private is copy-on-write. */
  file: string;
  shared: boolean;
}

export interface SnapshotFiles {
  /** Guest RAM at snapshot time (mapped copy-on-write by restores). */
  memory: string;
  /** Device state written by QEMU's migration stream. */
  state: string;
  /** The swap disk as it was at the snapshot (a slot's); a VM without one gets an empty disk. */
  swap?: string;
}

export interface VmStats {
  rssKiB: number;
  pssKiB: number;
  privateKiB: number;
  sharedKiB: number;
  swapKiB: number;
}

export interface Vm {
  readonly spec: VmSpec;
  readonly pid: number;
  readonly accel: Accel;
  /**
   * Host Unix socket of the agent channel: QEMU's end of the virtio-serial port, or for a
   * vsock VM the hybrid-vsock socket (connect, then `CONNECT <port>\n`: see vsock.ts).
   */
  readonly channelPath: string;
  readonly qmp: QmpClient;
  /** Resolves when the VMM process exits, with its last console lines. */
  readonly exited: Promise<{ code: number | null; signal: string | null; console: string[] }>;
  readonly running: boolean;
  /** The guest console's last lines (for errors about a guest that says nothing). */
  consoleTail(lines?: number): string[];
  pause(): Promise<void>;
  resume(): Promise<void>;
  /**
   * Pauses and writes device state; RAM must be shared-file backed. The VM stays paused.
   * A vsock VM refuses (HutchError 'unavailable') and keeps running.
   */
  snapshot(stateFile: string): Promise<{ ms: number; stateBytes: number }>;
  stats(): Promise<VmStats>;
  /**
   * Sets the nice value of every VMM thread (a standby VM handed to a session goes back to
   * 0). Returns why it could not, for a thread that refused (lowering needs CAP_SYS_NICE).
   */
  setNiceness(n: number): string | undefined;
  /** Kills the VMM and removes its runtime directory. */
  destroy(): Promise<void>;
}

export interface VmmDriver {
  readonly name: string;
  readonly accel: Accel;
  /** Cold boot. With `memory`, RAM is backed by that file (needed to snapshot later). */
  boot(spec: VmSpec, memory?: MemoryBacking): Promise<Vm>;
  /** Starts a VM from a snapshot, guest RAM mapped copy-on-write from its memory file. */
  restore(spec: VmSpec, snap: SnapshotFiles): Promise<Vm>;
}
