import { accessSync, constants, readdirSync, readFileSync, statSync } from 'node:fs';
import { rm } from 'node:fs/promises';
import { connect, type Socket } from 'node:net';
import { delimiter, join } from 'node:path';
import { cacheDir, fillAtomically, withLock } from '../../../build/cache.ts';
import { extractDeb, fetchDebianPackages } from '../../../build/debian-fetch.ts';
import { capture } from '../../../build/run.ts';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import { AgentClient } from '../agent-client.ts';
import type { ConnectAgentOptions } from './agent-channel.ts';
import { startDaemon, type Daemon } from '../util/daemon.ts';
import type { Vm } from './vmm.ts';

/**
 * The vsock agent channel, Firecracker-style: the guest agent listens on an AF_VSOCK port
 * (`--listen vsock:PORT`, relayed by socat), and the host reaches it through a "hybrid
 * vsock" Unix socket: connect, send `CONNECT <port>\n`, read `OK <hostport>\n`, then the
 * stream is the guest's. Under QEMU the device is `vhost-user-vsock-device` and the
 * backend is rust-vmm's `vhost-device-vsock` (Debian sid), one process per VM.
 *
 * Why this is not the channel of snapshotted VMs here (measured, QEMU 7.2):
 *  - vhost-user maps guest RAM into the backend process, so RAM must be shareable
 *    (memory-backend-memfd share=on); copy-on-write restores map it MAP_PRIVATE.
 *  - QEMU refuses to migrate or snapshot such a VM: `migrate` fails with "State blocked by
 *    non-migratable device '.../vhost-user-vsock'", and query-migrate lists "Migration
 *    disabled: vhost-user backend lacks VHOST_USER_PROTOCOL_F_LOG_SHMFD feature.".
 */

/** The hybrid-vsock Unix socket in the VM's runtime directory (the VM's channelPath). */
export const VSOCK_UDS_NAME = 'vsock.sock';
/** The vhost-user control socket QEMU connects to. */
export const VHOST_USER_SOCKET_NAME = 'vhost-vsock.sock';
/** Guest CID when the spec gives none: each VM has its own backend process, so CIDs never meet. */
export const DEFAULT_GUEST_CID = 3;
/** The Debian package (sid) that ships the backend. */
export const VHOST_VSOCK_PACKAGE = 'vhost-device-vsock';

// ---------------------------------------------------------------------------------------
// The backend binary
// ---------------------------------------------------------------------------------------

export interface VhostDeviceVsock {
  /** Absolute path of the executable. */
  path: string;
  /** What `--version` printed, e.g. "vhost-device-vsock 0.3.0". */
  version: string;
  /** Debian package version it came from (when unpacked from sid), e.g. "0.3.0-2". */
  packageVersion?: string;
  /** Where it came from: the environment, PATH, the cache or a fresh download. */
  source: 'env' | 'path' | 'cache' | 'sid';
  /** Extra environment it needs (LD_LIBRARY_PATH for libraries unpacked next to it). */
  env: Record<string, string>;
}

const BINARY_IN_DEB = join('usr', 'bin', 'vhost-device-vsock');

/**
 * Finds or fetches `vhost-device-vsock`: $HUTCH_VHOST_DEVICE_VSOCK, then PATH, then a copy
 * unpacked earlier under ~/.cache/hutch/vhost-device-vsock/<version>/, else the package is
 * downloaded from Debian sid with a private apt configuration (the host never upgrades
 * from sid) and unpacked there with dpkg-deb -x. The result is checked with ldd and by
 * running `--version`; a binary that cannot run fails here, with the reason.
 */
