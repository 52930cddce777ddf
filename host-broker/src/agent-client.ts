import { connect } from 'node:net';
import type { Duplex } from 'node:stream';
import { Connection, OUTPUT_BACKLOG_BYTES, type RequestOptions } from '../../guest-agent/src/protocol/connection.ts';
import { HutchError } from '../../guest-agent/src/protocol/errors.ts';
import type { Hello } from '../../guest-agent/src/protocol/messages.ts';
import type { ExecResult, MethodName, ParamsOf, ResultOf, SyncChange, SignalSchema } from '../../guest-agent/src/protocol/methods.ts';
import { SYNC_RECORD_MAX_BYTES, SyncChangesBatchSchema, type SyncChangesBatch } from '../../guest-agent/src/protocol/methods.ts';
import { FrameDecoder } from '../../guest-agent/src/protocol/frame-codec.ts';
import { GUEST_LOOP_SHARE } from '../../guest-agent/src/protocol/loop-share.ts';
import { GUEST_FRAME_SHAPE_LIMITS, type ShapeLimits } from '../../guest-agent/src/protocol/value-shape.ts';
import { nameToBytes } from '../../guest-agent/src/workspace/names.ts';
import type { InboundStream } from '../../guest-agent/src/protocol/flow-control.ts';
import { noopLogger, type Logger } from '../../guest-agent/src/log.ts';
import type { z } from 'zod';
import { deadlineFor, execDeadline, type DeadlinePolicy } from './deadlines.ts';
import { streamDuplex } from '../../guest-agent/src/protocol/stream-duplex.ts';
import type { Handler } from '../../guest-agent/src/protocol/connection.ts';
import { answerRefusal } from './network/proxy-connection.ts';
import type { SandboxNetwork } from './network/sandbox-network.ts';

export interface AgentClientOptions {
  log?: Logger;
  maxFrameBytes?: number;
  windowBytes?: number;
  handshakeTimeoutMs?: number;
  /** Resend hello until answered (device channels that may drop bytes while the guest reopens them). */
  resendHelloMs?: number;
  /**
   * Deadlines for every guest RPC (deadlines.ts): past one the call fails with
   * `guest_unresponsive`. With them comes a heartbeat: a guest that sends nothing for
   * `deadAfterMs` while calls wait fails them all at once. Absent: no deadlines (tests of
   * the protocol itself).
   */
  deadlines?: DeadlinePolicy;
  heartbeatMs?: number;
  deadAfterMs?: number;
  /**
   * The broker's guards against a guest that is no longer ours (a tenant with root in it):
   * each frame and sync record shape-checked before it is decoded (GUEST_FRAME_SHAPE_LIMITS),
   * reading it held to its share of the loop (GUEST_LOOP_SHARE), and stopped while
   * OUTPUT_BACKLOG_BYTES of answers wait for it to read them. Default on; false only for
   * the previous behaviour in benches' baselines.
   */
  guestGuards?: boolean;
}

export interface ExecRequest {
  argv?: string[];
  command?: string;
  cwd?: string;
  env?: Record<string, string>;
  /** Bytes for stdin, or an iterable streamed with flow control. */
  stdin?: Uint8Array | AsyncIterable<Uint8Array>;
  timeoutMs?: number;
  maxOutputBytes?: number;
  onStdout?: (chunk: Uint8Array) => void | Promise<void>;
  onStderr?: (chunk: Uint8Array) => void | Promise<void>;
  signal?: AbortSignal;
  /** Receives the function that sends the running command a signal. */
  onSignalable?: (send: (sig: z.infer<typeof SignalSchema>) => Promise<boolean>) => void;
}

export interface ExecHandle {
  /** Request id, usable with signal(). */
  readonly call: number;
  readonly result: Promise<ExecResult>;
  signal(sig: z.infer<typeof SignalSchema>): Promise<boolean>;
}

/** The agent's own default exec timeout (guest-agent main.ts --timeout-ms). */
const DEFAULT_AGENT_EXEC_TIMEOUT_MS = 600_000;
/** Bytes allowed per streamed file in a sync deadline (the heartbeat catches a dead guest sooner). */
const STREAMED_FILE_ALLOWANCE = 8 * 1024 * 1024;

