/**
 * hutch SDK for harnesses.
 *
 *   import { Hutch } from 'hutch';
 *   const hutch = await Hutch.connect('ws://127.0.0.1:7070', { token });
 *   const sb = await hutch.create({ cpus: 1, memoryMiB: 512, workspace: { dir: './project' } });
 *   await sb.files.write('random.txt', 'hello');
 *   const r = await sb.run('cat random.txt');   // { exitCode, stdout, stderr, route, addedMs, ... }
 *   await sb.close();
 */
import { createHash } from 'node:crypto';
import { Packr } from 'msgpackr';
import WebSocket from 'ws';
import { HutchError, type ErrorCode } from '../../../guest-agent/src/protocol/errors.ts';
import { SIGNALS as SIGNAL_NAMES, type MethodName, type ResultOf, type SIGNALS } from '../../../guest-agent/src/protocol/methods.ts';
import {
  HARNESS_API_VERSION,
  BashResultSchema,
  CallResultSchema,
  ServerMessageSchema,
  SessionInfoSchema,
  SessionsResultSchema,
  type SessionsResult,
  type CallResult,
  type ServerMessage,
  type CloseResult,
  type OpName,
  type Route,
  type SessionInfo,
  type ToolName,
  type TelemetryEvent,
  type NetworkSpec,
  TelemetryEventSchema,
  TelemetryResultSchema,
  type TelemetryResult,
  DownloadChunkSchema,
  DownloadResultSchema,
  DownloadStartSchema,
  UploadCommitResultSchema,
  UploadOpenResultSchema,
} from '../api/harness-protocol.ts';

export { HutchError, type ErrorCode, type CallResult, type Route, type SessionInfo, type ToolName, type TelemetryEvent, type TelemetryResult, type SessionsResult, type NetworkSpec };

const packr = new Packr({ useRecords: false });

export interface ConnectOptions {
  token: string;
  /** msgpack (binary frames, bytes stay bytes) or json (text frames). Default msgpack. */
  encoding?: 'msgpack' | 'json';
  /** Give up connecting after this long. */
  timeoutMs?: number;
}

export interface CreateOptions {
  cpus?: number;
  memoryMiB?: number;
  /** Initial workspace: a directory on the broker's host, a tar archive, or a map of files. */
  workspace?: { dir: string } | { tar: Uint8Array } | { files: Record<string, string | Uint8Array> };
  /** The template the sandbox boots (`hutch template ls`); default: hutch's Debian image. */
  template?: string;
  /** Workspace quota in allocated bytes and entries, each at most the broker's. */
  quota?: { bytes?: number; files?: number };
  /**
   * Where the sandbox's traffic may go: `none`, `default` (the broker's: out of the box the
   * package registries its host uses), `public`, or `{ base?, allow?, deny? }` (domains,
   * `*.suffix`, CIDRs, each with an optional `:port`; deny wins).
   */
  network?: NetworkSpec;
  /** Ports anyone reaching the broker may use without a token. */
  publicPorts?: number[];
}

export interface RunOptions {
  onStdout?: (chunk: string) => void;
  onStderr?: (chunk: string) => void;
  stdin?: string | Uint8Array;
  timeoutMs?: number;
  env?: Record<string, string>;
  /** Bytes of each of stdout and stderr the result keeps (default 1 MiB; at most the broker's `hello.limits.maxOutputBytes`, 16 MiB: more is `bad_request`). Streamed output is not capped. */
  maxOutputBytes?: number;
  /** Force the route (benchmarks, tests); the broker's router decides otherwise. */
  route?: 'fastpath' | 'vm';
  signal?: AbortSignal;
}

