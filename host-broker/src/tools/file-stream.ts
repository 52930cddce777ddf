/**
 * Streamed uploads and downloads of workspace files: files of any size up to a limit, in
 * chunks of at most 1 MiB, under credit-based flow control, so no file ever has to fit in one
 * harness frame and no client can make the broker hold more than one window of it.
 *
 * Upload: `upload` opens (the path is confined and the temp file created now, in the target's
 * directory), `uploadChunk` carries the bytes in order (each answered once it is on disk: the
 * answer is the chunk's credit coming back), `uploadCommit` renames the temp file over the
 * path. The file appears whole or not at all: an abort, a refused chunk, an idle timeout or a
 * closed connection removes the temp file (atomic-write.ts does both halves). The workspace
 * quota is checked for every chunk before it is written; the largest file is
 * `maxStreamedFileBytes`, capped by the quota.
 *
 * Download: `download` opens the confined path without following a final symlink and without
 * blocking (a FIFO, device or socket is refused by fstat before any read), then sends
 * `evt` chunks while the client's unacknowledged bytes fit the window, reading each from
 * the fd only when there is room: a slow client holds one window, not the file.
 * `downloadAck` returns credit; the `signal` op cancels.
 *
 * Every stream is bound to the connection, principal and session that opened it; any other
 * use of its id answers not_found, exactly like an id that never existed. Each chunk is read
 * or written on the thread pool (never a synchronous loop over a file), and a connection
 * holds at most `maxStreamsPerConnection` streams, so one tenant's transfer cannot stall
 * another's calls.
 *
 * A committed upload is marked as a host change of the session, as an in-process write is:
 * the session's VM, if awake, gets it pushed before its next call (the host workspace is the
 * source of truth).
 */
