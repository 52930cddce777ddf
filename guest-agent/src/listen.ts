import { createServer, Socket, type Server } from 'node:net';
import { spawn } from 'node:child_process';
import { chmodSync, closeSync, open as fsOpen, read as fsRead, readdirSync, readFileSync, rmSync } from 'node:fs';
import { Duplex } from 'node:stream';
import { HutchError } from './protocol/errors.ts';
import type { Logger } from './log.ts';

/**
 * Where the agent listens for its broker:
 *   unix:PATH   a Unix socket (tests, and the local backend); mode 0600 so only root connects
 *   vport:NAME  a virtio-serial port found by name under /sys/class/virtio-ports (QEMU VMs)
 *   vsock:PORT  AF_VSOCK (Firecracker's hybrid vsock). Node has no AF_VSOCK sockets, so socat
 *               (Debian-packaged, VSOCK-LISTEN since 1.7.4) accepts on the port and relays each
 *               connection to a private Unix socket of the agent; one small process and one copy,
 *               no native addon to build into the read-only rootfs.
 */
export type ListenSpec = { kind: 'unix'; path: string } | { kind: 'vport'; name: string } | { kind: 'vsock'; port: number };

export function parseListenSpec(s: string): ListenSpec {
  const i = s.indexOf(':');
  const kind = i < 0 ? s : s.slice(0, i);
  const arg = i < 0 ? '' : s.slice(i + 1);
  if (kind === 'unix' && arg) return { kind, path: arg };
  if (kind === 'vport' && arg) return { kind, name: arg };
  if (kind === 'vsock' && /^\d+$/.test(arg) && Number(arg) > 0 && Number(arg) < 2 ** 32) return { kind, port: Number(arg) };
  throw new HutchError('bad_request', `bad --listen value ${JSON.stringify(s)}: expected unix:PATH, vport:NAME or vsock:PORT`);
}

export interface Listener {
  close(): Promise<void>;
}

export async function listenUnix(path: string, onConnection: (s: Duplex) => void): Promise<Listener & { server: Server }> {
  rmSync(path, { force: true });
  const server = createServer((sock) => onConnection(sock));
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(path, () => resolve());
  });
  chmodSync(path, 0o600);
  return {
    server,
    close: () =>
      new Promise<void>((resolve) => {
        server.close(() => resolve());
        rmSync(path, { force: true });
      }),
  };
}

/** Finds /dev/vportNpM whose port name is `name`. */
export function findVirtioPort(name: string, sysDir = '/sys/class/virtio-ports'): string {
  let ports: string[] = [];
  try {
    ports = readdirSync(sysDir);
  } catch {
    throw new HutchError('not_found', `no virtio-serial ports: ${sysDir} is missing (is virtio_console in the kernel?)`);
  }
  for (const p of ports) {
    try {
      if (readFileSync(`${sysDir}/${p}/name`, 'utf8').trim() === name) return `/dev/${p}`;
    } catch {
      // port without a name
    }
  }
  throw new HutchError('not_found', `no virtio-serial port named ${name} (found ${ports.join(', ') || 'none'})`);
}

/**
 * A virtio-serial port as a duplex, once a host (the broker) is attached to it.
 *
 * How a port behaves (drivers/char/virtio_console.c), and so why this is shaped as it is:
 *  - only one open at a time: open() fails with EBUSY until the previous file is released,
 *    and a file is only released when no read()/write() is still blocked on it;
 *  - while no host is attached, read() returns 0 at once (it looks like end-of-file) and a
 *    blocking write() waits until a host attaches; poll() then reports POLLHUP;
 *  - when the host detaches, a blocked read() returns 0.
 * Reading a blocking fd on the threadpool therefore saw "end of file" as soon as the agent
 * started if no broker was attached yet (the agent then reopened, got EBUSY because nothing
 * had closed the fd, and exited), and a write issued after the host left stayed blocked,
 * pinning the file (EBUSY again) and later delivering stale bytes to the next broker.
 *
 * So: wait for the host's first bytes with a blocking read, retried with a short backoff
 * while read() says nobody is attached (the broker speaks first: its hello); then hand the
 * fd to libuv as a stream. Node's net.Socket refuses character devices, so the Pipe handle
 * is created directly (uv_pipe_open takes any pollable fd): reads and writes are then
 * non-blocking and epoll-driven (no threadpool thread parked per port), the host detaching
 * is an ordinary EOF, and closing the socket cancels queued writes and closes the fd at once,
 * so the next open succeeds.
 */
