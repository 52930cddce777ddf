import { z } from 'zod';
import { HutchError, WireErrorSchema } from '../../../guest-agent/src/protocol/errors.ts';
import { SignalSchema } from '../../../guest-agent/src/protocol/methods.ts';
import { TelemetrySampleSchema } from '../../../guest-agent/src/protocol/methods-telemetry.ts';

/**
 * The harness API: what a harness (opencode, an SDK user) speaks to the broker over a
 * WebSocket. Defined once here, used by the broker and by the SDK. Text frames carry JSON,
 * binary frames msgpack (bytes stay bytes); the broker answers in the encoding of the
 * request. Tool arguments mirror opencode's tools.
 */
export const HARNESS_API_VERSION = 1;

const bytesOrText = z.union([z.string(), z.custom<Uint8Array>((v) => v instanceof Uint8Array, 'expected bytes')]);
const sessionId = z.string().regex(/^[a-z0-9-]{1,64}$/, 'session ids are lowercase letters, digits and dashes');

export const ToolArgs = {
  read: z.object({ filePath: z.string().min(1), offset: z.number().int().nonnegative().optional(), limit: z.number().int().positive().optional() }),
  write: z.object({ filePath: z.string().min(1), content: bytesOrText }),
  edit: z.object({ filePath: z.string().min(1), oldString: z.string(), newString: z.string(), replaceAll: z.boolean().optional() }),
  glob: z.object({ pattern: z.string().min(1), path: z.string().min(1).optional() }),
  grep: z.object({ pattern: z.string().min(1), path: z.string().min(1).optional(), include: z.string().min(1).optional() }),
  list: z.object({ path: z.string().min(1).optional(), ignore: z.array(z.string()).optional(), offset: z.number().int().nonnegative().optional() }),
  bash: z.object({
    command: z.string().min(1).max(1024 * 1024),
    /** opencode passes milliseconds as `timeout`; recorded sessions use `timeout_s`. */
    timeout: z.number().int().positive().optional(),
    timeout_s: z.number().positive().optional(),
    description: z.string().optional(),
    stdin: bytesOrText.optional(),
    env: z.record(z.string(), z.string()).optional(),
    /** Bytes of each output stream the result keeps; above MAX_OUTPUT_BYTES (session.ts) the call is `bad_request`. */
    maxOutputBytes: z.number().int().nonnegative().optional(),
    /** Force a route (tests, benchmarks); the router's choice otherwise. */
    route: z.enum(['fastpath', 'vm']).optional(),
  }),
} as const;
export type ToolName = keyof typeof ToolArgs;
export const ToolNameSchema = z.enum(['read', 'write', 'edit', 'glob', 'grep', 'list', 'bash']);

export const WorkspaceSourceSchema = z.union([
  z.object({ dir: z.string().min(1) }),
  z.object({ tar: z.custom<Uint8Array>((v) => v instanceof Uint8Array, 'expected tar bytes') }),
  z.object({ files: z.record(z.string(), bytesOrText) }),
]);

/**
 * A sandbox's network (README "Network"): `none`, the broker's `default` (the operator's
 * --egress-default: out of the box the package registries the host uses), `public` (the
 * internet, never the host, its LAN or metadata services), or rules laid over one of
 * those: `allow` adds destinations (domains, `*.suffix`, CIDRs, each with an optional
 * :port), `deny` removes them and wins over any allow.
 */
export const NetworkSpecSchema = z.union([
  z.enum(['none', 'default', 'public']),
  z.object({
    base: z.enum(['none', 'default', 'public']).optional(),
    allow: z.array(z.string().max(300)).max(1000).optional(),
    deny: z.array(z.string().max(300)).max(1000).optional(),
    /** Which wins where an allow and a deny rule both match: `deny` (hutch's default) or `allow` (E2B's semantics). */
    precedence: z.enum(['deny', 'allow']).optional(),
  }),
]);
export type NetworkSpec = z.infer<typeof NetworkSpecSchema>;