import { createHash, randomBytes, type Hash } from 'node:crypto';
import { constants, type Stats } from 'node:fs';
import type { FileHandle } from 'node:fs/promises';
import type { z } from 'zod';
import { HutchError, toHutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import { writeFileAtomic } from '../../../guest-agent/src/workspace/atomic-write.ts';
import type { Workspace } from '../../../guest-agent/src/workspace/confine.ts';
import { closeQuietly, lstatAt, openFileAt, reopenDir, rmdirAt } from '../../../guest-agent/src/workspace/fd-path.ts';
import { OPS, type OpName } from '../api/harness-protocol.ts';
import type { OpContext, WsLimits } from '../api/ws-server.ts';
import type { WorkspaceQuota } from '../sessions/workspace-quota.ts';

/** Largest chunk either way. */
export const STREAM_CHUNK_BYTES = 1024 * 1024;
/** Allocation unit the quota counts in (as workspace-quota.ts). */
const BLOCK = 4096;
const DEFAULT_FILE_MODE = 0o644;
const DEFAULT_DIR_MODE = 0o755;

export const STREAM_OPS = ['upload', 'uploadChunk', 'uploadCommit', 'uploadAbort', 'download', 'downloadAck'] as const;
export type StreamOp = (typeof STREAM_OPS)[number];
export function isStreamOp(op: OpName): op is StreamOp {
  return (STREAM_OPS as readonly string[]).includes(op);
}

/** What a stream needs of a session (sessions/session.ts). */
export interface StreamSession {
  readonly id: string;
  readonly files: { readonly ws: Workspace };
  readonly quota: WorkspaceQuota;
  readonly vm: { readonly hostChanges: { mark(path: string): void } };
  /** Runs a workspace write made outside the session's calls (sessions/workspace-gate.ts). */
  writing<T>(fn: () => Promise<T>): Promise<T>;
}

export type StreamLimits = Pick<WsLimits, 'maxStreamsPerConnection' | 'streamWindowBytes' | 'streamIdleMs' | 'maxStreamedFileBytes'>;

interface Owner {
  principal: string;
  session: StreamSession;
  connection: number;
}

export class FileStreams {
  private readonly uploads = new Map<string, Upload>();
  private readonly downloads = new Map<string, Download>();
  private readonly perConnection = new Map<number, number>();

  constructor(
    private readonly limits: StreamLimits,
    private readonly log: Logger,
  ) {}

  /** Streams open now (tests, metrics). */
  get open(): number {
    return this.uploads.size + this.downloads.size;
  }

  async handle(op: StreamOp, raw: unknown, ctx: OpContext, session: (id: string) => StreamSession): Promise<unknown> {
    switch (op) {
      case 'upload': {
        const p = params('upload', raw);
        const s = session(p.session);
        return this.withSlot(ctx, async (release) => {
          const disconnected = () => void u.fail(new HutchError('cancelled', 'client disconnected'));
          const u: Upload = await Upload.open(s, p, this.limits, { principal: ctx.principal, session: s, connection: ctx.connection.id }, (reason) => {
            this.uploads.delete(u.id);
            ctx.connection.closed.removeEventListener('abort', disconnected);
            release();
            if (reason) this.log.info('stream.upload_dropped', { session: s.id, reason: reason.message });
          });
          // Its temp file may already have failed (in the ticks since open): then it is over.
          if (u.ended) throw u.ended;
          this.uploads.set(u.id, u);
          if (ctx.connection.closed.aborted) disconnected();
          else ctx.connection.closed.addEventListener('abort', disconnected, { once: true });
          return { stream: u.id, window: this.limits.streamWindowBytes, chunkBytes: STREAM_CHUNK_BYTES, maxBytes: u.limit };
        });
      }
      case 'uploadChunk': {
        const p = params('uploadChunk', raw);
        const data = typeof p.data === 'string' ? Buffer.from(p.data, 'base64') : p.data;
        return { received: await this.owned(this.uploads, p.stream, p.session, ctx).chunk(p.offset, data) };
      }
      case 'uploadCommit': {
        const p = params('uploadCommit', raw);
        return this.owned(this.uploads, p.stream, p.session, ctx).commit(p.sha256);
      }
      case 'uploadAbort': {
        const p = params('uploadAbort', raw);
        const u = this.owned(this.uploads, p.stream, p.session, ctx);
        await u.fail(new HutchError('cancelled', 'upload aborted by the client'));
        return { aborted: true };
      }
      case 'download': {
        const p = params('download', raw);
        const s = session(p.session);
        return this.withSlot(ctx, async (release) => {
          const d = await Download.open(s, p.path, this.limits, { principal: ctx.principal, session: s, connection: ctx.connection.id });
          this.downloads.set(d.id, d);
          try {
            return await d.send(ctx);
          } finally {
            this.downloads.delete(d.id);
            release();
          }
        });
      }
      case 'downloadAck': {
        const p = params('downloadAck', raw);
        return { acked: this.owned(this.downloads, p.stream, p.session, ctx).ack(p.bytes) };
      }
    }
  }

  /** Runs `open` holding one of the connection's stream slots; `release` gives it back (once). */
  private async withSlot<T>(ctx: OpContext, open: (release: () => void) => Promise<T>): Promise<T> {
    const conn = ctx.connection.id;
    const n = this.perConnection.get(conn) ?? 0;
    if (n >= this.limits.maxStreamsPerConnection) {
      throw new HutchError('busy', `this connection already has ${n} streamed transfers open (at most ${this.limits.maxStreamsPerConnection}); finish or abort one`, { limit: this.limits.maxStreamsPerConnection });
    }
    this.perConnection.set(conn, n + 1);
    let released = false;
    const release = () => {
      if (released) return;
      released = true;
      const left = (this.perConnection.get(conn) ?? 1) - 1;
      if (left > 0) this.perConnection.set(conn, left);
      else this.perConnection.delete(conn);
    };
    try {
      return await open(release);
    } catch (err) {
      release();
      throw err;
    }
  }

  /** The stream, if this connection, principal and session opened it; otherwise not_found, as for an unknown id. */
  private owned<S extends { owner: Owner }>(streams: Map<string, S>, id: string, session: string, ctx: OpContext): S {
    const s = streams.get(id);
    if (!s || s.owner.principal !== ctx.principal || s.owner.session.id !== session || s.owner.connection !== ctx.connection.id) {
      throw new HutchError('not_found', `no stream ${id} on this connection`, { stream: id });
    }
    return s;
  }
}

function params<O extends StreamOp>(op: O, raw: unknown): z.output<(typeof OPS)[O]> {
  const r = OPS[op].safeParse(raw);
  if (!r.success) throw new HutchError('bad_request', `invalid ${op} params: ${r.error.issues[0]?.path.join('.')}: ${r.error.issues[0]?.message}`, { op });
  return r.data as z.output<(typeof OPS)[O]>;
}

/** The feed of an upload's bytes into writeFileAtomic: each chunk's promise settles once it was written. */
class ChunkFeed implements AsyncIterable<Uint8Array> {
  private readonly queue: Array<{ data: Uint8Array; written: () => void }> = [];
  private taken: (() => void) | undefined;
  private wake: (() => void) | undefined;
  private ended = false;
  private error: Error | undefined;

  /** Resolves once writeFileAtomic has written `data` (it asked for the next chunk, or finished), or the feed failed. */
  push(data: Uint8Array): Promise<void> {
    return new Promise<void>((written) => {
      if (this.error) return written();
      this.queue.push({ data, written });
      this.wake?.();
    });
  }

  end(): void {
    this.ended = true;
    this.wake?.();
  }

  /** Nothing more is written; whoever waits on a chunk is let go (and sees the upload failed). */
  fail(err: Error): void {
    this.error ??= err;
    for (const q of this.queue.splice(0)) q.written();
    this.taken?.();
    this.taken = undefined;
    this.wake?.();
  }

  async *[Symbol.asyncIterator](): AsyncIterator<Uint8Array> {
    for (;;) {
      // The chunk handed out last has been written: writeFileAtomic awaited it before asking again.
      this.taken?.();
      this.taken = undefined;
      if (this.error) throw this.error;
      const next = this.queue.shift();
      if (next) {
        this.taken = next.written;
        yield next.data;
        continue;
      }
      if (this.ended) return;
      await new Promise<void>((r) => (this.wake = r));
      this.wake = undefined;
    }
  }
}

class Upload {
  readonly id = randomBytes(12).toString('base64url');
  /** Bytes accepted (the next chunk's offset). */
  private received = 0;
  /** Bytes received and not yet answered (on their way to disk). */
  private unacked = 0;
  private peakUnacked = 0;
  private readonly hash: Hash = createHash('sha256');
  private readonly feed = new ChunkFeed();
  /** writeFileAtomic: temp file now, rename at the end of the feed, temp removed on failure. */
  private readonly written: Promise<number>;
  /** Chunks and the commit, one after another. */
  private tail: Promise<unknown> = Promise.resolve();
  private timer: NodeJS.Timeout | undefined;
  private failed: HutchError | undefined;
  private done = false;
  private closed = false;

  private constructor(
    readonly owner: Owner,
    private readonly ws: Workspace,
    private readonly quota: WorkspaceQuota,
    /** Own fd on the target's directory (the resolution's are closed). */
    private readonly dirFd: number,
    private readonly name: Buffer,
    private readonly rel: string,
    /** Directories made for this upload, deepest last (removed again if it fails). */
    private readonly madeDirs: string[],
    /** Permission bits, and the owner of the file it replaces (kept, as the write tool keeps it). */
    file: { mode: number; owner: { uid: number; gid: number } | undefined },
    readonly limit: number,
    private readonly size: number | undefined,
    private readonly limits: StreamLimits,
    private readonly onClosed: (reason?: HutchError) => void,
  ) {
    // Not fsynced, as the in-process write tool (the session's FileTools) is not: an fsync of
    // a 100 MiB file measured 6.6 s against 0.9 s without, on this loaded host. Readers still
    // never see a half-written file: the rename is the commit.
    this.written = writeFileAtomic({ dirFd, name }, this.feed, { ...file, durable: false });
    // A temp file that could not be made (or a write that failed) ends the upload now.
    this.written.catch((err: unknown) => void this.fail(toHutchError(err, { path: rel })));
    uploadsOf(owner.session).add(this);
    this.arm();
  }

  static async open(s: StreamSession, p: z.output<typeof OPS.upload>, limits: StreamLimits, owner: Owner, onClosed: (reason?: HutchError) => void): Promise<Upload> {
    const ws = s.files.ws;
    const limit = Math.min(limits.maxStreamedFileBytes, s.quota.limits.bytes);
    if (p.size !== undefined && p.size > limit) throw tooLarge(p.path, p.size, limit);
    await s.quota.current(); // plan() below needs a measured usage
    let dirFd: number | undefined;
    let planned = false;
    const r = ws.open(p.path, { missing: 'parents' });
    try {
      if (r.isRoot || r.stat?.isDirectory()) throw new HutchError('is_a_directory', `${p.path} is a directory`, { path: p.path });
      if (r.stat && !r.stat.isFile()) throw new HutchError('bad_request', `${p.path} is not a regular file`, { path: p.path });
      const newDirs = r.stat ? 0 : Math.max(0, r.missingDepth - 1);
      // The new directories count now (refused before any is made); the file's bytes as they arrive.
      if (newDirs > 0) {
        s.quota.plan({ path: p.path, dirs: newDirs });
        planned = true;
      }
      const parts = r.rel.split('/');
      const madeDirs = Array.from({ length: newDirs }, (_, i) => parts.slice(0, parts.length - 1 - newDirs + i + 1).join('/'));
      r.makeParents(DEFAULT_DIR_MODE, undefined);
      dirFd = reopenDir(r.dirFd);
      // No set-ID bits, whatever the replaced file had (nothing a tenant makes becomes setuid).
      const mode = (p.mode ?? (r.stat ? r.stat.mode : DEFAULT_FILE_MODE)) & 0o777;
      return new Upload(owner, ws, s.quota, dirFd, Buffer.from(r.name), ws.display(r.rel), madeDirs, { mode, owner: r.stat ? { uid: r.stat.uid, gid: r.stat.gid } : undefined }, limit, p.size, limits, onClosed);
    } catch (err) {
      if (dirFd !== undefined) closeQuietly(dirFd);
      if (planned) s.quota.stale(); // planned directories that may not all exist
      throw toHutchError(err, { path: p.path });
    } finally {
      r.close();
    }
  }

  /** Why the upload ended without a file, once it has. */
  get ended(): HutchError | undefined {
    return this.closed ? this.failed : undefined;
  }

  /** Accepts one chunk; resolves with the bytes received so far once it is written (its credit returns). */
  chunk(offset: number, data: Uint8Array): Promise<number> {
    if (this.failed) return Promise.reject(this.failed);
    if (this.done) return Promise.reject(new HutchError('bad_request', 'the upload is already committed', { stream: this.id }));
    // Checked as the chunk arrives, before anything waits: these are the client breaking the protocol.
    if (data.length === 0 || data.length > STREAM_CHUNK_BYTES) {
      return this.refuse(new HutchError('bad_request', `a chunk holds 1 to ${STREAM_CHUNK_BYTES} bytes (got ${data.length})`, { stream: this.id }));
    }
    if (this.unacked + data.length > this.limits.streamWindowBytes) {
      return this.refuse(new HutchError('flow_control', `chunk past the window: ${this.unacked} bytes unacknowledged + ${data.length} > ${this.limits.streamWindowBytes}`, { stream: this.id, window: this.limits.streamWindowBytes }));
    }
    if (offset !== this.received) {
      return this.refuse(new HutchError('bad_request', `chunk at offset ${offset}, expected ${this.received}`, { stream: this.id }));
    }
    if (this.received + data.length > this.limit) return this.refuse(tooLarge(this.rel, this.received + data.length, this.limit));
    this.received += data.length;
    this.unacked += data.length;
    this.peakUnacked = Math.max(this.peakUnacked, this.unacked);
    this.arm();
    const end = this.received;
    return this.serially(async () => {
      await this.checkQuota(end);
      this.hash.update(data);
      await this.feed.push(data);
      if (this.failed) throw this.failed;
      this.unacked -= data.length;
      this.arm(); // a slow disk is not an idle client
      return end;
    });
  }

  async commit(sha256: string | undefined): Promise<unknown> {
    if (this.failed) throw this.failed;
    if (this.done) throw new HutchError('bad_request', 'the upload is already committed', { stream: this.id });
    this.done = true;
    return this.serially(async () => {
      if (this.size !== undefined && this.received !== this.size) {
        throw new HutchError('bad_request', `upload of ${this.rel} ends at ${this.received} bytes; ${this.size} were announced`, { path: this.rel, bytes: this.received, size: this.size });
      }
      const digest = this.hash.digest('hex');
      if (sha256 !== undefined && sha256 !== digest) {
        throw new HutchError('bad_request', `upload of ${this.rel}: sha256 ${digest} does not match the ${sha256} given`, { path: this.rel });
      }
      // Counted like an in-process write (its blocks, less the file it replaces), refused if over.
      await this.quota.current();
      const before = lstatAt(this.dirFd, this.name);
      if (before?.isDirectory()) throw new HutchError('is_a_directory', `${this.rel} is a directory`, { path: this.rel });
      this.quota.plan({ path: this.rel, dirs: 0, file: { bytes: this.received, replaces: before?.isFile() ? before : undefined } });
      try {
        // The rename happens once the feed ends: inside the session's write gate.
        await this.owner.session.writing(async () => {
          this.feed.end();
          await this.written;
        });
      } catch (err) {
        this.quota.stale(); // planned, and not landed
        throw err;
      }
      this.owner.session.vm.hostChanges.mark(this.rel);
      this.close();
      return { path: this.rel, bytes: this.received, created: !before, sha256: digest, peakUnackedBytes: this.peakUnacked };
    });
  }

  /** Ends the upload without a file: the temp file (and directories made for it) removed. */
  async fail(err: HutchError): Promise<void> {
    if (this.failed || this.closed) return;
    this.failed = err;
    this.feed.fail(err);
    await this.written.catch(() => undefined); // the temp file is gone once this settles
    this.removeMadeDirs();
    this.quota.stale();
    this.close(err);
  }

  /** Runs `fn` after every earlier chunk; a failure ends the whole upload. */
  private serially<T>(fn: () => Promise<T>): Promise<T> {
    const run = this.tail.then(() => {
      if (this.failed) throw this.failed;
      return fn();
    });
    this.tail = run.catch(() => undefined);
    return run.catch(async (err: unknown) => {
      const e = toHutchError(err, { path: this.rel });
      await this.fail(e);
      throw e;
    });
  }

  private async refuse(err: HutchError): Promise<never> {
    await this.fail(err);
    throw err;
  }

  /**
   * The session's usage (which does not see temp files) plus every upload's bytes so far in
   * this session, rounded to blocks: above the quota, this chunk is refused before it is
   * written. An in-process write meanwhile is planned against the usage alone, so the
   * workspace can end at most that one write (<= the file limit) above the quota.
   */
  private async checkQuota(end: number): Promise<void> {
    const u = await this.quota.current();
    const uploading = inFlightBytes(this.owner.session, this, end);
    if (u.bytes + uploading > this.quota.limits.bytes) {
      throw this.quota.error('bytes', { ...u, bytes: u.bytes + uploading }, `uploading ${this.rel}`);
    }
  }

  /** (Re)starts the idle timer: an upload with no chunk for streamIdleMs is dropped. */
  private arm(): void {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => void this.fail(new HutchError('timeout', `upload of ${this.rel} idle for ${this.limits.streamIdleMs} ms: dropped`, { stream: this.id })), this.limits.streamIdleMs);
    this.timer.unref();
  }

  private removeMadeDirs(): void {
    for (const rel of [...this.madeDirs].reverse()) {
      try {
        const r = this.ws.open(rel, {});
        try {
          if (r.stat?.isDirectory()) rmdirAt(r.dirFd, r.name);
        } finally {
          r.close();
        }
      } catch {
        // no longer empty, or gone: leave it
      }
    }
  }

  private close(reason?: HutchError): void {
    if (this.closed) return;
    this.closed = true;
    clearTimeout(this.timer);
    this.timer = undefined;
    closeQuietly(this.dirFd);
    uploadsOf(this.owner.session).delete(this);
    this.onClosed(reason);
  }

  /** Bytes this upload holds on disk so far, in blocks. */
  allocated(end = this.received): number {
    return Math.ceil(end / BLOCK) * BLOCK;
  }
}