export async function openVirtioPort(device: string): Promise<Duplex> {
  const fd = await openPortExclusive(device);
  let first: Buffer;
  try {
    first = await awaitHostBytes(fd);
  } catch (err) {
    closeSync(fd);
    throw err;
  }
  let sock: Socket;
  try {
    sock = socketOnFd(fd);
  } catch (err) {
    closeSync(fd);
    throw new HutchError('internal', `cannot stream ${device}: ${(err as Error).message}`, { device });
  }
  sock.unshift(first);
  return sock;
}

/** open(O_RDWR), retrying EBUSY for a while: the previous connection's file may still be closing. */
async function openPortExclusive(device: string, giveUpMs = 10_000): Promise<number> {
  const started = Date.now();
  for (let delay = 10; ; delay = Math.min(delay * 2, 500)) {
    try {
      return await new Promise<number>((resolve, reject) => fsOpen(device, 'r+', (err, fd) => (err ? reject(err) : resolve(fd))));
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code;
      if (code !== 'EBUSY' || Date.now() - started > giveUpMs) {
        throw new HutchError(code === 'ENOENT' ? 'not_found' : 'unavailable', `cannot open ${device}: ${(err as Error).message}`, { device });
      }
      await new Promise((r) => setTimeout(r, delay));
    }
  }
}

/** Blocks (on the threadpool) until the host sends something; read() == 0 means no host yet. */
async function awaitHostBytes(fd: number): Promise<Buffer> {
  const buf = Buffer.allocUnsafe(64 * 1024);
  // Short steps: after a restore the broker is already attached and every step is wake latency.
  for (let delay = 2; ; delay = Math.min(delay * 2, 16)) {
    const n = await new Promise<number>((resolve, reject) => fsRead(fd, buf, 0, buf.length, null, (err, bytes) => (err ? reject(err) : resolve(bytes))));
    if (n > 0) return Buffer.from(buf.subarray(0, n));
    await new Promise((r) => setTimeout(r, delay));
  }
}

interface PipeBinding {
  Pipe: new (type: number) => { open(fd: number): number | undefined };
  constants: { SOCKET: number };
}

/** A net.Socket on an arbitrary pollable fd (see openVirtioPort for why not `new Socket({ fd })`). */
function socketOnFd(fd: number): Socket {
  const binding = (process as unknown as { binding(name: string): unknown }).binding('pipe_wrap') as PipeBinding;
  const handle = new binding.Pipe(binding.constants.SOCKET);
  const err = handle.open(fd);
  if (typeof err === 'number' && err !== 0) throw new Error(`uv_pipe_open failed (${err})`);
  return new Socket({ handle, readable: true, writable: true } as ConstructorParameters<typeof Socket>[0]);
}

export async function listenVsock(port: number, privateSocket: string, onConnection: (s: Duplex) => void, log: Logger): Promise<Listener> {
  const unix = await listenUnix(privateSocket, onConnection);
  const socat = spawn('socat', [`VSOCK-LISTEN:${port},reuseaddr,fork`, `UNIX-CONNECT:${privateSocket}`], { stdio: ['ignore', 'ignore', 'pipe'] });
  socat.stderr?.on('data', (d: Buffer) => log.warn('agent.socat', { line: d.toString().trim() }));
  await new Promise<void>((resolve, reject) => {
    socat.once('error', (e: NodeJS.ErrnoException) =>
      reject(new HutchError('unavailable', e.code === 'ENOENT' ? 'vsock listening needs socat, which is not installed' : `socat failed: ${e.message}`)),
    );
    socat.once('spawn', () => resolve());
  });
  socat.once('exit', (code, sig) => log.error('agent.socat_exited', { code, signal: sig }));
  return {
    close: async () => {
      socat.kill();
      await unix.close();
    },
  };
}