/** Where a call ran, why, and what it cost: part of every `sb.run` and `sb.files.*` result. */
export interface CallInfo {
  /** Where it ran (`inprocess`, `fastpath`, `vm`) and the router's reason. */
  route: Route;
  reason: string;
  /** Latency hutch added (broker time minus the tool's own run time). */
  addedMs: number;
  /** True when this call woke (restored or booted) the sandbox's VM. */
  woke: boolean;
  timing: CallResult['timing'];
  /** Changes the call made in the VM that could not reach the host workspace (typed; absent when none). */
  syncErrors?: NonNullable<CallResult['syncErrors']>;
  /** How many more such changes there were than `syncErrors` lists (it lists the first 100). */
  syncErrorsOmitted?: number;
  /** The sandbox's network traffic during the call: bytes from (in) and to (out) destinations, connections made and refused. */
  network?: NonNullable<CallResult['network']>;
}

export interface RunResult extends CallInfo {
  exitCode: number | null;
  signal: string | null;
  timedOut: boolean;
  stdout: string;
  stderr: string;
  truncated: boolean;
}

/** Progress of a streamed transfer: bytes sent (or received) and acknowledged so far. */
export interface TransferProgress {
  bytes: number;
  acked: number;
  /** The whole size, when known. */
  total?: number;
}

export interface UploadOptions {
  /** Permission bits (no set-ID bits); default the replaced file's, else 0644. */
  mode?: number;
  /** The total size, when known: refused up front when above the broker's limit or the quota. */
  size?: number;
  onProgress?: (p: TransferProgress) => void;
  /** Aborts the upload: nothing is left in the workspace. */
  signal?: AbortSignal;
}

export interface UploadResult {
  path: string;
  bytes: number;
  created: boolean;
  sha256: string;
  /** Most bytes the broker held unacknowledged. */
  peakUnackedBytes: number;
  /** Most bytes this client had sent and not yet seen acknowledged (never above the window). */
  clientPeakUnackedBytes: number;
  window: number;
}

export interface DownloadOptions {
  onProgress?: (p: TransferProgress) => void;
  /** Cancels the download (as does leaving a for-await loop early). */
  signal?: AbortSignal;
}

/** A file tool's result (e.g. `content` of a read, `matches` of a grep) with its {@link CallInfo}. */
export type FileResult<M extends MethodName> = ResultOf<M> & CallInfo;

function callInfo(r: CallResult): CallInfo {
  return { route: r.route, reason: r.reason, addedMs: r.timing.addedMs, woke: r.woke, timing: r.timing, ...(r.syncErrors?.length ? { syncErrors: r.syncErrors } : {}), ...(r.syncErrorsOmitted ? { syncErrorsOmitted: r.syncErrorsOmitted } : {}), ...(r.network ? { network: r.network } : {}) };
}

/** The broker's first frame. */
export type BrokerHello = Extract<ServerMessage, { t: 'hello' }>;

interface Pending {
  resolve: (r: unknown) => void;
  reject: (e: HutchError) => void;
  onOut?: ((fd: 1 | 2, d: Uint8Array | string) => void) | undefined;
  onEvent?: ((d: unknown) => void) | undefined;
}

export class Hutch {
  private nextId = 1;
  private readonly pending = new Map<number, Pending>();
  private closedError: HutchError | undefined;
  backend = '';
  accel: string | undefined;
  /** What the broker said on connect: its versions, policy (level, idle window), limits and this connection's principal. */
  hello!: BrokerHello;

  private constructor(
    private readonly ws: WebSocket,
    /** @internal msgpack frames (bytes as bytes); JSON frames carry stream chunks as base64. */
    readonly binary: boolean,
    /** @internal The broker's address and the token, for its HTTP surfaces (sandbox ports). */
    readonly endpoint: { url: URL; token: string },
  ) {
    ws.on('message', (data: WebSocket.RawData, isBinary: boolean) => this.onMessage(data, isBinary));
    ws.on('close', (code, reason) => this.fail(new HutchError('connection_closed', `broker connection closed (${code}${reason.length ? `: ${reason.toString()}` : ''})`)));
    ws.on('error', (err) => this.fail(new HutchError('connection_closed', `broker connection error: ${err.message}`)));
  }