const bySession = new WeakMap<StreamSession, Set<Upload>>();
function uploadsOf(s: StreamSession): Set<Upload> {
  let set = bySession.get(s);
  if (!set) bySession.set(s, (set = new Set()));
  return set;
}
/** Every upload of the session, `self` counted at `end`. */
function inFlightBytes(s: StreamSession, self: Upload, end: number): number {
  let n = self.allocated(end);
  for (const u of uploadsOf(s)) if (u !== self) n += u.allocated();
  return n;
}

class Download {
  readonly id = randomBytes(12).toString('base64url');
  private sent = 0;
  private acked = 0;
  private peakUnacked = 0;
  private wake: (() => void) | undefined;
  /** The client broke the protocol (acknowledged more than was sent): the download ends. */
  private violation: HutchError | undefined;

  private constructor(
    readonly owner: Owner,
    private readonly fh: FileHandle,
    private readonly rel: string,
    private readonly size: number,
    private readonly limits: StreamLimits,
  ) {}

  static async open(s: StreamSession, path: string, limits: StreamLimits, owner: Owner): Promise<Download> {
    const ws = s.files.ws;
    const r = ws.open(path, { followFinal: true });
    let fh: FileHandle | undefined;
    try {
      if (!r.stat) throw new HutchError('not_found', `no such file: ${path}`, { path });
      if (r.isRoot || r.stat.isDirectory()) throw new HutchError('is_a_directory', `${path} is a directory`, { path });
      if (!r.stat.isFile()) throw new HutchError('unsupported_file_type', `${path} is not a regular file (a FIFO, socket or device is never read)`, { path });
      const ino = r.stat.ino;
      // O_NONBLOCK: were it swapped for a FIFO since the lstat, opening cannot block; fstat then refuses it.
      fh = await openFileAt(r.dirFd, r.name, constants.O_RDONLY | constants.O_NONBLOCK);
      const st: Stats = await fh.stat();
      if (!st.isFile() || st.ino !== ino) throw new HutchError('bad_request', `${path} changed while being opened`, { path });
      const limit = limits.maxStreamedFileBytes;
      if (st.size > limit) throw tooLarge(path, st.size, limit);
      return new Download(owner, fh, ws.display(r.rel), st.size, limits);
    } catch (err) {
      await fh?.close().catch(() => undefined);
      throw toHutchError(err, { path });
    } finally {
      r.close();
    }
  }

