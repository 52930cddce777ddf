import { z } from 'zod';
import { ErrorCodeSchema } from './errors.ts';
import { WORKSPACE_PATH_MAX_BYTES } from '../workspace/names.ts';
import { MEMORY_METHODS } from './methods-memory.ts';
import { NET_METHODS } from './methods-net.ts';
import { CallUsageSchema, TELEMETRY_EVENTS, TELEMETRY_METHODS } from './methods-telemetry.ts';

/**
 * RPC methods and pushed events of the agent protocol: the single definition both the
 * guest agent (server) and the broker's agent client use. The agent validates params,
 * the client validates results, so a bug on either side shows up as a typed error at the
 * boundary rather than as a confused caller.
 */

const noNul = (s: string) => !s.includes('\0');
/** A workspace path: relative to the workspace root, or absolute under its mount point (/work). */
export const WsPath = z.string().min(1).max(4096).refine(noNul, 'path contains a NUL byte');
const OptionalWsPath = WsPath.optional();
const streamId = z.number().int().positive().max(0xffffffff);
/** Binary data; typed as a plain Uint8Array so Buffers (which msgpack decodes to) fit. */
const bytes = z.custom<Uint8Array>((v) => v instanceof Uint8Array, 'expected binary data');
const mode = z.number().int().min(0).max(0o7777);
const limit = (max: number) => z.number().int().positive().max(max);

export const SIGNALS = ['SIGINT', 'SIGTERM', 'SIGKILL', 'SIGHUP', 'SIGQUIT', 'SIGUSR1', 'SIGUSR2', 'SIGSTOP', 'SIGCONT'] as const;
export const SignalSchema = z.enum(SIGNALS);

// ---------- exec ----------
export const ExecParamsSchema = z
  .object({
    /** Run this argv directly, or */
    argv: z.array(z.string().refine(noNul)).min(1).max(4096).optional(),
    /** run this string with `bash -c`. */
    command: z.string().min(1).max(1024 * 1024).refine(noNul).optional(),
    cwd: OptionalWsPath,
    env: z.record(z.string().min(1).max(256), z.string().max(64 * 1024)).optional(),
    /** Stream carrying stdin; absent means stdin is empty (/dev/null-like EOF). */
    stdin: streamId.optional(),
    stdout: streamId,
    stderr: streamId,
    timeoutMs: z.number().int().positive().max(24 * 3600 * 1000).optional(),
    /** Bytes of each of stdout/stderr forwarded; the rest is counted and dropped. */
    maxOutputBytes: z.number().int().nonnegative().max(Number.MAX_SAFE_INTEGER).optional(),
  })
  .refine((p) => (p.argv === undefined) !== (p.command === undefined), 'exactly one of argv and command is required');
export type ExecParams = z.infer<typeof ExecParamsSchema>;

export const OutputSummarySchema = z.object({
  /** Total bytes the process wrote. */
  bytes: z.number().int().nonnegative(),
  /** Bytes forwarded to the caller (at most maxOutputBytes). */
  kept: z.number().int().nonnegative(),
  truncated: z.boolean(),
});
export const ExecResultSchema = z.object({
  exitCode: z.number().int().nullable(),
  signal: z.string().nullable(),
  timedOut: z.boolean(),
  cancelled: z.boolean(),
  durationMs: z.number().nonnegative(),
  stdout: OutputSummarySchema,
  stderr: OutputSummarySchema,
  /** Memory cost of the call, where the agent measures it (in a VM). */
  usage: CallUsageSchema.optional(),
});
export type ExecResult = z.infer<typeof ExecResultSchema>;