export const CreateParams = z.object({
  cpus: z.number().int().min(1).max(64).optional(),
  memoryMiB: z.number().int().min(64).max(1024 * 1024).optional(),
  workspace: WorkspaceSourceSchema.optional(),
  /** The session's id, given only by a gateway (with its credential) for the broker it placed the session on; a tenant's create gets a random one. */
  id: sessionId.optional(),
  /** The template the session's VM boots (hutch template ls); absent: the default template. */
  template: z.string().min(1).max(63).optional(),
  /** Workspace quota (allocated bytes, entries); each at most the broker's (--quota-bytes, --quota-files). */
  quota: z.object({ bytes: z.number().int().positive().optional(), files: z.number().int().positive().optional() }).optional(),
  /** Where the sandbox's traffic may go; absent: the broker's default. */
  network: NetworkSpecSchema.optional(),
  /** Ports of the sandbox anyone reaching the broker may use without a token (README "Ports"); default none. */
  publicPorts: z.union([z.array(z.number().int().min(1).max(65535)).max(16), z.literal('all')]).optional(),
});
/** Changes a live sandbox's network: its next connections are decided by the new policy. */
export const NetworkParams = z.object({ session: sessionId, network: NetworkSpecSchema });
export const AttachParams = z.object({ session: sessionId });
export const CloseParams = z.object({ session: sessionId, keepWorkspace: z.boolean().optional() });
/** What close answers: never a host path; a kept workspace stays under the broker's data dir by session id. */
export const CloseResultSchema = z.object({ session: z.string(), kept: z.boolean() });
export type CloseResult = z.infer<typeof CloseResultSchema>;
export const CallParams = z.object({
  session: sessionId,
  tool: ToolNameSchema,
  args: z.record(z.string(), z.unknown()),
  /** Stream bash output as `out` frames while it runs (default true). */
  stream: z.boolean().optional(),
});
export const SignalParams = z.object({ call: z.number().int().nonnegative(), signal: SignalSchema });
export const HintParams = z.object({ session: sessionId, hint: z.enum(['tool_call_pending', 'compacting', 'idle']) });
export const SessionsParams = z.object({});
/**
 * A session's telemetry is sampled within this (generous: an emulated guest under load
 * answers slowly), so a subscription sends an event at least every
 * interval plus this (a gateway gives a broker's subscription up when it sends none for longer).
 */
export const TELEMETRY_SAMPLE_TIMEOUT_MS = 5000;
/** A live telemetry subscription: one `evt` frame per interval until cancelled (signal op) or `count` samples. */
export const TelemetryParams = z.object({
  /** One session; all sessions when absent. */
  session: sessionId.optional(),
  intervalMs: z.number().int().min(100).max(3_600_000).optional(),
  count: z.number().int().positive().max(1_000_000).optional(),
});

// ------------------------------------------------------------ streamed files (file-stream.ts)

/** A stream's id: random, named by the broker, good only on the connection, principal and session that opened it. */
const streamId = z.string().regex(/^[A-Za-z0-9_-]{8,64}$/, 'stream ids are 8-64 letters, digits, - and _');
/** Chunk bytes: raw in msgpack frames, base64 in JSON text frames (which cannot carry bytes). */
const chunkData = z.union([z.custom<Uint8Array>((v) => v instanceof Uint8Array, 'expected bytes'), z.string()]);
const streamPath = z.string().min(1).max(4096);
/** Opens a streamed upload; answered with the stream id, the credit window and the largest chunk. */
export const UploadParams = z.object({
  session: sessionId,
  path: streamPath,
  /** Permission bits of the file (no set-ID bits); default the replaced file's, else 0644. */
  mode: z.number().int().min(0).max(0o777).optional(),
  /** Total size, when known: refused up front if above a limit, and checked at commit. */
  size: z.number().int().nonnegative().optional(),
});
/** One chunk at `offset` (the bytes sent so far); answered once written, which returns its bytes of credit. */
export const UploadChunkParams = z.object({ session: sessionId, stream: streamId, offset: z.number().int().nonnegative(), data: chunkData });
/** Ends an upload: the temp file is renamed over the path (atomic); `sha256` of the whole file, if given, must match. */
export const UploadCommitParams = z.object({ session: sessionId, stream: streamId, sha256: z.string().regex(/^[0-9a-f]{64}$/).optional() });
export const UploadAbortParams = z.object({ session: sessionId, stream: streamId });
/** A streamed download: `evt` frames, first `{ stream, size, window, chunkBytes }`, then `{ offset, data }`; the answer ends it. */
export const DownloadParams = z.object({ session: sessionId, path: streamPath });
/** The bytes of a download the client has consumed (cumulative): each ack returns that much credit. */
export const DownloadAckParams = z.object({ session: sessionId, stream: streamId, bytes: z.number().int().nonnegative() });