  /** Sends the file as `evt` chunks within the window; resolves when all were sent. */
  async send(ctx: OpContext): Promise<{ bytes: number; sha256: string; peakUnackedBytes: number }> {
    const hash = createHash('sha256');
    const window = this.limits.streamWindowBytes;
    const onAbort = () => this.wake?.();
    ctx.signal.addEventListener('abort', onAbort, { once: true });
    try {
      ctx.event({ stream: this.id, size: this.size, window, chunkBytes: STREAM_CHUNK_BYTES });
      while (this.sent < this.size) {
        const want = Math.min(STREAM_CHUNK_BYTES, this.size - this.sent, window);
        await this.room(want, ctx.signal);
        const buf = Buffer.allocUnsafe(want);
        const { bytesRead } = await this.fh.read(buf, 0, want, this.sent);
        if (bytesRead === 0) break; // shrank since the fstat: what there was is sent
        const data = buf.subarray(0, bytesRead);
        hash.update(data);
        ctx.event({ offset: this.sent, data: ctx.binary ? data : data.toString('base64') });
        this.sent += bytesRead;
        this.peakUnacked = Math.max(this.peakUnacked, this.sent - this.acked);
      }
      return { bytes: this.sent, sha256: hash.digest('hex'), peakUnackedBytes: this.peakUnacked };
    } finally {
      ctx.signal.removeEventListener('abort', onAbort);
      await this.fh.close().catch(() => undefined);
    }
  }