// ---------- file tools (opencode semantics) ----------
export const ReadParamsSchema = z.object({
  path: WsPath,
  /** 0-based index of the first line. */
  offset: z.number().int().nonnegative().optional(),
  /** Number of lines; default 2000. Any number: the answer stops at 50 KiB of text anyway (answer-bounds.ts). */
  limit: limit(Number.MAX_SAFE_INTEGER).optional(),
  /** Prefix lines with their 1-based number as opencode does (`00012| text`); default true. */
  numbered: z.boolean().optional(),
});
export const ReadResultSchema = z.object({
  path: z.string(),
  content: z.string(),
  offset: z.number().int(),
  lines: z.number().int(),
  totalLines: z.number().int(),
  /** Lines longer than the per-line cap were cut. */
  longLinesCut: z.number().int(),
  /** Lines after these remain (the caller's limit, or the byte cap, stopped the answer). */
  hasMore: z.boolean(),
  /** The answer's byte cap (ANSWER_MAX_BYTES) stopped it before `limit` lines. */
  truncated: z.boolean(),
  /** With hasMore: the offset that goes on from here. */
  nextOffset: z.number().int().optional(),
});
/**
 * A search tool's walk stopped short of the whole tree (answer-bounds.ts WALK_MAX_DEPTH,
 * WALK_MAX_ENTRIES): what it answers is from the part it saw; a narrower path sees the rest.
 */
const WalkLimitSchema = z.enum(['depth', 'entries']).optional();

export const WriteParamsSchema = z.object({
  path: WsPath,
  content: z.union([z.string(), bytes]),
  mode: mode.optional(),
});
export const WriteResultSchema = z.object({ path: z.string(), bytes: z.number().int(), created: z.boolean() });

export const EditParamsSchema = z.object({
  path: WsPath,
  oldString: z.string(),
  newString: z.string(),
  replaceAll: z.boolean().optional(),
});
export const EditResultSchema = z.object({ path: z.string(), replacements: z.number().int(), bytes: z.number().int() });

export const GlobParamsSchema = z.object({ pattern: z.string().min(1).max(4096), path: OptionalWsPath, limit: limit(100_000).optional() });
export const GlobResultSchema = z.object({ files: z.array(z.string()), truncated: z.boolean(), walkLimit: WalkLimitSchema });

export const GrepParamsSchema = z.object({
  pattern: z.string().min(1).max(64 * 1024),
  path: OptionalWsPath,
  include: z.string().min(1).max(4096).optional(),
  ignoreCase: z.boolean().optional(),
  limit: limit(100_000).optional(),
});
export const GrepMatchSchema = z.object({ path: z.string(), line: z.number().int(), text: z.string() });
export const GrepResultSchema = z.object({ matches: z.array(GrepMatchSchema), truncated: z.boolean(), filesSearched: z.number().int(), walkLimit: WalkLimitSchema });

export const EntryTypeSchema = z.enum(['file', 'dir', 'symlink', 'other']);
export const ListParamsSchema = z.object({
  path: OptionalWsPath,
  ignore: z.array(z.string().max(4096)).max(256).optional(),
  limit: limit(100_000).optional(),
  /** Entries of the walk to pass over first (a truncated answer's nextOffset). */
  offset: z.number().int().nonnegative().optional(),
});
export const ListResultSchema = z.object({
  path: z.string(),
  entries: z.array(z.object({ path: z.string(), type: EntryTypeSchema })),
  truncated: z.boolean(),
  /** When the answer's limit or byte cap stopped it: the offset that goes on from here. */
  nextOffset: z.number().int().optional(),
  walkLimit: WalkLimitSchema,
});

export const StatParamsSchema = z.object({ path: WsPath });
export const StatResultSchema = z.object({
  path: z.string(),
  type: EntryTypeSchema,
  size: z.number(),
  mode: z.number().int(),
  mtimeMs: z.number(),
  /** For a symlink: its target as stored (never followed). */
  target: z.string().optional(),
});

export const MkdirParamsSchema = z.object({ path: WsPath, parents: z.boolean().optional() });
export const MkdirResultSchema = z.object({ path: z.string(), created: z.boolean() });
export const RemoveParamsSchema = z.object({ path: WsPath, recursive: z.boolean().optional() });
export const RemoveResultSchema = z.object({ path: z.string(), removed: z.boolean() });
export const MoveParamsSchema = z.object({ from: WsPath, to: WsPath, overwrite: z.boolean().optional() });
export const MoveResultSchema = z.object({ from: z.string(), to: z.string() });