export async function ensureVhostDeviceVsock(opts: { log?: (m: string) => void; offline?: boolean } = {}): Promise<VhostDeviceVsock> {
  const log = opts.log ?? (() => undefined);
  const fromEnv = process.env['HUTCH_VHOST_DEVICE_VSOCK'];
  if (fromEnv) return verify(fromEnv, 'env');
  const onPath = findOnPath('vhost-device-vsock');
  if (onPath) return verify(onPath, 'path');
  const root = await cacheDir('vhost-device-vsock');
  const cached = newestUnpacked(root);
  if (cached) return verify(join(root, cached, BINARY_IN_DEB), 'cache', cached);
  if (opts.offline) throw new HutchError('unavailable', `vhost-device-vsock is not installed and not in ${root}; it comes from Debian sid (package ${VHOST_VSOCK_PACKAGE})`);
  return withLock(join(root, '.fetch.lock'), async () => {
    const again = newestUnpacked(root);
    if (again) return verify(join(root, again, BINARY_IN_DEB), 'cache', again);
    const [deb] = await fetchDebianPackages({ suite: 'sid', log }, [VHOST_VSOCK_PACKAGE]).catch((err: unknown) => {
      throw new HutchError('unavailable', `cannot fetch ${VHOST_VSOCK_PACKAGE} from Debian sid: ${(err as Error).message}`, { package: VHOST_VSOCK_PACKAGE });
    });
    if (!deb) throw new HutchError('internal', `fetching ${VHOST_VSOCK_PACKAGE} returned nothing`);
    const dir = join(root, deb.version);
    await fillAtomically(dir, (tmp) => extractDeb(deb.path, tmp));
    log(`vhost-device-vsock ${deb.version} from sid unpacked into ${dir}`);
    try {
      return await verify(join(dir, BINARY_IN_DEB), 'sid', deb.version);
    } catch (err) {
      // Keep nothing that cannot run: the next call would otherwise trust it.
      await rm(dir, { recursive: true, force: true });
      throw err;
    }
  }, log);
}

function findOnPath(name: string): string | undefined {
  for (const dir of (process.env['PATH'] ?? '').split(delimiter)) {
    if (!dir) continue;
    const p = join(dir, name);
    try {
      accessSync(p, constants.X_OK);
      if (statSync(p).isFile()) return p;
    } catch {
      // not here
    }
  }
  return undefined;
}

/** The highest version directory that holds the binary (Debian versions compared numerically, which suffices here). */
function newestUnpacked(root: string): string | undefined {
  const versions = readdirSync(root, { withFileTypes: true })
    .filter((d) => d.isDirectory() && !d.name.startsWith('.') && !d.name.includes('.tmp-'))
    .map((d) => d.name)
    .filter((v) => {
      try {
        return statSync(join(root, v, BINARY_IN_DEB)).isFile();
      } catch {
        return false;
      }
    });
  versions.sort((a, b) => b.localeCompare(a, 'en', { numeric: true }));
  return versions[0];
}

async function verify(path: string, source: VhostDeviceVsock['source'], packageVersion?: string): Promise<VhostDeviceVsock> {
  const env: Record<string, string> = {};
  if (source === 'cache' || source === 'sid') {
    // Libraries unpacked into the same tree (0.3.0 on bookworm needs none: it links only
    // libc and libgcc_s) would sit in its usr/lib/x86_64-linux-gnu.
    const libDir = join(path, '..', '..', 'lib', 'x86_64-linux-gnu');
    try {
      if (statSync(libDir).isDirectory()) env['LD_LIBRARY_PATH'] = libDir;
    } catch {
      // no private libraries
    }
  }
  const runEnv = { ...process.env, ...env };
  let ldd: string;
  try {
    ldd = await capture(['ldd', path], { env: runEnv, timeoutMs: 10_000 });
  } catch (err) {
    throw new HutchError('unavailable', `${path} is not a usable executable (ldd: ${(err as Error).message.split('\n')[0]})`, { path });
  }
  const missing = ldd.split('\n').filter((l) => /not found/.test(l)).map((l) => l.trim());
  if (missing.length) {
    throw new HutchError('unavailable', `${path} cannot run on this host, missing: ${missing.join('; ')}`, { path, missing });
  }
  let version: string;
  try {
    version = (await capture([path, '--version'], { env: runEnv, timeoutMs: 10_000 })).trim();
  } catch (err) {
    throw new HutchError('unavailable', `${path} --version failed: ${(err as Error).message.split('\n')[0]}`, { path });
  }
  return { path, version, source, env, ...(packageVersion ? { packageVersion } : {}) };
}

// ---------------------------------------------------------------------------------------
// The backend process of one VM
// ---------------------------------------------------------------------------------------