/**
 * The broker's client for any guest agent (a VM's virtio-serial port, a vsock, or a Unix
 * socket of the local backend). Thin typed wrappers over one Connection.
 */
export class AgentClient {
  readonly connection: Connection;

  constructor(socket: Duplex, opts: AgentClientOptions = {}) {
    const guarded = opts.guestGuards !== false;
    this.frameShape = guarded ? GUEST_FRAME_SHAPE_LIMITS : undefined;
    this.connection = new Connection(socket, {
      role: 'broker',
      // The only requests a guest may make of the broker: connections out through the egress proxy.
      handlers: { 'net.open': this.onNetOpen },
      log: opts.log ?? noopLogger,
      // What a guest sends is decoded on the loop every session shares.
      ...(guarded ? { frameShape: GUEST_FRAME_SHAPE_LIMITS, loopShare: GUEST_LOOP_SHARE, maxOutputBacklogBytes: OUTPUT_BACKLOG_BYTES } : {}),
      ...(opts.maxFrameBytes !== undefined ? { maxFrameBytes: opts.maxFrameBytes } : {}),
      ...(opts.windowBytes !== undefined ? { windowBytes: opts.windowBytes } : {}),
      ...(opts.handshakeTimeoutMs !== undefined ? { handshakeTimeoutMs: opts.handshakeTimeoutMs } : {}),
      ...(opts.resendHelloMs !== undefined ? { resendHelloMs: opts.resendHelloMs } : {}),
      ...(opts.deadlines
        ? {
            defaultDeadline: (method: MethodName, params: unknown, streams: number) => this.deadline(method, params, streams, opts.deadlines as DeadlinePolicy),
            defaultDeadlineCode: 'guest_unresponsive' as const,
            heartbeatMs: opts.heartbeatMs ?? 2000,
            deadAfterMs: opts.deadAfterMs ?? 20_000 * opts.deadlines.scale,
          }
        : {}),
    });
    this.policy = opts.deadlines;
  }

  /** The shape check of the guest's frames, for its sync records too (undefined: unguarded). */
  private readonly frameShape: ShapeLimits | undefined;

  private readonly policy: DeadlinePolicy | undefined;
  /** Entries the guest's workspace holds (from the last sync.mark): scans are sized by it. */
  workspaceEntries = 0;

  private deadline(method: MethodName, params: unknown, streams: number, policy: DeadlinePolicy): number | undefined {
    if (method === 'exec') {
      const t = (params as { timeoutMs?: number }).timeoutMs ?? DEFAULT_AGENT_EXEC_TIMEOUT_MS;
      return execDeadline(t, policy);
    }
    let bytes = 0;
    if (method === 'sync.apply') {
      for (const c of (params as { changes?: Array<{ data?: Uint8Array }> }).changes ?? []) bytes += c.data?.length ?? 0;
      bytes += streams * STREAMED_FILE_ALLOWANCE;
    }
    if (method === 'sync.read') bytes += STREAMED_FILE_ALLOWANCE;
    // A sync.apply that marks may scan /work after applying.
    const scans = method === 'sync.mark' || method === 'sync.changes' || method === 'agent.state' || (method === 'sync.apply' && (params as { mark?: boolean }).mark === true);
    return deadlineFor(method, { bytes, ...(scans ? { entries: this.workspaceEntries } : {}) }, policy);
  }

  static async connectUnix(path: string, opts: AgentClientOptions = {}): Promise<AgentClient> {
    const sock = connect(path);
    await new Promise<void>((resolve, reject) => {
      sock.once('connect', resolve);
      sock.once('error', (e: NodeJS.ErrnoException) => reject(new HutchError('unavailable', `cannot connect to agent at ${path}: ${e.code ?? e.message}`, { path })));
    });
    const client = new AgentClient(sock, opts);
    await client.ready();
    return client;
  }

  ready(): Promise<Hello> {
    return this.connection.ready;
  }

  get capabilities(): Record<string, unknown> {
    return this.connection.peer?.caps ?? {};
  }

