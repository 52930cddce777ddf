import { connect, type Socket } from 'node:net';
import { EventEmitter } from 'node:events';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { boundedLines } from '../util/bounded-lines.ts';

/**
 * A QEMU Machine Protocol client: JSON lines over QEMU's QMP Unix socket. Commands are
 * answered in order, so replies are matched FIFO; asynchronous events (MIGRATION, STOP,
 * SHUTDOWN, ...) are emitted as 'event'.
 */
/** Longest QMP message taken: QEMU's answers to hutch's commands are a few KiB. */
export const QMP_MAX_LINE_BYTES = 1024 * 1024;
/** A QMP command's deadline: QEMU answers control commands at once unless it is stopped or wedged. */
const QMP_COMMAND_TIMEOUT_MS = 30_000;

export class QmpClient extends EventEmitter {
  private readonly queue: Array<{ cmd: string; resolve: (r: unknown) => void; reject: (e: HutchError) => void }> = [];
  private closed = false;

  private constructor(private readonly sock: Socket) {
    super();
    // A QEMU that is no longer ours (a guest escaped into it) may write without end: a
    // message past the limit ends the connection, so the VM is torn down by its owner.
    boundedLines(
      sock,
      QMP_MAX_LINE_BYTES,
      (line, cut) => {
        if (!cut) this.onLine(line);
      },
      () => this.fail(new HutchError('guest_crashed', `QEMU sent a QMP message over ${QMP_MAX_LINE_BYTES} bytes`, { limit: QMP_MAX_LINE_BYTES })),
    );
    sock.on('close', () => {
      this.closed = true;
      for (const q of this.queue.splice(0)) q.reject(new HutchError('guest_crashed', `QMP connection closed during ${q.cmd}`));
      this.emit('close');
    });
    sock.on('error', () => undefined);
  }

  static async connect(path: string, timeoutMs = 10_000): Promise<QmpClient> {
    const sock = connect(path);
    await new Promise<void>((resolve, reject) => {
      const t = setTimeout(() => reject(new HutchError('timeout', `QMP at ${path} did not connect in ${timeoutMs} ms`)), timeoutMs);
      sock.once('connect', () => (clearTimeout(t), resolve()));
      sock.once('error', (e) => (clearTimeout(t), reject(new HutchError('unavailable', `QMP connect ${path}: ${e.message}`))));
    });
    const c = new QmpClient(sock);
    // The greeting arrives first and answers no command; capabilities negotiation follows.
    // Bounded and ended by a close: QEMU serves one monitor client at a time, and a socket
    // that was accepted and then closed without a greeting used to leave this await pending
    // forever with nothing left to time it out (a restarted broker's wake hung on it).
    try {
      await new Promise<void>((resolve, reject) => {
        const t = setTimeout(() => done(new HutchError('timeout', `QMP at ${path} sent no greeting in ${timeoutMs} ms`)), timeoutMs);
        const onClose = () => done(new HutchError('unavailable', `QMP at ${path} closed before its greeting`));
        const onGreeting = () => done();
        const done = (err?: HutchError) => {
          clearTimeout(t);
          c.off('close', onClose);
          c.off('greeting', onGreeting);
          if (err) reject(err);
          else resolve();
        };
        c.once('greeting', onGreeting);
        c.once('close', onClose);
        if (c.closed) onClose();
      });
    } catch (err) {
      c.close();
      throw err;
    }
    await c.execute('qmp_capabilities');
    return c;
  }

  /**
   * Runs a QMP command. QMP answers in order, so a command that gets no answer by its
   * deadline (a stopped or wedged QEMU) ends the whole connection: every waiting command
   * fails with `guest_unresponsive` and nothing later can be matched to the wrong one.
   * The VM is then beyond control and is torn down by its owner.
   */
  execute<T = unknown>(cmd: string, args?: Record<string, unknown>, timeoutMs = QMP_COMMAND_TIMEOUT_MS): Promise<T> {
    if (this.closed) return Promise.reject(new HutchError('guest_crashed', `QMP is closed; cannot run ${cmd}`));
    return new Promise<T>((resolve, reject) => {
      const t = setTimeout(() => {
        const err = new HutchError('guest_unresponsive', `QEMU did not answer QMP ${cmd} within ${timeoutMs} ms`, { cmd, timeoutMs });
        for (const q of this.queue.splice(0)) q.reject(err);
        this.sock.destroy();
      }, timeoutMs);
      t.unref();
      this.queue.push({
        cmd,
        resolve: (r) => {
          clearTimeout(t);
          (resolve as (r: unknown) => void)(r);
        },
        reject: (e) => {
          clearTimeout(t);
          reject(e);
        },
      });
      this.sock.write(JSON.stringify(args ? { execute: cmd, arguments: args } : { execute: cmd }) + '\n');
    });
  }

  /** Resolves on the first event named `name` for which `match` holds. */
  waitEvent(name: string, match: (data: Record<string, unknown>) => boolean = () => true, timeoutMs = 60_000): Promise<Record<string, unknown>> {
    return new Promise((resolve, reject) => {
      const t = setTimeout(() => {
        this.off('event', on);
        reject(new HutchError('timeout', `no QMP ${name} event within ${timeoutMs} ms`));
      }, timeoutMs);
      const on = (ev: string, data: Record<string, unknown>) => {
        if (ev !== name || !match(data)) return;
        clearTimeout(t);
        this.off('event', on);
        this.off('close', onClose);
        resolve(data);
      };
      // A QEMU that dies sends no more events: fail now, not at the timeout.
      const onClose = () => {
        clearTimeout(t);
        this.off('event', on);
        reject(new HutchError('guest_crashed', `QMP connection closed while waiting for ${name}`));
      };
      this.on('event', on);
      if (this.closed) onClose();
      else this.once('close', onClose);
    });
  }

  close(): void {
    this.sock.destroy();
  }

  private fail(err: HutchError): void {
    for (const q of this.queue.splice(0)) q.reject(err);
    this.sock.destroy();
  }

  private onLine(line: string): void {
    let msg: Record<string, unknown>;
    try {
      msg = JSON.parse(line) as Record<string, unknown>;
    } catch {
      return;
    }
    if ('QMP' in msg) {
      this.emit('greeting', msg);
      return;
    }
    if ('event' in msg) {
      this.emit('event', msg['event'], (msg['data'] ?? {}) as Record<string, unknown>);
      return;
    }
    const q = this.queue.shift();
    if (!q) return;
    if ('error' in msg) {
      const e = msg['error'] as { class?: string; desc?: string };
      q.reject(new HutchError('internal', `QMP ${q.cmd} failed: ${e.desc ?? e.class ?? 'unknown error'}`, { qmpClass: e.class }));
    } else q.resolve(msg['return']);
  }
}