  /**
   * Connects to a broker (or a gateway) and reads its hello. Every failure says what to
   * check: the URL (what `hutch serve` prints when it listens), the token, or the versions.
   */
  static async connect(url: string, opts: ConnectOptions): Promise<Hutch> {
    if (typeof url !== 'string' || !/^wss?:\/\/[^/]/.test(url)) {
      const hint = typeof url === 'string' && /^https?:\/\//.test(url) ? ` (did you mean ${url.replace(/^http/, 'ws')}?)` : '';
      throw new HutchError('bad_request', `Hutch.connect(${JSON.stringify(url)}): a broker's address is ws://HOST:PORT (or wss://), as hutch serve prints it${hint}`);
    }
    if (!opts?.token) throw new HutchError('unauthorized', `Hutch.connect(${url}) needs { token }: the token hutch serve was given (--token-file, HUTCH_TOKEN) or printed`);
    const timeoutMs = opts.timeoutMs ?? 10_000;
    const ws = new WebSocket(url, { headers: { authorization: `Bearer ${opts.token}` }, maxPayload: 512 * 1024 * 1024 });
    const hello = await new Promise<BrokerHello>((resolve, reject) => {
      const timer = setTimeout(() => {
        ws.terminate();
        reject(new HutchError('timeout', `no answer from ${url} within ${timeoutMs} ms: check the URL, and that nothing in between (a proxy, a firewall) holds the connection`));
      }, timeoutMs);
      ws.once('unexpected-response', (_req, res) => {
        clearTimeout(timer);
        ws.terminate();
        const status = res.statusCode ?? 0;
        if (status === 401) reject(new HutchError('unauthorized', `the broker at ${url} refused the token: check it is the one hutch serve was given (--token-file, HUTCH_TOKEN) or printed, or a principal's in its --tokens-file`));
        else if (status === 429) reject(new HutchError('busy', `the broker at ${url} refused another connection for this token's principal (HTTP 429): close some, or raise its --max-connections`));
        else reject(new HutchError('unavailable', `${url} answered HTTP ${status} instead of a WebSocket: check it is a hutch broker's or gateway's address (ws://HOST:PORT, no path)`));
      });
      ws.once('error', (err: NodeJS.ErrnoException) => {
        clearTimeout(timer);
        const why =
          err.code === 'ECONNREFUSED'
            ? `nothing listens at ${url}: check that hutch serve is running and the URL's host and port are the ones it printed`
            : err.code === 'ENOTFOUND' || err.code === 'EAI_AGAIN'
              ? `cannot resolve the host of ${url}: check the URL`
              : `cannot connect to ${url}: ${err.message}: check the URL`;
        reject(new HutchError('unavailable', why));
      });
      ws.once('message', (data: WebSocket.RawData) => {
        clearTimeout(timer);
        try {
          const m = ServerMessageSchema.parse(JSON.parse(String(data)));
          if (m.t !== 'hello') throw new Error(`expected hello, got ${m.t}`);
          resolve(m);
        } catch (err) {
          ws.terminate();
          reject(new HutchError('unsupported_version', `${url} did not greet like a hutch broker this SDK knows (${(err as Error).message}): check the URL, and that the SDK and the broker are the same version`));
        }
      });
    });
    if (hello.v !== HARNESS_API_VERSION) {
      ws.terminate();
      throw new HutchError('unsupported_version', `the broker at ${url} speaks harness API v${hello.v} (hutch ${hello.versions?.broker ?? '?'}), this SDK v${HARNESS_API_VERSION}: use the SDK of the broker's version (npm pack in its clone)`, { broker: hello.versions?.broker, api: hello.v });
    }
    const h = new Hutch(ws, (opts.encoding ?? 'msgpack') === 'msgpack', { url: new URL(url), token: opts.token });
    h.backend = hello.backend;
    h.accel = hello.accel;
    h.hello = hello;
    return h;
  }

  async create(opts: CreateOptions = {}): Promise<Sandbox> {
    const info = SessionInfoSchema.parse(await this.request('create', opts));
    return new Sandbox(this, info);
  }