  call<M extends Exclude<MethodName, 'exec' | 'sync.read' | 'sync.changes' | 'debug.echo'>>(method: M, params: ParamsOf<M>, opts?: RequestOptions): Promise<ResultOf<M>> {
    return this.connection.request(method, params, opts);
  }

  exec(req: ExecRequest): ExecHandle {
    const conn = this.connection;
    const stdout = conn.openInbound();
    const stderr = conn.openInbound();
    const stdin = req.stdin !== undefined ? conn.openOutbound() : undefined;
    const streams = [stdout.id, stderr.id, ...(stdin ? [stdin.id] : [])];
    const params: ParamsOf<'exec'> = {
      stdout: stdout.id,
      stderr: stderr.id,
      ...(req.argv ? { argv: req.argv } : {}),
      ...(req.command !== undefined ? { command: req.command } : {}),
      ...(req.cwd !== undefined ? { cwd: req.cwd } : {}),
      ...(req.env ? { env: req.env } : {}),
      ...(stdin ? { stdin: stdin.id } : {}),
      ...(req.timeoutMs !== undefined ? { timeoutMs: req.timeoutMs } : {}),
      ...(req.maxOutputBytes !== undefined ? { maxOutputBytes: req.maxOutputBytes } : {}),
    };
    const { id: call, result: response } = conn.begin('exec', params, {
      streams,
      ...(req.signal ? { signal: req.signal } : {}),
    });
    req.onSignalable?.(async (sig) => (await conn.request('exec.signal', { call, signal: sig })).delivered);
    const drained = Promise.all([drain(stdout, req.onStdout), drain(stderr, req.onStderr)]);
    drained.catch(() => undefined); // the response carries the failure; don't report it twice
    if (stdin && req.stdin !== undefined) {
      const src = req.stdin;
      void (async () => {
        try {
          if (src instanceof Uint8Array) await stdin.write(src);
          else for await (const c of src) await stdin.write(c);
          stdin.end();
        } catch (err) {
          stdin.end(err instanceof HutchError ? err : new HutchError('internal', (err as Error).message));
        }
      })();
    }
    const result = (async () => {
      try {
        const r = await response;
        await drained;
        return r;
      } catch (err) {
        stdout.stop();
        stderr.stop();
        throw err;
      }
    })();
    return {
      call,
      result,
      signal: async (sig) => (await conn.request('exec.signal', { call, signal: sig })).delivered,
    };
  }

  /** Runs a command and collects its output (up to the cap). */
  async run(req: Omit<ExecRequest, 'onStdout' | 'onStderr'>): Promise<ExecResult & { stdoutText: string; stderrText: string }> {
    const out: Uint8Array[] = [];
    const err: Uint8Array[] = [];
    const r = await this.exec({ ...req, onStdout: (c) => void out.push(c), onStderr: (c) => void err.push(c) }).result;
    return { ...r, stdoutText: Buffer.concat(out).toString('utf8'), stderrText: Buffer.concat(err).toString('utf8') };
  }

  /** Applies a sync batch; large file contents go as streams, small ones inline. */
  async syncApply(
    changes: Array<SyncChange | (Omit<Extract<SyncChange, { op: 'write' }>, 'data' | 'stream'> & { source: AsyncIterable<Uint8Array> })>,
    opts: { fresh?: boolean; mark?: boolean; since?: string } = {},
  ): Promise<ResultOf<'sync.apply'>> {
    const conn = this.connection;
    const wire: SyncChange[] = [];
    const feeds: Array<() => Promise<void>> = [];
    const streams: number[] = [];
    for (const c of changes) {
      if ('source' in c) {
        const out = conn.openOutbound();
        streams.push(out.id);
        const { source, ...rest } = c;
        wire.push({ ...rest, stream: out.id });
        feeds.push(async () => {
          for await (const chunk of source) await out.write(chunk);
          out.end();
        });
      } else wire.push(c);
    }
    if (streams.length > 16) throw new HutchError('bad_request', 'at most 16 streamed files per sync.apply batch');
    const res = conn.request('sync.apply', { changes: wire, ...opts }, { streams });
    // Streams are fed in order because the agent applies changes in order.
    const fed = (async () => {
      for (const f of feeds) await f();
    })();
    const [r] = await Promise.all([res, fed]);
    return r;
  }

