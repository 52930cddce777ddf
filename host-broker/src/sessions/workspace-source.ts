import { constants } from 'node:fs';
import { mkdir, open, opendir, readlink, realpath, symlink, utimes } from 'node:fs/promises';
import { join, sep } from 'node:path';
import type { z } from 'zod';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { FileTools } from '../../../guest-agent/src/workspace/file-tools.ts';
import type { WorkspaceSourceSchema } from '../api/harness-protocol.ts';
import type { FastPathRunner } from '../tools/fastpath-runner.ts';

export type WorkspaceSource = z.infer<typeof WorkspaceSourceSchema>;

/** Largest tar accepted when creating a session. */
export const MAX_TAR_BYTES = 512 * 1024 * 1024;

export interface PopulateDeps {
  files: FileTools;
  fastPath: FastPathRunner;
  /** Host directories a `dir` source may come from (the operator's --workspace-root); none = refused. */
  roots: readonly string[];
}

/**
 * Fills a fresh workspace. A directory on the broker's host is copied only from under a
 * configured root, regular files and directories only, symlinks kept as symlinks (never
 * followed); a tar is unpacked inside the fast-path sandbox, where it can write nothing but
 * the workspace whatever its member names or links say; a file map goes through the
 * confined file tools.
 */
export async function populateWorkspace(dir: string, source: WorkspaceSource, deps: PopulateDeps): Promise<void> {
  if ('dir' in source) {
    const from = await sourceUnderRoots(source.dir, deps.roots);
    await copyTree(from, dir);
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

/**
 * The real path of a requested source directory, if it lies under one of the roots. Both
 * sides are resolved, so a symlink inside a root cannot point the copy elsewhere; the
 * error never says which roots exist or what the host has.
 */
async function sourceUnderRoots(requested: string, roots: readonly string[]): Promise<string> {
  if (roots.length === 0) {
    throw new HutchError('permission_denied', 'directory sources are disabled on this broker (the operator can allow some with --workspace-root DIR)');
  }
  const refused = new HutchError('permission_denied', 'workspace source directory is not under a configured workspace root', { dir: requested });
  let real: string;
  try {
    real = await realpath(requested);
  } catch {
    throw refused;
  }
  for (const root of roots) {
    const r = await realpath(root).catch(() => undefined);
    if (r !== undefined && (real === r || real.startsWith(r.endsWith(sep) ? r : r + sep))) {
      const d = await opendir(real).catch(() => undefined);
      if (!d) throw refused;
      await d.close();
      return real;
    }
  }
  throw refused;
}

/**
 * Copies a host tree: directories and regular files (permission bits without setuid,
 * setgid or sticky), symlinks as symlinks. Devices, FIFOs and sockets are skipped, never
 * opened: reading one could block forever or return endless data. Each file is opened
 * with O_NOFOLLOW | O_NONBLOCK and checked with fstat, so a name swapped for a symlink or
 * a FIFO after the listing is not followed or read.
 */
async function copyTree(from: string, to: string): Promise<void> {
  const dir = await opendir(from);
  for await (const e of dir) {
    const src = join(from, e.name);
    const dst = join(to, e.name);
    if (e.isSymbolicLink()) {
      await symlink(await readlink(src), dst);
    } else if (e.isDirectory()) {
      await mkdir(dst, { mode: 0o755 });
      await copyTree(src, dst);
    } else if (e.isFile()) {
      await copyFile(src, dst);
    }
  }
}

async function copyFile(src: string, dst: string): Promise<void> {
  let fh;
  try {
    fh = await open(src, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ELOOP') return; // became a symlink since the listing
    throw err;
  }
  try {
    const st = await fh.stat();
    if (!st.isFile()) return;
    const out = await open(dst, constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL | constants.O_NOFOLLOW, st.mode & 0o777);
    try {
      const buf = Buffer.allocUnsafe(1024 * 1024);
      for (;;) {
        const { bytesRead } = await fh.read(buf, 0, buf.length, null);
        if (bytesRead === 0) break;
        await out.write(buf, 0, bytesRead);
      }
      await out.chmod(st.mode & 0o777);
    } finally {
      await out.close();
    }
    await utimes(dst, st.atime, st.mtime);
  } finally {
    await fh.close();
  }
}