export interface VhostVsockBackendOptions {
  binary: VhostDeviceVsock;
  /** The VM's runtime directory: both sockets are created in it. */
  dir: string;
  cid: number;
  log: Logger;
  timeoutMs?: number;
}

/**
 * Starts `vhost-device-vsock` for one VM and waits until its vhost-user socket listens
 * (QEMU's chardev connects once, at start, and fails if nobody listens). The backend
 * outlives a QEMU that goes away (it waits for the next one), so the driver stops it with
 * the VM; setpriv's parent-death signal covers a broker that dies first.
 */
export async function startVhostVsockBackend(opts: VhostVsockBackendOptions): Promise<{ daemon: Daemon; udsPath: string; socketPath: string }> {
  validateCid(opts.cid);
  // The backend parses --vm as comma-separated key=value pairs.
  if (/[,=]/.test(opts.dir)) throw new HutchError('bad_request', `a vsock VM's runtime directory cannot contain ',' or '=': ${opts.dir}`, { dir: opts.dir });
  const udsPath = join(opts.dir, VSOCK_UDS_NAME);
  const socketPath = join(opts.dir, VHOST_USER_SOCKET_NAME);
  const daemon = startDaemon({
    argv: ['setpriv', '--pdeathsig', 'SIGKILL', '--', opts.binary.path, '--vm', `guest-cid=${opts.cid},uds-path=${udsPath},socket=${socketPath}`],
    env: { ...process.env, ...opts.binary.env },
    log: opts.log.child({ component: 'vhost-device-vsock' }),
    interesting: /error|warn|panic/i,
  });
  try {
    await waitForListening(socketPath, daemon, opts.timeoutMs ?? 10_000);
  } catch (err) {
    await daemon.stop(200);
    const tail = daemon.tail().slice(-3).join(' | ');
    throw new HutchError('unavailable', `vhost-device-vsock did not start: ${(err as Error).message}${tail ? `; it said: ${tail}` : ''}`, { dir: opts.dir });
  }
  return { daemon, udsPath, socketPath };
}

/**
 * Waits for a listening Unix socket at `path` by reading /proc/net/unix rather than
 * connecting: a probe connection would look like a vhost-user front-end to the backend.
 */
