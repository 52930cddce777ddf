import { cp, lstat } from 'node:fs/promises';
import type { z } from 'zod';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { FileTools } from '../../../guest-agent/src/workspace/file-tools.ts';
import type { WorkspaceSourceSchema } from '../api/harness-protocol.ts';
import type { FastPathRunner } from '../tools/fastpath-runner.ts';

export type WorkspaceSource = z.infer<typeof WorkspaceSourceSchema>;

/** Largest tar accepted when creating a session. */
export const MAX_TAR_BYTES = 512 * 1024 * 1024;

/**
 * Fills a fresh workspace. A directory on the broker's host is copied with symlinks kept
 * as symlinks (never followed); a tar is unpacked inside the fast-path sandbox, where it
 * can write nothing but the workspace whatever its member names or links say; a file map
 * goes through the confined file tools.
 */
export async function populateWorkspace(dir: string, source: WorkspaceSource, deps: { files: FileTools; fastPath: FastPathRunner }): Promise<void> {
  if ('dir' in source) {
    const st = await lstat(source.dir).catch(() => undefined);
    if (!st?.isDirectory()) throw new HutchError('not_found', `workspace source ${source.dir} is not a directory on the broker's host`, { dir: source.dir });
    await cp(source.dir, dir, { recursive: true, verbatimSymlinks: true, preserveTimestamps: true, force: true });
    return;
  }
  if ('tar' in source) {
    if (source.tar.length > MAX_TAR_BYTES) throw new HutchError('too_large', `workspace tar of ${source.tar.length} bytes is above ${MAX_TAR_BYTES}`);
    const r = await deps.fastPath.run({
      command: 'tar -x --no-same-owner --no-same-permissions --delay-directory-restore -f -',
      workspace: dir,
      stdin: source.tar,
      timeoutMs: 120_000,
      maxOutputBytes: 64 * 1024,
    });
    if (r.exitCode !== 0) throw new HutchError('bad_request', `workspace tar could not be unpacked (tar exit ${r.exitCode ?? r.signal})`);
    return;
  }
  for (const [path, content] of Object.entries(source.files)) await deps.files.write({ path, content });
}
