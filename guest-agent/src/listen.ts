import { createServer, type Server } from 'node:net';
import { spawn } from 'node:child_process';
import { chmodSync, promises as fsp, readdirSync, readFileSync, rmSync } from 'node:fs';
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
 * A virtio-serial port as a duplex. Node's net.Socket refuses character devices, so reads
 * go through a FileHandle stream (one threadpool thread blocked in read(2)) and writes
 * through the same handle.
 */
export async function openVirtioPort(device: string): Promise<Duplex> {
  const fh = await fsp.open(device, 'r+');
  const readable = fh.createReadStream({ highWaterMark: 256 * 1024, autoClose: false });
  let writing: Promise<unknown> = Promise.resolve();
  const duplex = new Duplex({
    read() {
      readable.resume();
    },
    write(chunk: Buffer, _enc, cb) {
      writing = writing.then(() => fh.write(chunk)).then(
        () => cb(),
        (err: Error) => cb(err),
      );
    },
    final(cb) {
      cb();
    },
    destroy(err, cb) {
      readable.destroy();
      void fh.close().catch(() => undefined);
      cb(err);
    },
  });
  readable.on('data', (c) => {
    if (!duplex.push(c)) readable.pause();
  });
  readable.on('end', () => duplex.push(null));
  readable.on('error', (e) => duplex.destroy(e));
  return duplex;
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