async function waitForListening(path: string, daemon: Daemon, timeoutMs: number): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    if (!daemon.running) throw new HutchError('unavailable', `the process exited before ${path} listened`);
    if (isListening(path)) return;
    if (Date.now() > deadline) throw new HutchError('timeout', `${path} did not listen within ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

/** /proc/net/unix rows: Num RefCount Protocol Flags Type St Inode Path; Flags has __SO_ACCEPTCON (0x10000) when listening. */
function isListening(path: string): boolean {
  for (const line of readFileSync('/proc/net/unix', 'utf8').split('\n')) {
    const cols = line.trim().split(/\s+/);
    if (cols.length >= 8 && cols.slice(7).join(' ') === path && (parseInt(cols[3] ?? '0', 16) & 0x10000) !== 0) return true;
  }
  return false;
}

export function validateCid(cid: number): void {
  // 0-2 are reserved (hypervisor, local, host); 0xffffffff is VMADDR_CID_ANY.
  if (!Number.isInteger(cid) || cid < 3 || cid >= 0xffffffff) throw new HutchError('bad_request', `bad vsock guest CID ${cid}: expected an integer from 3 to 4294967294`, { cid });
}

export function validatePort(port: number): void {
  if (!Number.isInteger(port) || port < 1 || port >= 0xffffffff) throw new HutchError('bad_request', `bad vsock port ${port}: expected an integer from 1 to 4294967294`, { port });
}

/** Why a vsock VM cannot be snapshotted or restored, with QEMU's own words when we have them. */
export function vsockSnapshotError(vmId: string, qemuSays?: readonly string[]): HutchError {
  return new HutchError(
    'unavailable',
    `VM ${vmId} uses the vsock agent channel (QEMU vhost-user-vsock-device with the vhost-device-vsock backend): ` +
      `vhost-user devices cannot be migrated or snapshotted, and they need guest RAM in shared memory (memfd, share=on), ` +
      `which rules out copy-on-write restore. Use the virtio-serial channel for VMs that are snapshotted or restored.` +
      (qemuSays?.length ? ` QEMU says: ${qemuSays.join('; ')}` : ''),
    { vm: vmId, channel: 'vsock', ...(qemuSays?.length ? { qemu: [...qemuSays] } : {}) },
  );
}

// ---------------------------------------------------------------------------------------
// The host side of hybrid vsock
// ---------------------------------------------------------------------------------------

/** Longest reply line we accept: "OK 4294967295\n" is 14 bytes. */
const MAX_REPLY_LINE = 64;

export interface HybridVsockOptions {
  /** Stops the retries (the VM died, the caller gave up). */
  signal?: AbortSignal;
  /** How long one attempt waits for the OK line before retrying; default 5 s. */
  attemptTimeoutMs?: number;
}

/**
 * Connects to guest port `port` through a hybrid-vsock Unix socket and returns the socket,
 * positioned just after the `OK <hostport>\n` line: any bytes that arrived with that line
 * (the agent speaks first, its hello can share a read with the OK) are pushed back into the
 * socket for the protocol reader. Until the guest listens, the backend answers a CONNECT
 * by closing the connection (or, before QEMU has attached, by closing it at accept); those
 * attempts are retried with a short backoff until `timeoutMs`.
 */
export async function connectHybridVsock(udsPath: string, port: number, timeoutMs: number, opts: HybridVsockOptions = {}): Promise<Socket> {
  validatePort(port);
  const deadline = Date.now() + timeoutMs;
  let attempts = 0;
  let lastReason = 'no attempt made';
  for (let delay = 20; ; delay = Math.min(delay * 2, 250)) {
    if (opts.signal?.aborted) throw abortError(opts.signal, udsPath, port);
    attempts++;
    const left = deadline - Date.now();
    const r = await attempt(udsPath, port, Math.max(1, Math.min(left, opts.attemptTimeoutMs ?? 5_000)), opts.signal);
    if (r.socket) return r.socket;
    if (r.fatal) throw r.fatal;
    lastReason = r.reason;
    if (Date.now() + delay >= deadline) {
      throw new HutchError('timeout', `vsock port ${port} behind ${udsPath} did not accept within ${timeoutMs} ms (${attempts} attempts; last: ${lastReason})`, {
        path: udsPath,
        port,
        attempts,
      });
    }
    await new Promise((res) => setTimeout(res, delay));
  }
}

type Attempt = { socket: Socket; fatal?: undefined; reason?: undefined } | { socket?: undefined; fatal?: HutchError; reason: string };

function attempt(udsPath: string, port: number, timeoutMs: number, signal: AbortSignal | undefined): Promise<Attempt> {
  return new Promise((resolve) => {
    const sock = connect(udsPath);
    let buf = Buffer.alloc(0);
    let settled = false;
    const finish = (r: Attempt) => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      signal?.removeEventListener('abort', onAbort);
      // Removing the last 'readable' listener (with no 'data' listener) leaves the stream
      // neither flowing nor explicitly paused, so the protocol reader's on('data') starts it.
      // (An explicit pause() would not be undone by a later on('data').)
      sock.off('readable', onReadable);
      sock.off('connect', onConnect);
      sock.off('error', onError);
      sock.off('close', onClose);
      if (!r.socket) sock.destroy();
      resolve(r);
    };
    const onAbort = () => finish({ fatal: abortError(signal!, udsPath, port), reason: 'aborted' });
    const onConnect = () => sock.write(`CONNECT ${port}\n`);
    const onError = (e: NodeJS.ErrnoException) => finish({ reason: `${e.code ?? e.message}` });
    const onClose = () => finish({ reason: 'closed without a reply (the guest is not listening yet)' });
    const onReadable = () => {
      for (let chunk: Buffer | null; !settled && (chunk = sock.read() as Buffer | null) !== null; ) {
        buf = Buffer.concat([buf, chunk]);
        const nl = buf.indexOf(0x0a);
        if (nl < 0) {
          if (buf.length > MAX_REPLY_LINE) finish({ fatal: protocolError(udsPath, port, buf), reason: 'bad reply' });
          continue;
        }
        const line = buf.subarray(0, nl).toString('latin1');
        if (!/^OK \d+$/.test(line)) {
          // Some VMMs answer a refused CONNECT with a line; treat it like a reset and retry.
          finish({ reason: `answered ${JSON.stringify(line.slice(0, MAX_REPLY_LINE))}` });
          return;
        }
        // Anything after the line (the agent speaks first) belongs to the protocol stream.
        const rest = buf.subarray(nl + 1);
        finish({ socket: sock });
        if (rest.length) sock.unshift(rest);
        return;
      }
    };
    const timer = setTimeout(() => finish({ reason: `no reply within ${timeoutMs} ms` }), timeoutMs);
    signal?.addEventListener('abort', onAbort, { once: true });
    sock.on('connect', onConnect);
    sock.on('error', onError);
    sock.on('close', onClose);
    sock.on('readable', onReadable);
  });
}

function protocolError(udsPath: string, port: number, got: Buffer): HutchError {
  return new HutchError('bad_request', `hybrid vsock ${udsPath}: expected "OK <port>\\n" after CONNECT ${port}, got ${JSON.stringify(got.subarray(0, MAX_REPLY_LINE).toString('latin1'))}`, {
    path: udsPath,
    port,
  });
}

function abortError(signal: AbortSignal, udsPath: string, port: number): HutchError {
  const r: unknown = signal.reason;
  if (r instanceof HutchError) return r;
  return new HutchError('cancelled', `connecting to vsock port ${port} behind ${udsPath} was cancelled${r instanceof Error ? `: ${r.message}` : ''}`, { path: udsPath, port });
}

/**
 * The agent of a VM booted with `channel: { kind: 'vsock' }`, connected and past the
 * handshake (the vsock counterpart of connectAgent in agent-channel.ts). The VM dying
 * first fails the wait with guest_crashed.
 */
export async function connectVsockAgent(vm: Vm, opts: Pick<ConnectAgentOptions, 'timeoutMs' | 'log' | 'deadlines' | 'deadAfterMs'>): Promise<AgentClient> {
  const ch = vm.spec.channel;
  if (ch?.kind !== 'vsock') throw new HutchError('bad_request', `VM ${vm.spec.id} has no vsock channel (it uses ${ch?.kind ?? 'virtio-serial'}); use connectAgent`, { vm: vm.spec.id });
  const died = vm.exited.then((e) => {
    throw new HutchError('guest_crashed', `VM ${vm.spec.id} exited (${e.code ?? e.signal}) before its agent answered; console: ${e.console.slice(-5).join(' | ')}`, { vm: vm.spec.id });
  });
  died.catch(() => undefined);
  const stop = new AbortController();
  died.catch((err: unknown) => stop.abort(err));
  const t0 = Date.now();
  let client: AgentClient | undefined;
  try {
    const sock = await connectHybridVsock(vm.channelPath, ch.port, opts.timeoutMs, { signal: stop.signal });
    client = new AgentClient(sock, {
      log: opts.log.child({ vm: vm.spec.id, channel: 'vsock' }),
      handshakeTimeoutMs: Math.max(1_000, opts.timeoutMs - (Date.now() - t0)),
      // The same deadlines and heartbeat as the virtio-serial channel: a vsock data path
      // that stalls (vhost-device-vsock, README) fails its calls instead of holding them.
      ...(opts.deadlines ? { deadlines: opts.deadlines } : {}),
      ...(opts.deadAfterMs !== undefined ? { deadAfterMs: opts.deadAfterMs } : {}),
    });
    await Promise.race([client.ready(), died]);
    return client;
  } catch (err) {
    client?.close();
    // A guest that never answered: say where its boot got to.
    if (err instanceof HutchError && err.code === 'timeout') {
      throw new HutchError('timeout', `${err.message}; console: ${vm.consoleTail(5).join(' | ') || '(nothing)'}`, { ...err.context, vm: vm.spec.id });
    }
    throw err;
  } finally {
    stop.abort(); // ends the listener on `died`; harmless once connected
  }
}