// ---------- workspace sync ----------
/**
 * A workspace-relative path as raw bytes. File names are bytes on Linux; msgpack strings
 * are UTF-8 and would mangle a name that is not, so sync carries names as bin end to end
 * (guest-agent/src/workspace/names.ts maps them to strings where people see them).
 */
/** A workspace-relative path the sync carries: longer ones exist (made through relative names) but stay where they are, reported. */
export const SYNC_PATH_MAX_BYTES = WORKSPACE_PATH_MAX_BYTES;
export const SyncPath = bytes.refine((b) => b.length >= 1 && b.length <= SYNC_PATH_MAX_BYTES && !b.includes(0), `a sync path is 1..${SYNC_PATH_MAX_BYTES} bytes without NUL`);
/** A symlink target, stored verbatim (bytes, never resolved). */
const SyncTarget = bytes.refine((b) => b.length >= 1 && b.length <= 4096 && !b.includes(0), 'a symlink target is 1..4096 bytes without NUL');
/** One change of a batch. Each file lands atomically. */
export const SyncChangeSchema = z.discriminatedUnion('op', [
  z.object({
    op: z.literal('write'),
    path: SyncPath,
    mode,
    mtimeMs: z.number().optional(),
    /** Inline content, or */
    data: bytes.optional(),
    /** a stream (listed in the request's streams) carrying it, for files above the frame size. */
    stream: streamId.optional(),
  }),
  z.object({ op: z.literal('mkdir'), path: SyncPath, mode }),
  z.object({ op: z.literal('symlink'), path: SyncPath, target: SyncTarget }),
  z.object({ op: z.literal('delete'), path: SyncPath }),
  z.object({ op: z.literal('chmod'), path: SyncPath, mode }),
]);
export type SyncChange = z.infer<typeof SyncChangeSchema>;
/** The sender bounds a batch by bytes (well under the frame limit); the count cap is a backstop. */
export const SyncApplyParamsSchema = z.object({
  changes: z.array(SyncChangeSchema).max(100_000),
  /**
   * The broker fills a /work it never pushed to since a pristine restore: the agent records
   * what it applies (when /work was empty at the first such batch), so `mark` needs no scan.
   */
  fresh: z.boolean().optional(),
  /** After applying, take a sync marker (as sync.mark) and return it: one round trip less. */
  mark: z.boolean().optional(),
  /**
   * The marker the broker last pulled from, on every batch of a push: the marker `mark`
   * returns is that one plus what the push applied (no scan), so what the guest changed
   * since that pull is still pulled after the call instead of becoming the baseline.
   */
  since: z.string().min(1).max(64).optional(),
});
export const SyncApplyResultSchema = z.object({
  applied: z.number().int(),
  failed: z.array(z.object({ index: z.number().int(), path: bytes, code: ErrorCodeSchema, message: z.string() })),
  marker: z.string().optional(),
  entries: z.number().int().optional(),
  /** How the marker was taken: from what this push recorded, or by scanning /work. */
  markedBy: z.enum(['recorded', 'scan']).optional(),
});

export const SyncMarkParamsSchema = z.object({});
export const SyncMarkResultSchema = z.object({ marker: z.string(), entries: z.number().int() });

/** One changed entry since a marker; small files carry their content inline, larger ones are fetched with sync.read. */
export const SyncEntrySchema = z.object({
  path: SyncPath,
  kind: z.enum(['file', 'dir', 'symlink', 'deleted']),
  mode: z.number().int().optional(),
  size: z.number().int().optional(),
  mtimeMs: z.number().optional(),
  target: SyncTarget.optional(),
  data: bytes.optional(),
});
export type SyncEntry = z.infer<typeof SyncEntrySchema>;
/** An entry that exists but the sync cannot carry (a FIFO, socket or device; a file above the size limit). */
export const SyncSkippedSchema = z.object({ path: SyncPath, code: ErrorCodeSchema, message: z.string() });
export type SyncSkipped = z.infer<typeof SyncSkippedSchema>;
/**
 * sync.changes answers on a stream, not in its response: a change set has no size bound
 * (npm install makes 100,000 files) while a frame has. The stream carries records, each
 * one frame-codec frame holding a batch, sent with the stream's flow control. Deletions
 * come first (deepest first), then everything else parents first. While the agent scans
 * it sends an empty record every second, so the broker can tell slow from stuck.
 */
