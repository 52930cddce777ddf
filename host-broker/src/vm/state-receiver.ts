import { chownSync, createWriteStream, mkdtempSync, rmSync, statSync } from 'node:fs';
import { createServer, type Server, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';

/**
 * Where a snapshot's state goes: a Unix socket the broker listens on, which QEMU connects
 * to (`migrate unix:...`) and streams into, and the broker writes to the state file.
 *
 * A jailed QEMU (qemu-jail.ts) runs as a user id that owns no file and may start no
 * process, and QEMU 7.2 writes an outgoing migration only to a socket, a command, or a
 * descriptor sent over QMP (which Node cannot send). So the socket lives in a fresh 0700
 * directory under the temp dir owned by that VM's id: QEMU can reach it, no other VM's id
 * or host user can, and the state file itself is written by the broker where QEMU could
 * never open it.
 */
export interface StateReceiver {
  /** The migration URI to give QEMU. */
  readonly uri: string;
  /** Bytes written once QEMU has closed the stream and the file holds all of it. */
  readonly done: Promise<number>;
  /** Stops listening and removes the socket's directory (after done, or to give up). */
  close(): void;
}

export interface StateReceiverLimits {
  /** The stream must have ended by then. */
  timeoutMs: number;
  /**
   * The most a snapshot of this VM can be (its RAM and device state): a QEMU that sends
   * more is no longer ours, and the partial file goes before it fills the disk.
   */
  maxBytes: number;
}

export async function openStateReceiver(stateFile: string, uid: number | undefined, vm: string, limits: StateReceiverLimits): Promise<StateReceiver> {
  const { timeoutMs, maxBytes } = limits;
  if (uid !== undefined) assertSearchable(tmpdir(), vm);
  const dir = mkdtempSync(join(tmpdir(), 'hutch-state-'));
  const path = join(dir, 's');
  let server: Server | undefined;
  let conn: Socket | undefined;
  let timer: NodeJS.Timeout | undefined;
  const close = () => {
    clearTimeout(timer);
    server?.close();
    conn?.destroy();
    rmSync(dir, { recursive: true, force: true });
  };
  try {
    if (uid !== undefined) chownSync(dir, uid, uid);
    const srv = createServer();
    server = srv;
    await new Promise<void>((resolve, reject) => {
      srv.once('error', reject);
      srv.listen(path, () => resolve());
    });
    if (uid !== undefined) chownSync(path, uid, uid);
  } catch (err) {
    close();
    throw new HutchError('internal', `cannot open the snapshot socket of VM ${vm}: ${(err as Error).message}`, { vm });
  }
  const srv = server;
  const done = new Promise<number>((resolve, reject) => {
    timer = setTimeout(() => {
      reject(new HutchError('timeout', `the snapshot stream of VM ${vm} did not end within ${timeoutMs} ms`, { vm, timeoutMs }));
      close();
    }, timeoutMs);
    srv.once('connection', (c) => {
      // One stream per snapshot: whoever else could reach the directory gets nothing.
      srv.close();
      conn = c;
      const out = createWriteStream(stateFile, { mode: 0o600 });
      let received = 0;
      const cap = new Transform({
        transform(chunk: Buffer, _enc, cb) {
          received += chunk.length;
          if (received > maxBytes) cb(new HutchError('too_large', `the snapshot stream of VM ${vm} passed ${maxBytes} bytes, more than the VM holds`, { vm, limit: maxBytes }));
          else cb(null, chunk);
        },
      });
      pipeline(c, cap, out)
        .then(() => resolve(out.bytesWritten))
        .catch((err: Error) => {
          if (err instanceof HutchError && err.code === 'too_large') {
            // Past the VM's size: what was written is no snapshot, and it holds disk.
            rmSync(stateFile, { force: true });
            reject(err);
          } else reject(new HutchError('internal', `writing the snapshot state of VM ${vm} to ${stateFile}: ${err.message}`, { vm }));
        });
    });
  });
  done.catch(() => undefined); // the caller awaits it only once the migration completed
  return { uri: `unix:${path}`, done, close };
}

/**
 * A jailed QEMU reaches the socket only if every directory above it lets others search it
 * (a TMPDIR under /root would not): say so, instead of a snapshot that fails with EACCES.
 */
function assertSearchable(dir: string, vm: string): void {
  for (let d = dir; ; d = dirname(d)) {
    if ((statSync(d).mode & 0o001) === 0) {
      throw new HutchError('internal', `cannot snapshot VM ${vm}: its QEMU runs as its own user and cannot search ${d} on the way to the temp dir ${dir}; point TMPDIR at a directory others may search (such as /tmp)`, { vm, dir: d });
    }
    if (dirname(d) === d) return;
  }
}