  /** Attaches to a live session by id (e.g. after reconnecting). */
  async attach(id: string): Promise<Sandbox> {
    return new Sandbox(this, SessionInfoSchema.parse(await this.request('attach', { session: id })));
  }

  async sessions(): Promise<SessionInfo[]> {
    return (await this.listSessions()).sessions;
  }

  /** The sessions and, through a gateway, the brokers that did not answer in time (`unavailable`: the list lacks theirs). */
  async listSessions(): Promise<SessionsResult> {
    return SessionsResultSchema.parse(await this.request('sessions', {}));
  }

  /**
   * Live telemetry: `onSample` gets one event per interval (every session, or one) with
   * each VM's state and guest sample, until `signal` aborts or `count` events arrived.
   */
  async telemetry(o: { session?: string; intervalMs?: number; count?: number; signal?: AbortSignal; onSample: (e: TelemetryEvent) => void }): Promise<TelemetryResult> {
    const p = { ...(o.session ? { session: o.session } : {}), ...(o.intervalMs !== undefined ? { intervalMs: o.intervalMs } : {}), ...(o.count !== undefined ? { count: o.count } : {}) };
    try {
      return TelemetryResultSchema.parse(await this.request('telemetry', p, undefined, o.signal, (d) => o.onSample(TelemetryEventSchema.parse(d))));
    } catch (err) {
      // Cancelling is how a subscription ends; the broker answers it like a finished one.
      if (o.signal?.aborted && err instanceof HutchError && err.code === 'cancelled') return { samples: -1, cancelled: true };
      throw err;
    }
  }

  close(): void {
    this.ws.close();
  }

  /** @internal */
  request(op: OpName, p: unknown, onOut?: (fd: 1 | 2, d: Uint8Array | string) => void, signal?: AbortSignal, onEvent?: (d: unknown) => void): Promise<unknown> {
    if (this.closedError) return Promise.reject(this.closedError);
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject, onOut, onEvent });
      const msg = { t: 'req', id, op, p };
      this.ws.send(this.binary ? packr.pack(msg) : JSON.stringify(msg));
      // abort('SIGINT') (or any signal name as the reason) sends that signal; any other abort ends the call.
      const sig = () => (typeof signal?.reason === 'string' && (SIGNAL_NAMES as readonly string[]).includes(signal.reason) ? signal.reason : 'SIGKILL');
      signal?.addEventListener('abort', () => void this.request('signal', { call: id, signal: sig() }).catch(() => undefined), { once: true });
    });
  }

  private onMessage(data: WebSocket.RawData, isBinary: boolean): void {
    let m;
    try {
      const buf = Array.isArray(data) ? Buffer.concat(data) : Buffer.from(data as ArrayBuffer);
      m = ServerMessageSchema.parse(isBinary ? packr.unpack(buf) : JSON.parse(buf.toString('utf8')));
    } catch {
      return; // a broker bug; nothing a caller could do with it
    }
    if (m.t === 'out') {
      this.pending.get(m.call)?.onOut?.(m.fd, m.d);
      return;
    }
    if (m.t === 'evt') {
      this.pending.get(m.call)?.onEvent?.(m.d);
      return;
    }
    if (m.t !== 'res') return;
    const p = this.pending.get(m.id);
    if (!p) return;
    this.pending.delete(m.id);
    if (m.e) p.reject(HutchError.fromWire(m.e));
    else p.resolve(m.r);
  }

  private fail(err: HutchError): void {
    this.closedError ??= err;
    for (const p of this.pending.values()) p.reject(err);
    this.pending.clear();
  }
}