export const UploadOpenResultSchema = z.object({ stream: z.string(), window: z.number(), chunkBytes: z.number(), maxBytes: z.number() });
export const UploadCommitResultSchema = z.object({
  path: z.string(),
  bytes: z.number(),
  created: z.boolean(),
  sha256: z.string(),
  /** Most bytes the broker held received and not yet acknowledged (never above the window). */
  peakUnackedBytes: z.number(),
});
export const DownloadStartSchema = z.object({ stream: z.string(), size: z.number(), window: z.number(), chunkBytes: z.number() });
export const DownloadChunkSchema = z.object({ offset: z.number(), data: chunkData });
export const DownloadResultSchema = z.object({ bytes: z.number(), sha256: z.string(), peakUnackedBytes: z.number() });

export const OPS = {
  create: CreateParams,
  attach: AttachParams,
  close: CloseParams,
  call: CallParams,
  signal: SignalParams,
  hint: HintParams,
  sessions: SessionsParams,
  telemetry: TelemetryParams,
  network: NetworkParams,
  upload: UploadParams,
  uploadChunk: UploadChunkParams,
  uploadCommit: UploadCommitParams,
  uploadAbort: UploadAbortParams,
  download: DownloadParams,
  downloadAck: DownloadAckParams,
} as const;
export type OpName = keyof typeof OPS;

/** An op's params checked against its schema: `bad_request` naming the first field that fails. */
export function opParams<O extends OpName>(op: O, raw: unknown): z.infer<(typeof OPS)[O]> {
  const parsed = OPS[op].safeParse(raw);
  if (!parsed.success) {
    const i = parsed.error.issues[0];
    throw new HutchError('bad_request', `invalid ${op} params: ${i?.path.join('.') || '(params)'}: ${i?.message}`, { op });
  }
  return parsed.data as z.infer<(typeof OPS)[O]>;
}

export const ClientMessageSchema = z.object({
  t: z.literal('req'),
  id: z.number().int().nonnegative(),
  op: z.string(),
  p: z.unknown(),
});

// ------------------------------------------------------------ results

export const SessionInfoSchema = z.object({
  session: z.string(),
  cpus: z.number(),
  memoryMiB: z.number(),
  /** The session's template ("default" when it named none). */
  template: z.string().optional(),
  backend: z.string(),
  /** Is a VM (or local agent) currently running for it. */
  live: z.boolean(),
  createdAt: z.string(),
  calls: z.number(),
  /** The egress policy in force: mode and rules as text. */
  network: z.object({ mode: z.enum(['none', 'allowlist', 'public']), allow: z.array(z.string()), deny: z.array(z.string()) }).optional(),
  /** Ports reachable without a token ('all': every port, E2B's allowPublicTraffic). */
  publicPorts: z.union([z.array(z.number()), z.literal('all')]).optional(),
});
export type SessionInfo = z.infer<typeof SessionInfoSchema>;

/**
 * A gateway asks every live broker for `sessions` and `telemetry` without a session, and
 * passes a `signal` on to each broker a call went to. Each broker gets a deadline; the answer
 * then holds what the others gave, and `unavailable` names the brokers it lacks (no answer
 * in time, unreachable, or an error). A single broker never sets it.
 */
const unavailableBrokers = z.array(z.string()).optional();
export const SessionsResultSchema = z.object({ sessions: z.array(SessionInfoSchema), unavailable: unavailableBrokers });
export type SessionsResult = z.infer<typeof SessionsResultSchema>;
export const TelemetryResultSchema = z.object({ samples: z.number(), cancelled: z.boolean(), unavailable: unavailableBrokers });
export type TelemetryResult = z.infer<typeof TelemetryResultSchema>;
export const SignalResultSchema = z.object({ delivered: z.boolean(), unavailable: unavailableBrokers });
export type SignalResult = z.infer<typeof SignalResultSchema>;
/** Traffic through the egress proxy: bytes from (in) and to (out) destinations, connections made and refused. */
export const NetworkCountersSchema = z.object({ bytesIn: z.number(), bytesOut: z.number(), connections: z.number(), refused: z.number() });
export type NetworkCounters = z.infer<typeof NetworkCountersSchema>;

export const RouteSchema = z.enum(['inprocess', 'fastpath', 'vm']);
export type Route = z.infer<typeof RouteSchema>;