export const SyncChangesBatchSchema = z.object({ changes: z.array(SyncEntrySchema), skipped: z.array(SyncSkippedSchema) });
export type SyncChangesBatch = z.infer<typeof SyncChangesBatchSchema>;
/** Largest record on a sync.changes stream (a batch is cut well below it). */
export const SYNC_RECORD_MAX_BYTES = 1024 * 1024;
/** What the tenant changed outside the workspace, and what still runs: the broker's release decision. */
export const StateParamsSchema = z.object({ maxPaths: z.number().int().positive().max(10_000).optional() });
export const StateResultSchema = z.object({
  /** Anything written outside /work and /tmp (the overlay's upper layer is not empty). */
  dirty: z.boolean(),
  /** Up to maxPaths changed paths, root-relative (home/tenant/.gitconfig). */
  dirtyPaths: z.array(z.string()),
  /** Tenant processes alive now (in the workload cgroup, or the agent's other children). */
  processes: z.number().int(),
  /** Whether the answer is known: false when the agent has no overlay to look at (not in a VM). */
  tracked: z.boolean(),
});
export const SyncChangesParamsSchema = z.object({
  since: z.string().min(1).max(64),
  /** Outbound stream (agent -> broker) that carries the batches. */
  stream: streamId,
  /** Files up to this size come inline (capped by the agent to keep records small). */
  inlineMaxBytes: z.number().int().nonnegative().max(16 * 1024 * 1024).optional(),
  /** Files above this size are reported as skipped (too_large) instead of listed. */
  maxFileBytes: z.number().int().nonnegative().optional(),
  /** Also answer agent.state after the scan: the pull after every call then needs one round trip, not two. */
  state: StateParamsSchema.optional(),
});
export const SyncChangesResultSchema = z.object({
  marker: z.string(),
  /** Entries the workspace holds now (what the next scan walks: deadlines are sized by it). */
  entries: z.number().int(),
  /** Entries and skipped entries sent on the stream, and the batches they came in. */
  changes: z.number().int(),
  skipped: z.number().int(),
  batches: z.number().int(),
  /** With `state` asked: agent.state's answer, taken after the scan. */
  state: StateResultSchema.optional(),
});
export const SyncReadParamsSchema = z.object({ path: SyncPath, stream: streamId });
export const SyncReadResultSchema = z.object({ bytes: z.number().int() });

// ---------- misc ----------
export const PingParamsSchema = z.object({}).passthrough();
export const PingResultSchema = z.object({ now: z.number(), uptimeMs: z.number() });
export const ExecSignalParamsSchema = z.object({ call: z.number().int().nonnegative(), signal: SignalSchema });
export const ExecSignalResultSchema = z.object({ delivered: z.boolean() });
/** After a snapshot restore: fresh entropy (clones share RNG state) and the host's clock. */
export const ResumeParamsSchema = z.object({
  unixTimeMs: z.number().positive(),
  entropy: z.custom<Uint8Array>((v) => v instanceof Uint8Array && v.length >= 32 && v.length <= 4096, '32..4096 bytes of entropy'),
  /** The session's workspace quota: /work is remounted with size= and nr_inodes= from it. */
  work: z.object({ bytes: z.number().int().positive(), files: z.number().int().positive() }).optional(),
});
export const ResumeResultSchema = z.object({
  /** The broker's time minus the guest's when the call arrived. */
  clockDeltaMs: z.number(),
  /** True only once the clock was really set (`date -s` succeeded). */
  clockSet: z.boolean(),
  reseeded: z.boolean(),
  /** The guest's clock when it answered: the broker checks it against its own. */
  guestNowMs: z.number(),
  /** Why the clock could not be set. */
  clockError: z.string().optional(),
  clockNote: z.string().optional(),
  /** Why /work could not be sized from the quota (absent when it was, or none was asked). */
  workError: z.string().optional(),
});
/** Before a snapshot: the agent ends its session and waits for the next broker on a fresh port open. */
export const DetachParamsSchema = z.object({});
export const DetachResultSchema = z.object({ detached: z.boolean() });
/** Fault injection (soak bench): the agent process exits. Only the broker can reach it. */
export const DebugExitParamsSchema = z.object({ code: z.number().int().min(1).max(125).optional() });
export const DebugExitResultSchema = z.object({ exiting: z.boolean() });
export const DebugEchoParamsSchema = z.object({ input: streamId, output: streamId });
export const DebugEchoResultSchema = z.object({ bytes: z.number().int() });