/** Chunks of at most `max` bytes: big pieces split, small ones (a Readable's 64 KiB) joined. */
async function* rechunk(source: AsyncIterable<Uint8Array> | Uint8Array, max: number): AsyncGenerator<Uint8Array> {
  if (source instanceof Uint8Array) {
    for (let i = 0; i < source.length; i += max) yield source.subarray(i, Math.min(source.length, i + max));
    return;
  }
  let parts: Uint8Array[] = [];
  let held = 0;
  for await (const piece of source) {
    let rest = typeof piece === 'string' ? Buffer.from(piece) : piece;
    while (rest.length > 0) {
      const take = Math.min(rest.length, max - held);
      parts.push(rest.subarray(0, take));
      held += take;
      rest = rest.subarray(take);
      if (held === max) {
        yield Buffer.concat(parts);
        parts = [];
        held = 0;
      }
    }
  }
  if (held > 0) yield Buffer.concat(parts);
}

export class Sandbox {
  readonly id: string;

  constructor(
    private readonly hutch: Hutch,
    readonly info: SessionInfo,
  ) {
    this.id = info.session;
  }

  /**
   * Reaching servers that processes in the sandbox listen on, through the broker with this
   * connection's token. A request to a released sandbox wakes it.
   */
  readonly ports = {
    /** The HTTP base URL of `port` (send `headers()` with each request, or use fetch()). */
    url: (port: number, path = '/'): string => {
      const u = new URL(this.hutch.endpoint.url);
      u.protocol = u.protocol === 'wss:' ? 'https:' : 'http:';
      u.pathname = `/sandboxes/${encodeURIComponent(this.id)}/ports/${port}${path.startsWith('/') ? path : `/${path}`}`;
      u.search = '';
      return u.toString();
    },
    /** The credential a request to a port needs (not forwarded to the sandbox's server). */
    headers: (): Record<string, string> => ({ 'x-hutch-token': this.hutch.endpoint.token }),
    /** fetch() against `port`; the path and init as for fetch. */
    fetch: (port: number, path = '/', init: RequestInit = {}): Promise<Response> =>
      fetch(this.ports.url(port, path), { ...init, headers: { ...Object.fromEntries(new Headers(init.headers).entries()), ...this.ports.headers() } }),
    /** A WebSocket to a server on `port` (open when this resolves). */
    connect: (port: number, path = '/', protocols?: string | string[]): Promise<WebSocket> => {
      const u = new URL(this.ports.url(port, path));
      u.protocol = u.protocol === 'https:' ? 'wss:' : 'ws:';
      const ws = new WebSocket(u, protocols, { headers: this.ports.headers() });
      return new Promise((resolve, reject) => {
        ws.once('open', () => resolve(ws));
        ws.once('unexpected-response', (_req, res) => {
          let body = '';
          res.on('data', (d: Buffer) => (body += d.toString()));
          res.on('end', () => reject(new HutchError(res.statusCode === 401 ? 'unauthorized' : res.statusCode === 404 ? 'not_found' : 'connection_refused', `port ${port} of ${this.id}: HTTP ${res.statusCode}: ${body.trim()}`)));
        });
        ws.once('error', (err) => reject(new HutchError('unavailable', `port ${port} of ${this.id}: ${err.message}`)));
      });
    },
  };

  /** The sandbox's network policy: read it, or change it (the next connections use the new one). */
  readonly network = {
    get: async (): Promise<SessionInfo['network']> => SessionInfoSchema.parse(await this.hutch.request('attach', { session: this.id })).network,
    set: async (network: NetworkSpec): Promise<SessionInfo['network']> => SessionInfoSchema.parse(await this.hutch.request('network', { session: this.id, network })).network,
  };