export const CallTimingSchema = z.object({
  /** From the broker receiving the call to sending its result. */
  totalMs: z.number(),
  /** The command's own run time (0 for file tools). */
  runMs: z.number(),
  /** totalMs - runMs: what hutch added. */
  addedMs: z.number(),
  /** Waking the sandbox (0 when it was live). */
  wakeMs: z.number(),
  /** Time spent waiting for admission (queued behind other wakes / VM calls). */
  queuedMs: z.number().optional(),
  /**
   * Where a wake's time went, ms from the wake's start to the end of each phase: standby
   * (a VM restored and warmed ahead of time was taken: no restore, no channel), or restore
   * (QEMU up, snapshot loaded) and channel (agent handshake); then push (workspace in), resume
   * (entropy and clock; runs beside the push), mark (the pull baseline), exec (the call
   * itself handed to the guest, after admission and any host changes since the push).
   */
  wakePhases: z.record(z.string(), z.number()).optional(),
});

export const BashResultSchema = z.object({
  exitCode: z.number().int().nullable(),
  signal: z.string().nullable(),
  timedOut: z.boolean(),
  stdout: z.string(),
  stderr: z.string(),
  stdoutBytes: z.number().int(),
  stderrBytes: z.number().int(),
  truncated: z.boolean(),
});

export const CallResultSchema = z.object({
  tool: ToolNameSchema,
  route: RouteSchema,
  reason: z.string(),
  woke: z.boolean(),
  timing: CallTimingSchema,
  /**
   * What the call changed in the VM's workspace that could not be brought to the host
   * (a FIFO or socket, a file above the size limit, a name the host cannot create): typed,
   * one entry per path. The rest of the call's changes did land.
   */
  syncErrors: z.array(z.object({ path: z.string(), code: z.string(), message: z.string() })).optional(),
  /** More such entries than `syncErrors` lists (it lists the first 100): how many more. */
  syncErrorsOmitted: z.number().int().nonnegative().optional(),
  /** The sandbox's network traffic while the call ran (absent when there was none). */
  network: NetworkCountersSchema.optional(),
  /** The tool's own result: bash -> BashResult; file tools -> the file tool result. */
  result: z.unknown(),
});
export type CallResult = z.infer<typeof CallResultSchema>;

export const ServerMessageSchema = z.union([
  z.object({
    t: z.literal('hello'),
    v: z.number(),
    broker: z.string(),
    backend: z.string(),
    accel: z.string().optional(),
    /** The principal this connection's token names. */
    principal: z.string().optional(),
    /** The broker's policy: published level and idle window (null: never released). */
    policy: z.object({ level: z.string().optional(), idleMs: z.number().nullable() }).passthrough().optional(),
    /** Connection and call limits in force (bytes, counts, milliseconds). */
    limits: z.record(z.string(), z.number()).optional(),
    versions: z.object({ api: z.number(), broker: z.string(), node: z.string() }).optional(),
  }),
  z.object({ t: z.literal('res'), id: z.number(), r: z.unknown().optional(), e: WireErrorSchema.optional() }),
  z.object({ t: z.literal('out'), call: z.number(), fd: z.union([z.literal(1), z.literal(2)]), d: bytesOrText }),
  z.object({ t: z.literal('evt'), call: z.number(), d: z.unknown() }),
]);

/** One session's telemetry: its VM's state and, when a VM is live and awake, the guest's sample. */
export const SessionTelemetrySchema = z.object({
  session: z.string(),
  vm: z.enum(['none', 'live', 'reclaimed']),
  sample: TelemetrySampleSchema.optional(),
  error: z.string().optional(),
  /** The sandbox's traffic since it was created (this broker process), and connections open now. */
  network: NetworkCountersSchema.extend({ open: z.number() }).optional(),
  /** What happened since the previous sample: `network.refused` for each connection the policy refused (at most 20). */
  events: z.array(z.object({ kind: z.literal('network.refused'), atMs: z.number(), host: z.string(), port: z.number(), reason: z.string(), rule: z.string().optional() })).optional(),
});
export type SessionTelemetry = z.infer<typeof SessionTelemetrySchema>;
export const TelemetryEventSchema = z.object({ atMs: z.number(), sessions: z.array(SessionTelemetrySchema) });
export type TelemetryEvent = z.infer<typeof TelemetryEventSchema>;
export type ServerMessage = z.infer<typeof ServerMessageSchema>;