  /** Cumulative acknowledgement: credit for everything up to `bytes`. */
  ack(bytes: number): number {
    if (bytes > this.sent) {
      this.violation ??= new HutchError('flow_control', `acknowledged ${bytes} bytes of ${this.sent} sent`, { stream: this.id });
      this.wake?.();
      throw this.violation;
    }
    if (bytes > this.acked) this.acked = bytes;
    this.wake?.();
    return this.acked;
  }

  /** Waits until `n` more bytes fit the window; a client silent for streamIdleMs, or a cancel, ends the download. */
  private async room(n: number, signal: AbortSignal): Promise<void> {
    const window = this.limits.streamWindowBytes;
    while (this.sent - this.acked + n > window) {
      if (this.violation) throw this.violation;
      if (signal.aborted) throw toHutchError(signal.reason ?? new HutchError('cancelled', 'download cancelled'));
      let timer: NodeJS.Timeout | undefined;
      const idle = await new Promise<boolean>((resolve) => {
        this.wake = () => resolve(false);
        timer = setTimeout(() => resolve(true), this.limits.streamIdleMs);
      });
      clearTimeout(timer);
      this.wake = undefined;
      if (idle) throw new HutchError('timeout', `download of ${this.rel}: no acknowledgement for ${this.limits.streamIdleMs} ms`, { stream: this.id });
    }
    if (signal.aborted) throw toHutchError(signal.reason ?? new HutchError('cancelled', 'download cancelled'));
  }
}

function tooLarge(path: string, bytes: number, limit: number): HutchError {
  return new HutchError('too_large', `${path}: ${bytes} bytes is above the streamed file limit of ${limit} bytes (the broker's maxStreamedFileBytes, capped by the workspace quota)`, { path, bytes, limit });
}