  /** opencode's file tools on this sandbox's workspace; each resolves to the tool's result plus route, reason and timings. */
  readonly files = {
    /** Lines of a text file, at most `limit` (2000) and 50 KiB: with `hasMore`, `nextOffset` passed as `offset` goes on. */
    read: (filePath: string, o: { offset?: number; limit?: number } = {}) => this.tool<'fs.read'>('read', { filePath, ...o }),
    write: (filePath: string, content: string | Uint8Array) => this.tool<'fs.write'>('write', { filePath, content }),
    edit: (filePath: string, oldString: string, newString: string, o: { replaceAll?: boolean } = {}) =>
      this.tool<'fs.edit'>('edit', { filePath, oldString, newString, ...o }),
    glob: (pattern: string, o: { path?: string } = {}) => this.tool<'fs.glob'>('glob', { pattern, ...o }),
    grep: (pattern: string, o: { path?: string; include?: string } = {}) => this.tool<'fs.grep'>('grep', { pattern, ...o }),
    /** Entries below `path`, at most 100 and 50 KiB of paths: a `truncated` answer's `nextOffset`, passed as `offset`, goes on. */
    list: (path?: string, o: { ignore?: string[]; offset?: number } = {}) => this.tool<'fs.list'>('list', { ...(path ? { path } : {}), ...o }),
    /**
     * Streams a file of any size (up to the broker's streamed limit and the quota) into the
     * workspace, in chunks under the broker's credit window; the file appears whole at the end
     * or not at all.
     */
    upload: (path: string, source: AsyncIterable<Uint8Array> | Uint8Array, o: UploadOptions = {}) => this.upload(path, source, o),
    /** Streams a workspace file out, one chunk at a time, only as fast as the loop takes them. */
    download: (path: string, o: DownloadOptions = {}) => this.download(path, o),
  };

  private async upload(path: string, source: AsyncIterable<Uint8Array> | Uint8Array, o: UploadOptions): Promise<UploadResult> {
    const h = this.hutch;
    const open = UploadOpenResultSchema.parse(await h.request('upload', { session: this.id, path, ...(o.mode !== undefined ? { mode: o.mode } : {}), ...(o.size !== undefined ? { size: o.size } : {}) }));
    const { stream, window } = open;
    const hash = createHash('sha256');
    let sent = 0;
    let acked = 0;
    let peak = 0;
    let failure: unknown;
    let wake: (() => void) | undefined;
    const inFlight = new Set<Promise<void>>();
    const abort = () => {
      failure ??= new HutchError('cancelled', 'upload aborted');
      wake?.();
    };
    o.signal?.addEventListener('abort', abort, { once: true });
    try {
      for await (const chunk of rechunk(source, Math.min(open.chunkBytes, window))) {
        // Credit: never more than the window sent and unanswered.
        while (!failure && sent - acked + chunk.length > window) await new Promise<void>((r) => (wake = r));
        if (failure) throw failure;
        hash.update(chunk);
        const len = chunk.length;
        const p = h
          .request('uploadChunk', { session: this.id, stream, offset: sent, data: h.binary ? chunk : Buffer.from(chunk).toString('base64') })
          .then(
            () => {
              acked += len;
              o.onProgress?.({ bytes: sent, acked, ...(o.size !== undefined ? { total: o.size } : {}) });
            },
            (err: unknown) => void (failure ??= err),
          )
          .finally(() => {
            inFlight.delete(p);
            wake?.();
          });
        inFlight.add(p);
        sent += len;
        peak = Math.max(peak, sent - acked);
      }
      await Promise.all(inFlight);
      if (failure) throw failure;
      const r = UploadCommitResultSchema.parse(await h.request('uploadCommit', { session: this.id, stream, sha256: hash.digest('hex') }));
      return { ...r, clientPeakUnackedBytes: peak, window };
    } catch (err) {
      await Promise.allSettled(inFlight);
      await h.request('uploadAbort', { session: this.id, stream }).catch(() => undefined); // gone already when the broker ended it
      throw err;
    } finally {
      o.signal?.removeEventListener('abort', abort);
    }
  }

