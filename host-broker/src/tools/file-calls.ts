import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { ToolArgs, type ToolName } from '../api/harness-protocol.ts';
import type { FileToolTarget } from './agent-file-tools.ts';

export type FileToolName = Exclude<ToolName, 'bash'>;

/** Validates a tool call's arguments (opencode's names) with the harness schema. */
export function parseToolArgs<T extends ToolName>(tool: T, raw: unknown): ReturnType<(typeof ToolArgs)[T]['parse']> {
  const r = ToolArgs[tool].safeParse(raw);
  if (!r.success) {
    const summary = r.error.issues.slice(0, 3).map((i) => `${i.path.join('.') || '(args)'}: ${i.message}`).join('; ');
    throw new HutchError('bad_request', `invalid ${tool} arguments: ${summary}`, { tool });
  }
  return r.data as ReturnType<(typeof ToolArgs)[T]['parse']>;
}

/**
 * Runs one of opencode's file tools on a workspace: the mapping from the harness's
 * argument names to the file tools, shared by the broker and the bare-host baseline.
 * Returns the tool's result and the workspace path it wrote, if any.
 */
export async function runFileTool(files: FileToolTarget, tool: FileToolName, raw: unknown): Promise<{ result: unknown; wrote?: string }> {
  switch (tool) {
    case 'read': {
      const a = parseToolArgs('read', raw);
      return { result: await files.read({ path: a.filePath, ...(a.offset !== undefined ? { offset: a.offset } : {}), ...(a.limit !== undefined ? { limit: a.limit } : {}) }) };
    }
    case 'write': {
      const a = parseToolArgs('write', raw);
      const w = await files.write({ path: a.filePath, content: a.content });
      return { result: w, wrote: w.path };
    }
    case 'edit': {
      const a = parseToolArgs('edit', raw);
      const e = await files.edit({ path: a.filePath, oldString: a.oldString, newString: a.newString, ...(a.replaceAll !== undefined ? { replaceAll: a.replaceAll } : {}) });
      return { result: e, wrote: e.path };
    }
    case 'glob': {
      const a = parseToolArgs('glob', raw);
      return { result: await files.glob({ pattern: a.pattern, ...(a.path ? { path: a.path } : {}) }) };
    }
    case 'grep': {
      const a = parseToolArgs('grep', raw);
      return { result: await files.grep({ pattern: a.pattern, ...(a.path ? { path: a.path } : {}), ...(a.include ? { include: a.include } : {}) }) };
    }
    case 'list': {
      const a = parseToolArgs('list', raw);
      return { result: await files.list({ ...(a.path ? { path: a.path } : {}), ...(a.ignore ? { ignore: a.ignore } : {}), ...(a.offset !== undefined ? { offset: a.offset } : {}) }) };
    }
  }
}