export const METHODS = {
  ping: { params: PingParamsSchema, result: PingResultSchema },
  exec: { params: ExecParamsSchema, result: ExecResultSchema },
  'exec.signal': { params: ExecSignalParamsSchema, result: ExecSignalResultSchema },
  'fs.read': { params: ReadParamsSchema, result: ReadResultSchema },
  'fs.write': { params: WriteParamsSchema, result: WriteResultSchema },
  'fs.edit': { params: EditParamsSchema, result: EditResultSchema },
  'fs.glob': { params: GlobParamsSchema, result: GlobResultSchema },
  'fs.grep': { params: GrepParamsSchema, result: GrepResultSchema },
  'fs.list': { params: ListParamsSchema, result: ListResultSchema },
  'fs.stat': { params: StatParamsSchema, result: StatResultSchema },
  'fs.mkdir': { params: MkdirParamsSchema, result: MkdirResultSchema },
  'fs.remove': { params: RemoveParamsSchema, result: RemoveResultSchema },
  'fs.move': { params: MoveParamsSchema, result: MoveResultSchema },
  'sync.apply': { params: SyncApplyParamsSchema, result: SyncApplyResultSchema },
  'sync.mark': { params: SyncMarkParamsSchema, result: SyncMarkResultSchema },
  'sync.changes': { params: SyncChangesParamsSchema, result: SyncChangesResultSchema },
  'sync.read': { params: SyncReadParamsSchema, result: SyncReadResultSchema },
  'agent.resume': { params: ResumeParamsSchema, result: ResumeResultSchema },
  'agent.state': { params: StateParamsSchema, result: StateResultSchema },
  'agent.detach': { params: DetachParamsSchema, result: DetachResultSchema },
  'debug.exit': { params: DebugExitParamsSchema, result: DebugExitResultSchema },
  /** Copies one inbound stream to one outbound stream: protocol tests and the throughput bench. */
  'debug.echo': { params: DebugEchoParamsSchema, result: DebugEchoResultSchema },
  ...MEMORY_METHODS,
  ...TELEMETRY_METHODS,
  ...NET_METHODS,
} as const;

export type MethodName = keyof typeof METHODS;
export type ParamsOf<M extends MethodName> = z.input<(typeof METHODS)[M]['params']>;
export type ResultOf<M extends MethodName> = z.output<(typeof METHODS)[M]['result']>;

export function isMethodName(m: string): m is MethodName {
  return Object.prototype.hasOwnProperty.call(METHODS, m);
}

/** Events the agent pushes without being asked. */
export const EVENTS = {
  /** A structured log line from the agent, forwarded so guest problems show up in broker logs. */
  log: z.object({ level: z.enum(['debug', 'info', 'warn', 'error']), msg: z.string(), fields: z.record(z.string(), z.unknown()).optional() }),
  /** The agent finished starting (or resumed after a restore) and serves calls. */
  ready: z.object({ pid: z.number().int(), bootMs: z.number().optional() }),
  ...TELEMETRY_EVENTS,
} as const;
export type EventName = keyof typeof EVENTS;
export type EventData<E extends EventName> = z.infer<(typeof EVENTS)[E]>;
export function isEventName(n: string): n is EventName {
  return Object.prototype.hasOwnProperty.call(EVENTS, n);
}