  private async *download(path: string, o: DownloadOptions): AsyncGenerator<Buffer, { bytes: number; sha256: string; peakUnackedBytes: number } | undefined> {
    const h = this.hutch;
    const queue: Buffer[] = [];
    let wake: (() => void) | undefined;
    let stream: string | undefined;
    let size: number | undefined;
    let settled: { ok: true; r: unknown } | { ok: false; e: unknown } | undefined;
    const ac = new AbortController();
    const onAbort = () => ac.abort(o.signal?.reason);
    o.signal?.addEventListener('abort', onAbort, { once: true });
    h.request('download', { session: this.id, path }, undefined, ac.signal, (d) => {
      const start = DownloadStartSchema.safeParse(d);
      if (start.success) {
        stream = start.data.stream;
        size = start.data.size;
      } else {
        const c = DownloadChunkSchema.parse(d);
        queue.push(typeof c.data === 'string' ? Buffer.from(c.data, 'base64') : Buffer.from(c.data.buffer, c.data.byteOffset, c.data.byteLength));
      }
      wake?.();
    }).then(
      (r) => void (settled = { ok: true, r }),
      (e: unknown) => void (settled = { ok: false, e }),
    ).finally(() => wake?.());
    let got = 0;
    try {
      for (;;) {
        const chunk = queue.shift();
        if (chunk) {
          yield chunk;
          // Taken by the consumer: that much credit back.
          got += chunk.length;
          if (stream) void h.request('downloadAck', { session: this.id, stream, bytes: got }).catch(() => undefined);
          o.onProgress?.({ bytes: got, acked: got, ...(size !== undefined ? { total: size } : {}) });
          continue;
        }
        if (settled) {
          if (!settled.ok) throw settled.e;
          return DownloadResultSchema.parse(settled.r);
        }
        await new Promise<void>((r) => (wake = r));
        wake = undefined;
      }
    } finally {
      o.signal?.removeEventListener('abort', onAbort);
      if (!settled) ac.abort(); // left early: the broker stops sending
    }
  }

  /** Runs a shell command (bash -c) with streamed output. */
  async run(command: string, o: RunOptions = {}): Promise<RunResult> {
    const dec = { 1: new TextDecoder(), 2: new TextDecoder() };
    const streaming = Boolean(o.onStdout || o.onStderr);
    const onOut = (fd: 1 | 2, d: Uint8Array | string) => {
      const text = typeof d === 'string' ? d : dec[fd].decode(d, { stream: true });
      (fd === 1 ? o.onStdout : o.onStderr)?.(text);
    };
    const args = {
      command,
      ...(o.timeoutMs !== undefined ? { timeout: o.timeoutMs } : {}),
      ...(o.stdin !== undefined ? { stdin: o.stdin } : {}),
      ...(o.env ? { env: o.env } : {}),
      ...(o.maxOutputBytes !== undefined ? { maxOutputBytes: o.maxOutputBytes } : {}),
      ...(o.route ? { route: o.route } : {}),
    };
    const r = CallResultSchema.parse(await this.hutch.request('call', { session: this.id, tool: 'bash', args, stream: streaming }, streaming ? onOut : undefined, o.signal));
    const b = BashResultSchema.parse(r.result);
    return { ...b, ...callInfo(r) };
  }

  /** Any tool call with opencode's argument names (what recorded sessions contain). */
  async call(tool: ToolName, args: Record<string, unknown>, o: { signal?: AbortSignal } = {}): Promise<CallResult> {
    return CallResultSchema.parse(await this.hutch.request('call', { session: this.id, tool, args }, undefined, o.signal));
  }

  async signal(call: number, sig: (typeof SIGNALS)[number]): Promise<void> {
    await this.hutch.request('signal', { call, signal: sig });
  }

  async hint(hint: 'tool_call_pending' | 'compacting' | 'idle'): Promise<void> {
    await this.hutch.request('hint', { session: this.id, hint });
  }

  async close(o: { keepWorkspace?: boolean } = {}): Promise<CloseResult> {
    return (await this.hutch.request('close', { session: this.id, ...o })) as CloseResult;
  }

  private async tool<M extends MethodName>(tool: ToolName, args: Record<string, unknown>): Promise<FileResult<M>> {
    const r = await this.call(tool, args);
    return { ...(r.result as ResultOf<M>), ...callInfo(r) };
  }
}