  /** Streams a workspace file's content from the agent (path as bytes, or its surrogateescape string). */
  async syncRead(path: Uint8Array | string, sink: (chunk: Uint8Array) => void | Promise<void>): Promise<number> {
    const s = this.connection.openInbound();
    const res = this.connection.request('sync.read', { path: syncPathBytes(path), stream: s.id }, { streams: [s.id] });
    const drained = drain(s, sink);
    const [r] = await Promise.all([res, drained]);
    return r.bytes;
  }

  /** A workspace file's content as a stream of chunks (flow-controlled by the consumer). */
  syncReadStream(path: Uint8Array | string): AsyncIterable<Uint8Array> {
    const s = this.connection.openInbound();
    const res = this.connection.request('sync.read', { path: syncPathBytes(path), stream: s.id }, { streams: [s.id] });
    res.catch(() => s.stop());
    return (async function* () {
      yield* s;
      await res; // surfaces an error from the agent after a short stream
    })();
  }

  /**
   * What changed in the guest's workspace since `since`, delivered batch by batch to
   * `onBatch`. The agent writes the change set on a stream; the next batch is read only
   * after `onBatch` resolves, so a slow consumer holds the agent back instead of
   * buffering, and no frame grows with the number of files.
   */
  async syncChanges(
    params: Omit<ParamsOf<'sync.changes'>, 'stream'>,
    onBatch: (batch: SyncChangesBatch) => void | Promise<void>,
  ): Promise<ResultOf<'sync.changes'>> {
    const s = this.connection.openInbound();
    // A change set has no size bound, so no total deadline can be sized before it is known
    // (a deadline sized by the last scan killed the VM of a call that made 100,000 files).
    // With deadlines on, the guest must keep the stream moving instead: it sends a record at
    // least every second (an empty one while it scans), and a wait for the next chunk longer
    // than sync.changes' base deadline means it stopped answering. The broker's own time on a
    // batch (staging it on the host) does not count against the guest.
    const idleMs = this.policy ? deadlineFor('sync.changes', {}, this.policy) : undefined;
    const abort = new AbortController();
    const res = this.connection.request('sync.changes', { ...params, stream: s.id }, {
      streams: [s.id],
      signal: abort.signal,
      ...(idleMs !== undefined ? { timeoutMs: STREAM_PROGRESS_ONLY_MS } : {}),
    });
    const consume = (async () => {
      const records = new FrameDecoder(SYNC_RECORD_MAX_BYTES, this.frameShape);
      const chunks = s[Symbol.asyncIterator]();
      try {
        for (;;) {
          const next = await withIdleDeadline(chunks.next(), idleMs, 'sync.changes');
          if (next.done) break;
          const chunk = next.value;
          const decoded = records.push(Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength));
          for (;;) {
            // Decoding a record is the guest's to pay for, like decoding its frames.
            const started = performance.now();
            const r = decoded.next();
            if (r.done) break;
            if (!r.value.ok) throw r.value.error;
            const batch = SyncChangesBatchSchema.safeParse(r.value.value);
            this.connection.chargeLoop(performance.now() - started);
            if (!batch.success) throw new HutchError('internal', `invalid sync.changes record from the agent: ${batch.error.issues[0]?.message ?? ''}`);
            if (batch.data.changes.length || batch.data.skipped.length) await onBatch(batch.data);
          }
        }
        if (records.hasPartialFrame) throw new HutchError('internal', 'sync.changes stream ended inside a record');
      } catch (err) {
        s.stop();
        abort.abort();
        throw err;
      }
    })();
    // Once the stream has ended the answer is due at once, but for agent.state when asked
    // (a walk bounded by maxPaths): bounded like agent.state, never by the 24 h backstop.
    const tailMs = idleMs !== undefined && this.policy ? idleMs + (params.state ? deadlineFor('agent.state', {}, this.policy) : 0) : undefined;
    const answered = consume.then(
      () => withIdleDeadline(res, tailMs, 'sync.changes', 'answered nothing after its stream ended'),
      () => res,
    );
    answered.catch(() => abort.abort());
    const [r, c] = await Promise.allSettled([answered, consume]);
    // A silent guest, or the broker's own failure on a batch, explains the request we then
    // cancelled; otherwise the agent's own error (unknown marker, ...) explains a short
    // stream better than the stream does.
    const cancelledByUs = r.status === 'rejected' && r.reason instanceof HutchError && r.reason.code === 'cancelled';
    if (c.status === 'rejected' && (cancelledByUs || (c.reason instanceof HutchError && c.reason.code === 'guest_unresponsive'))) throw c.reason;
    if (r.status === 'rejected') throw r.reason;
    if (c.status === 'rejected') throw c.reason;
    // The next scan (sync.mark, agent.state) walks what this one found: size its deadline by it.
    this.workspaceEntries = r.value.entries;
    return r.value;
  }


  /** The network the guest's `net.open` requests are served under (its session's); unset: each is refused. */
  network: SandboxNetwork | undefined;

  private readonly onNetOpen: Handler<'net.open'> = async (p, ctx) => {
    const tunnel = streamDuplex(ctx.inbound(p.up), ctx.outbound(p.down));
    ctx.signal.addEventListener('abort', () => tunnel.destroy(), { once: true });
    if (!this.network) {
      answerRefusal(tunnel, 503, 'this sandbox is not serving a session yet');
      return { outcome: 'refused' as const, bytesIn: 0, bytesOut: 0 };
    }
    const e = await this.network.serve(tunnel);
    return { outcome: e.outcome, bytesIn: e.bytesIn, bytesOut: e.bytesOut };
  };

  /**
   * A TCP connection to `port` on the guest's loopback, as a duplex (a harness reaching a
   * server a tenant process runs). `done` settles when it ends, and fails with
   * `connection_refused` when nothing listens there.
   */
  dial(port: number): { socket: Duplex; done: Promise<ResultOf<'net.dial'>> } {
    const conn = this.connection;
    const down = conn.openOutbound();
    const up = conn.openInbound();
    // A connection lasts as long as its ends want (a WebSocket): the heartbeat, not a total, tells a dead guest.
    const done = conn.request('net.dial', { port, down: down.id, up: up.id }, { streams: [down.id, up.id], timeoutMs: STREAM_PROGRESS_ONLY_MS });
    const socket = streamDuplex(up, down);
    done.then(
      () => socket.end(),
      (err: unknown) => socket.destroy(err as Error),
    );
    return { socket, done };
  }

  /** Sends bytes through a stream to the agent and back (tests and the protocol bench). */
  async echo(source: AsyncIterable<Uint8Array>, sink: (chunk: Uint8Array) => void | Promise<void>): Promise<number> {
    const conn = this.connection;
    const input = conn.openOutbound();
    const output = conn.openInbound();
    const res = conn.request('debug.echo', { input: input.id, output: output.id }, { streams: [input.id, output.id] });
    const feed = (async () => {
      for await (const c of source) await input.write(c);
      input.end();
    })();
    const [r] = await Promise.all([res, feed, drain(output, sink)]);
    return r.bytes;
  }

  close(): void {
    this.connection.close();
  }
}

/** A streaming sync call is bounded by its progress (withIdleDeadline), not by a total: this only backs it up. */
const STREAM_PROGRESS_ONLY_MS = 24 * 3600 * 1000;

/** Resolves with `p`, or fails with guest_unresponsive if it takes longer than `ms` (no limit when undefined). */
function withIdleDeadline<T>(p: Promise<T>, ms: number | undefined, method: string, what = 'sent nothing on its stream'): Promise<T> {
  if (ms === undefined) return p;
  let timer: NodeJS.Timeout | undefined;
  const idle = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new HutchError('guest_unresponsive', `the guest ${what} of ${method} for ${ms} ms`, { method, deadlineMs: ms })), ms);
  });
  return Promise.race([p, idle]).finally(() => clearTimeout(timer));
}

/** Sync paths travel as bytes; a caller may name one by its surrogateescape string. */
function syncPathBytes(p: Uint8Array | string): Uint8Array {
  return typeof p === 'string' ? nameToBytes(p) : p;
}

async function drain(s: InboundStream, sink: ((c: Uint8Array) => void | Promise<void>) | undefined): Promise<void> {
  for await (const c of s) if (sink) await sink(c);
}
