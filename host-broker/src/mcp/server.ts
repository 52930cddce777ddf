/**
 * hutch as an MCP server: sandbox tools for coding agents (Claude Code, opencode, Cursor).
 *
 * The tools talk to a broker through the SDK, exactly as a harness would, so the broker's
 * principals, routing and limits apply unchanged: this module adds no second path to
 * sessions. `hutch mcp` serves it over stdio (mcp/stdio.ts); the broker serves it over
 * Streamable HTTP at /mcp (mcp/http.ts), each HTTP session with its caller's token.
 */
import { readFileSync } from 'node:fs';
import { McpServer } from '@modelcontextprotocol/sdk/server/mcp.js';
import type { CallToolResult } from '@modelcontextprotocol/sdk/types.js';
import { z } from 'zod';
import { HutchError, toHutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { CallInfo, Hutch, Sandbox } from '../sdk/index.ts';

const VERSION = (JSON.parse(readFileSync(new URL('../../../package.json', import.meta.url), 'utf8')) as { version: string }).version;

/**
 * What `create_sandbox` accepts as `template`. hutch has one guest image today; the name is
 * part of the tool so agents' configs keep working when more exist. An unknown name is
 * refused (not_found) rather than silently replaced by the default.
 */
const TEMPLATES: Record<string, { cpus?: number; memoryMiB?: number }> = { default: {} };

/** A broker connection made on first use and made again after it drops (HTTP sessions outlive a broker restart's socket). */
export class HutchLink {
  private conn: Promise<Hutch> | undefined;
  private readonly sandboxes = new Map<string, Sandbox>();

  constructor(private readonly connect: () => Promise<Hutch>) {}

  hutch(): Promise<Hutch> {
    this.conn ??= this.connect().catch((err: unknown) => {
      this.conn = undefined;
      throw err;
    });
    return this.conn;
  }

  /** The sandbox by id; the broker answers not_found for another principal's (or a missing) one. */
  async sandbox(id: string): Promise<Sandbox> {
    const known = this.sandboxes.get(id);
    if (known) return known;
    const sb = await (await this.hutch()).attach(id);
    this.sandboxes.set(id, sb);
    return sb;
  }

  remember(sb: Sandbox): void {
    this.sandboxes.set(sb.id, sb);
  }

  forget(id: string): void {
    this.sandboxes.delete(id);
  }

  /** A closed connection is not retried by the SDK: drop it, so the next call connects afresh. */
  failed(err: HutchError): void {
    if (err.code !== 'connection_closed') return;
    void this.conn?.then((h) => h.close(), () => undefined);
    this.conn = undefined;
    this.sandboxes.clear();
  }

  async close(): Promise<void> {
    const c = this.conn;
    this.conn = undefined;
    this.sandboxes.clear();
    (await c?.catch(() => undefined))?.close();
  }
}

/** Where a call ran and why, as the line an agent reads under every result. */
function where(i: CallInfo): string {
  return `[ran ${i.route}: ${i.reason}; hutch added ${i.addedMs.toFixed(1)} ms${i.woke ? '; woke the VM' : ''}]`;
}

function info(i: CallInfo): Record<string, unknown> {
  return { route: i.route, reason: i.reason, addedMs: i.addedMs, woke: i.woke, ...(i.syncErrors ? { syncErrors: i.syncErrors } : {}), ...(i.syncErrorsOmitted ? { syncErrorsOmitted: i.syncErrorsOmitted } : {}) };
}

/** How a cut answer says so: where the walk stopped short, or that there is more. */
function cutNote(r: { truncated: boolean; walkLimit?: 'depth' | 'entries' | undefined; nextOffset?: number | undefined }): string {
  if (!r.truncated) return '';
  if (r.walkLimit) return `, truncated: the search stopped at its ${r.walkLimit === 'depth' ? 'depth' : 'entry'} limit, narrow the path`;
  return r.nextOffset !== undefined ? `, truncated: more with offset=${r.nextOffset}` : ', truncated';
}

function ok(text: string, structured: Record<string, unknown>): CallToolResult {
  return { content: [{ type: 'text', text }], structuredContent: structured };
}

/** A failure as an MCP tool error: the typed code first, so an agent (or a test) can branch on it. */
export function toolError(err: unknown): CallToolResult {
  const e = toHutchError(err);
  // A command that ran before the call failed (its changes refused by the quota) still printed something.
  const ran = e.context?.['result'] as { exitCode?: unknown; stdout?: unknown; stderr?: unknown } | undefined;
  const out = ran && typeof ran.stdout === 'string' && typeof ran.stderr === 'string' ? { exitCode: ran.exitCode, stdout: ran.stdout, stderr: ran.stderr } : undefined;
  const text = out ? [`${e.code}: ${e.message}`, out.stdout, out.stderr ? `[stderr]\n${out.stderr}` : '', `[exit ${String(out.exitCode)}]`].filter(Boolean).join('\n') : `${e.code}: ${e.message}`;
  return {
    isError: true,
    content: [{ type: 'text', text }],
    structuredContent: { error: { code: e.code, message: e.message, ...(out ? { result: out } : {}) } },
  };
}

const sandboxId = z.string().min(1).describe('The id create_sandbox returned');

/** An McpServer whose tools act through `link` (one per MCP session: an McpServer serves one transport). */
export function createMcpServer(link: HutchLink): McpServer {
  const server = new McpServer({ name: 'hutch', version: VERSION }, { instructions: 'Sandboxes for running code: create_sandbox, then run_command and the file tools on its id; close_sandbox when done. Every result says where it ran (inprocess, fastpath or vm) and why.' });

  /** Runs a tool body; a HutchError (or anything thrown) becomes a tool error with its code. */
  const guard = async (body: () => Promise<CallToolResult>): Promise<CallToolResult> => {
    try {
      return await body();
    } catch (err) {
      const e = toHutchError(err);
      link.failed(e);
      return toolError(e);
    }
  };

  server.registerTool(
    'create_sandbox',
    {
      description: 'Create a sandbox (a workspace with its own microVM, woken on demand). Returns its id, which every other tool takes.',
      inputSchema: {
        template: z.string().min(1).optional().describe(`Template name (${Object.keys(TEMPLATES).join(', ')}); default "default"`),
        files: z.record(z.string(), z.string()).optional().describe('Initial workspace files: relative path -> text content'),
        cpus: z.number().int().min(1).max(64).optional(),
        memory_mib: z.number().int().min(64).optional(),
        network: z
          .union([z.enum(['none', 'default', 'public']), z.object({ base: z.enum(['none', 'default', 'public']).optional(), allow: z.array(z.string()).optional(), deny: z.array(z.string()).optional() })])
          .optional()
          .describe("Where the sandbox's traffic may go: none, default (the broker's: package registries), public, or {allow, deny} rules (domains, *.suffix, CIDRs, optional :port; deny wins)"),
      },
    },
    (a) =>
      guard(async () => {
        const name = a.template ?? 'default';
        const t = Object.hasOwn(TEMPLATES, name) ? TEMPLATES[name] : undefined;
        if (!t) throw new HutchError('not_found', `no template ${JSON.stringify(name)} (this broker has: ${Object.keys(TEMPLATES).join(', ')})`, { template: name });
        const hutch = await link.hutch();
        const cpus = a.cpus ?? t.cpus;
        const memoryMiB = a.memory_mib ?? t.memoryMiB;
        const sb = await hutch.create({ ...(cpus ? { cpus } : {}), ...(memoryMiB ? { memoryMiB } : {}), ...(a.files ? { workspace: { files: a.files } } : {}), ...(a.network ? { network: a.network } : {}) });
        link.remember(sb);
        const s = sb.info;
        return ok(`sandbox ${s.session} created (template ${name}, backend ${s.backend}, ${s.cpus} cpu, ${s.memoryMiB} MiB); read-only commands run in the fast path, the rest in its VM`, {
          sandbox_id: s.session,
          template: name,
          backend: s.backend,
          cpus: s.cpus,
          memoryMiB: s.memoryMiB,
          ...(s.network ? { network: s.network } : {}),
        });
      }),
  );

  server.registerTool(
    'run_command',
    {
      description: "Run a shell command (bash -c) in the sandbox's workspace. Returns stdout, stderr, the exit code, and where it ran (fastpath or vm) with the router's reason.",
      inputSchema: {
        sandbox_id: sandboxId,
        command: z.string().min(1),
        timeout_ms: z.number().int().positive().optional(),
        stdin: z.string().optional(),
        env: z.record(z.string(), z.string()).optional(),
        max_output_bytes: z.number().int().nonnegative().optional(),
      },
      annotations: { openWorldHint: true },
    },
    (a, extra) =>
      guard(async () => {
        const sb = await link.sandbox(a.sandbox_id);
        // The MCP request's cancellation (notifications/cancelled, a closed HTTP stream) kills the command.
        const r = await sb.run(a.command, {
          signal: extra.signal,
          ...(a.timeout_ms !== undefined ? { timeoutMs: a.timeout_ms } : {}),
          ...(a.stdin !== undefined ? { stdin: a.stdin } : {}),
          ...(a.env ? { env: a.env } : {}),
          ...(a.max_output_bytes !== undefined ? { maxOutputBytes: a.max_output_bytes } : {}),
        });
        const status = r.timedOut ? 'timed out' : r.signal ? `killed by ${r.signal}` : `exit ${r.exitCode}`;
        const text = [r.stdout, r.stderr ? `[stderr]\n${r.stderr}` : '', `[${status}${r.truncated ? ', output truncated' : ''}] ${where(r)}`].filter(Boolean).join('\n');
        return ok(text, { exitCode: r.exitCode, signal: r.signal, timedOut: r.timedOut, stdout: r.stdout, stderr: r.stderr, truncated: r.truncated, ...info(r) });
      }),
  );

  server.registerTool(
    'read_file',
    {
      description: 'Read a text file of the workspace (lines from offset, up to limit, default 2000; at most 50 KiB: a longer answer says the offset to go on from).',
      inputSchema: { sandbox_id: sandboxId, path: z.string().min(1), offset: z.number().int().nonnegative().optional(), limit: z.number().int().positive().optional() },
      annotations: { readOnlyHint: true },
    },
    (a) =>
      guard(async () => {
        const sb = await link.sandbox(a.sandbox_id);
        const r = await sb.files.read(a.path, { ...(a.offset !== undefined ? { offset: a.offset } : {}), ...(a.limit !== undefined ? { limit: a.limit } : {}) });
        const cut = r.truncated ? ', cut at 50 KiB' : '';
        const more = r.hasMore ? ` (lines ${r.offset + 1}-${r.offset + r.lines} of ${r.totalLines}${cut}; more with offset=${r.nextOffset})` : '';
        return ok(`${r.content}\n${where(r)}${more}`, {
          path: r.path,
          content: r.content,
          offset: r.offset,
          lines: r.lines,
          totalLines: r.totalLines,
          hasMore: r.hasMore,
          truncated: r.truncated,
          ...(r.nextOffset !== undefined ? { nextOffset: r.nextOffset } : {}),
          ...info(r),
        });
      }),
  );

  server.registerTool(
    'write_file',
    {
      description: 'Write a file of the workspace (created with its parent directories, or replaced).',
      inputSchema: { sandbox_id: sandboxId, path: z.string().min(1), content: z.string() },
    },
    (a) =>
      guard(async () => {
        const r = await (await link.sandbox(a.sandbox_id)).files.write(a.path, a.content);
        return ok(`${r.created ? 'created' : 'replaced'} ${r.path} (${r.bytes} bytes) ${where(r)}`, { path: r.path, bytes: r.bytes, created: r.created, ...info(r) });
      }),
  );

  server.registerTool(
    'edit_file',
    {
      description: 'Replace old_string with new_string in a file (exactly one occurrence unless replace_all).',
      inputSchema: { sandbox_id: sandboxId, path: z.string().min(1), old_string: z.string(), new_string: z.string(), replace_all: z.boolean().optional() },
    },
    (a) =>
      guard(async () => {
        const sb = await link.sandbox(a.sandbox_id);
        const r = await sb.files.edit(a.path, a.old_string, a.new_string, a.replace_all !== undefined ? { replaceAll: a.replace_all } : {});
        return ok(`edited ${r.path}: ${r.replacements} replacement(s) ${where(r)}`, { path: r.path, replacements: r.replacements, bytes: r.bytes, ...info(r) });
      }),
  );

  server.registerTool(
    'glob',
    {
      description: 'Files of the workspace matching a glob pattern (e.g. "**/*.ts").',
      inputSchema: { sandbox_id: sandboxId, pattern: z.string().min(1), path: z.string().min(1).optional() },
      annotations: { readOnlyHint: true },
    },
    (a) =>
      guard(async () => {
        const r = await (await link.sandbox(a.sandbox_id)).files.glob(a.pattern, a.path ? { path: a.path } : {});
        return ok(`${r.files.join('\n')}${r.files.length ? '\n' : ''}[${r.files.length} file(s)${cutNote(r)}] ${where(r)}`, { files: r.files, truncated: r.truncated, ...(r.walkLimit ? { walkLimit: r.walkLimit } : {}), ...info(r) });
      }),
  );

  server.registerTool(
    'grep',
    {
      description: 'Lines of workspace files matching a regular expression.',
      inputSchema: { sandbox_id: sandboxId, pattern: z.string().min(1), path: z.string().min(1).optional(), include: z.string().min(1).optional().describe('Glob of files to search, e.g. "*.py"') },
      annotations: { readOnlyHint: true },
    },
    (a) =>
      guard(async () => {
        const sb = await link.sandbox(a.sandbox_id);
        const r = await sb.files.grep(a.pattern, { ...(a.path ? { path: a.path } : {}), ...(a.include ? { include: a.include } : {}) });
        const lines = r.matches.map((m) => `${m.path}:${m.line}: ${m.text}`);
        return ok(`${lines.join('\n')}${lines.length ? '\n' : ''}[${r.matches.length} match(es) in ${r.filesSearched} file(s)${cutNote(r)}] ${where(r)}`, {
          matches: r.matches,
          truncated: r.truncated,
          ...(r.walkLimit ? { walkLimit: r.walkLimit } : {}),
          filesSearched: r.filesSearched,
          ...info(r),
        });
      }),
  );

  server.registerTool(
    'list',
    {
      description: 'Entries of a workspace directory (the root by default), recursively (at most 100; a truncated answer says the offset to go on from).',
      inputSchema: {
        sandbox_id: sandboxId,
        path: z.string().min(1).optional(),
        ignore: z.array(z.string()).optional().describe('Glob patterns to leave out'),
        offset: z.number().int().nonnegative().optional().describe('Entries to pass over first (a truncated answer says where to go on)'),
      },
      annotations: { readOnlyHint: true },
    },
    (a) =>
      guard(async () => {
        const r = await (await link.sandbox(a.sandbox_id)).files.list(a.path, { ...(a.ignore ? { ignore: a.ignore } : {}), ...(a.offset !== undefined ? { offset: a.offset } : {}) });
        const lines = r.entries.map((e) => (e.type === 'dir' ? `${e.path}/` : e.path));
        return ok(`${lines.join('\n')}${lines.length ? '\n' : ''}[${r.entries.length} entr${r.entries.length === 1 ? 'y' : 'ies'}${cutNote(r)}] ${where(r)}`, {
          path: r.path,
          entries: r.entries,
          truncated: r.truncated,
          ...(r.nextOffset !== undefined ? { nextOffset: r.nextOffset } : {}),
          ...(r.walkLimit ? { walkLimit: r.walkLimit } : {}),
          ...info(r),
        });
      }),
  );

  server.registerTool(
    'list_sandboxes',
    { description: 'Sandboxes this token owns (ids to pass to the other tools).', inputSchema: {}, annotations: { readOnlyHint: true } },
    () =>
      guard(async () => {
        const { sessions: all, unavailable } = await (await link.hutch()).listSessions();
        // Through a gateway, brokers that did not answer in time: their sandboxes are missing from the list.
        const missing = unavailable?.length ? `\n(brokers not answering, their sandboxes not listed: ${unavailable.join(', ')})` : '';
        return ok((all.length ? all.map((s) => `${s.session} (${s.live ? 'VM live' : 'VM released'}, ${s.calls} calls, since ${s.createdAt})`).join('\n') : 'no sandboxes') + missing, {
          sandboxes: all.map((s) => ({ sandbox_id: s.session, live: s.live, calls: s.calls, createdAt: s.createdAt })),
          ...(unavailable?.length ? { unavailable_brokers: unavailable } : {}),
        });
      }),
  );

  server.registerTool(
    'close_sandbox',
    {
      description: 'Close a sandbox: its VM stops and its workspace is deleted (unless keep_workspace).',
      inputSchema: { sandbox_id: sandboxId, keep_workspace: z.boolean().optional() },
      annotations: { destructiveHint: true },
    },
    (a) =>
      guard(async () => {
        const sb = await link.sandbox(a.sandbox_id);
        const r = await sb.close(a.keep_workspace !== undefined ? { keepWorkspace: a.keep_workspace } : {});
        link.forget(a.sandbox_id);
        return ok(`sandbox ${r.session} closed${r.kept ? ' (workspace kept)' : ''}`, { sandbox_id: r.session, kept: r.kept });
      }),
  );

  return server;
}
