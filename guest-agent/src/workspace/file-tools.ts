import { constants, promises as fsp, type Stats } from 'node:fs';
import type { z } from 'zod';
import { HutchError, toHutchError } from '../protocol/errors.ts';
import type {
  EditParamsSchema,
  GlobParamsSchema,
  GrepParamsSchema,
  ListParamsSchema,
  MkdirParamsSchema,
  MoveParamsSchema,
  ReadParamsSchema,
  RemoveParamsSchema,
  ResultOf,
  StatParamsSchema,
  WriteParamsSchema,
} from '../protocol/methods.ts';
import { writeFileAtomic } from './atomic-write.ts';
import type { ResolvedPath, Workspace } from './confine.ts';
import { compileGlob } from './glob-match.ts';
import { countOccurrences, looksBinary, MAX_LINE_CHARS, splitLines } from './text.ts';
import { walk, type WalkType } from './walk.ts';

/** Directories the listing and search tools skip, as opencode's do. */
export const DEFAULT_IGNORED_DIRS: ReadonlySet<string> = new Set([
  '.git', 'node_modules', '__pycache__', '.venv', 'venv', '.mypy_cache', '.pytest_cache', '.tox', 'dist', 'build', 'target', '.next', '.cache', 'coverage',
]);
/** Search tools skip only what is never source. */
const SEARCH_SKIPPED_DIRS: ReadonlySet<string> = new Set(['.git', 'node_modules']);

export interface FileToolsOptions {
  /** Largest file read, edited or searched (bytes). */
  maxFileBytes?: number;
  /** Owner of files and directories the tools create (the tenant user in the guest). */
  owner?: { uid: number; gid: number };
  /** fsync writes (the host workspace is the source of truth). */
  durable?: boolean;
}

type In<S extends z.ZodType> = z.output<S>;

const DEFAULT_READ_LIMIT = 2000;
const DEFAULT_FILE_MODE = 0o644;
const DEFAULT_DIR_MODE = 0o755;

/**
 * The file tools with opencode's semantics, all confined to one workspace. The same
 * class serves the agent's fs.* methods in the guest and the broker's in-process calls.
 */
export class FileTools {
  private readonly maxFileBytes: number;

  constructor(
    readonly ws: Workspace,
    private readonly opts: FileToolsOptions = {},
  ) {
    this.maxFileBytes = opts.maxFileBytes ?? 64 * 1024 * 1024;
  }

  async read(p: In<typeof ReadParamsSchema>): Promise<ResultOf<'fs.read'>> {
    return this.guard(p.path, async () => {
      const r = this.ws.resolve(p.path);
      const buf = await this.readRegular(r, p.path);
      if (looksBinary(buf)) throw new HutchError('binary_file', `${p.path} is a binary file`, { path: p.path, bytes: buf.length });
      const all = splitLines(buf.toString('utf8'));
      const offset = p.offset ?? 0;
      const limit = p.limit ?? DEFAULT_READ_LIMIT;
      if (offset > 0 && offset >= all.length) {
        throw new HutchError('bad_request', `offset ${offset} is beyond the end of ${p.path} (${all.length} lines)`, {
          path: p.path,
          offset,
          totalLines: all.length,
        });
      }
      const slice = all.slice(offset, offset + limit);
      let cut = 0;
      const numbered = p.numbered ?? true;
      const out = slice.map((line, i) => {
        let l = line;
        if (l.length > MAX_LINE_CHARS) {
          l = l.slice(0, MAX_LINE_CHARS) + '...';
          cut++;
        }
        return numbered ? `${String(offset + i + 1).padStart(5, '0')}| ${l}` : l;
      });
      return {
        path: this.ws.display(r.rel),
        content: out.join('\n'),
        offset,
        lines: slice.length,
        totalLines: all.length,
        longLinesCut: cut,
        hasMore: offset + slice.length < all.length,
      };
    });
  }

  async write(p: In<typeof WriteParamsSchema>): Promise<ResultOf<'fs.write'>> {
    return this.guard(p.path, async () => {
      const data = typeof p.content === 'string' ? Buffer.from(p.content, 'utf8') : p.content;
      if (data.length > this.maxFileBytes) {
        throw new HutchError('too_large', `${data.length} bytes exceeds the file limit of ${this.maxFileBytes}`, { path: p.path, limit: this.maxFileBytes });
      }
      const r = this.ws.resolve(p.path, { missing: 'parents' });
      if (r.stat?.isDirectory() || r.rel === '') throw new HutchError('is_a_directory', `${p.path} is a directory`, { path: p.path });
      if (r.stat && !r.stat.isFile()) throw new HutchError('bad_request', `${p.path} is not a regular file`, { path: p.path });
      await this.makeParents(r);
      await writeFileAtomic(r.abs, data, {
        mode: p.mode ?? (r.stat ? r.stat.mode : DEFAULT_FILE_MODE),
        owner: r.stat ? { uid: r.stat.uid, gid: r.stat.gid } : this.opts.owner,
        durable: this.opts.durable ?? false,
      });
      return { path: this.ws.display(r.rel), bytes: data.length, created: !r.stat };
    });
  }

  async edit(p: In<typeof EditParamsSchema>): Promise<ResultOf<'fs.edit'>> {
    return this.guard(p.path, async () => {
      if (p.oldString === p.newString) throw new HutchError('bad_request', 'oldString and newString are identical', { path: p.path });
      const r = this.ws.resolve(p.path, { missing: p.oldString === '' ? 'parents' : 'none' });
      if (p.oldString === '') {
        // Empty oldString creates a file (opencode); refusing to clobber content keeps it lossless.
        if (r.stat && (!r.stat.isFile() || r.stat.size > 0)) {
          throw new HutchError('already_exists', `${p.path} exists and is not empty; an empty oldString only creates files`, { path: p.path });
        }
        return this.write({ path: p.path, content: p.newString }).then((w) => ({ path: w.path, replacements: 1, bytes: w.bytes }));
      }
      const buf = await this.readRegular(r, p.path);
      if (looksBinary(buf)) throw new HutchError('binary_file', `${p.path} is a binary file`, { path: p.path });
      const text = buf.toString('utf8');
      const n = countOccurrences(text, p.oldString);
      if (n === 0) throw new HutchError('no_match', `oldString was not found in ${p.path} (0 matches)`, { path: p.path, matches: 0 });
      if (n > 1 && !p.replaceAll) {
        throw new HutchError('multiple_matches', `oldString matches ${n} times in ${p.path}; give more context or set replaceAll`, { path: p.path, matches: n });
      }
      const next = p.replaceAll ? text.split(p.oldString).join(p.newString) : text.replace(p.oldString, () => p.newString);
      const data = Buffer.from(next, 'utf8');
      const st = r.stat as Stats;
      await writeFileAtomic(r.abs, data, { mode: st.mode, owner: { uid: st.uid, gid: st.gid }, durable: this.opts.durable ?? false });
      return { path: this.ws.display(r.rel), replacements: p.replaceAll ? n : 1, bytes: data.length };
    });
  }

  async glob(p: In<typeof GlobParamsSchema>): Promise<ResultOf<'fs.glob'>> {
    return this.guard(p.path ?? '.', async () => {
      const base = this.dir(p.path);
      const match = compileGlob(p.pattern);
      const limit = p.limit ?? 100;
      const found: Array<{ rel: string; mtime: number }> = [];
      for await (const e of walk(base.abs, { skipDirs: SEARCH_SKIPPED_DIRS })) {
        if (e.type === 'dir' || !match(e.rel)) continue;
        const st = await fsp.lstat(`${base.abs}/${e.rel}`).catch(() => undefined);
        if (st) found.push({ rel: e.rel, mtime: st.mtimeMs });
      }
      // Newest first, as opencode: the file the agent just touched is what it looks for.
      found.sort((a, b) => b.mtime - a.mtime || (a.rel < b.rel ? -1 : 1));
      return { files: found.slice(0, limit).map((f) => this.childDisplay(base, f.rel)), truncated: found.length > limit };
    });
  }

  async grep(p: In<typeof GrepParamsSchema>): Promise<ResultOf<'fs.grep'>> {
    return this.guard(p.path ?? '.', async () => {
      let re: RegExp;
      try {
        re = new RegExp(p.pattern, p.ignoreCase ? 'i' : '');
      } catch (err) {
        throw new HutchError('bad_request', `invalid regular expression: ${(err as Error).message}`, { pattern: p.pattern });
      }
      const include = p.include ? compileGlob(p.include) : undefined;
      const limit = p.limit ?? 100;
      const start = this.ws.resolve(p.path ?? '.');
      const files: Array<{ rel: string; abs: string }> = [];
      if (start.stat?.isFile()) files.push({ rel: start.rel, abs: start.abs });
      else if (start.stat?.isDirectory()) {
        for await (const e of walk(start.abs, { skipDirs: SEARCH_SKIPPED_DIRS })) {
          if (e.type !== 'file' || (include && !include(e.rel))) continue;
          files.push({ rel: start.rel === '' ? e.rel : `${start.rel}/${e.rel}`, abs: `${start.abs}/${e.rel}` });
        }
      } else throw new HutchError('bad_request', `${p.path} is neither a file nor a directory`, { path: p.path });

      const perFile: Array<{ mtime: number; matches: Array<{ path: string; line: number; text: string }> }> = [];
      let total = 0;
      for (const f of files) {
        const fh = await fsp.open(f.abs, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK).catch(() => undefined);
        if (!fh) continue;
        try {
          const st = await fh.stat();
          if (!st.isFile() || st.size > this.maxFileBytes) continue;
          const buf = await fh.readFile();
          if (looksBinary(buf)) continue;
          const matches: Array<{ path: string; line: number; text: string }> = [];
          splitLines(buf.toString('utf8')).forEach((line, i) => {
            if (re.test(line)) matches.push({ path: f.rel, line: i + 1, text: line.length > MAX_LINE_CHARS ? line.slice(0, MAX_LINE_CHARS) + '...' : line });
          });
          if (matches.length) {
            perFile.push({ mtime: st.mtimeMs, matches });
            total += matches.length;
          }
        } finally {
          await fh.close();
        }
      }
      perFile.sort((a, b) => b.mtime - a.mtime);
      const all = perFile.flatMap((x) => x.matches);
      return { matches: all.slice(0, limit), truncated: total > limit, filesSearched: files.length };
    });
  }

  async list(p: In<typeof ListParamsSchema>): Promise<ResultOf<'fs.list'>> {
    return this.guard(p.path ?? '.', async () => {
      const base = this.dir(p.path);
      const limit = p.limit ?? 100;
      const ignore = p.ignore?.length ? p.ignore.map((g) => compileGlob(g)) : [];
      const entries: Array<{ path: string; type: WalkType }> = [];
      let truncated = false;
      const skip = (rel: string) => ignore.some((m) => m(rel));
      for await (const e of walk(base.abs, { skipDirs: DEFAULT_IGNORED_DIRS, skip })) {
        if (entries.length >= limit) {
          truncated = true;
          break;
        }
        entries.push({ path: e.rel, type: e.type });
      }
      return { path: this.ws.display(base.rel), entries, truncated };
    });
  }

  async stat(p: In<typeof StatParamsSchema>): Promise<ResultOf<'fs.stat'>> {
    return this.guard(p.path, async () => {
      const r = this.ws.resolve(p.path, { followFinal: false });
      const st = r.stat as Stats;
      const type = entryType(st);
      const out: ResultOf<'fs.stat'> = { path: this.ws.display(r.rel), type, size: st.size, mode: st.mode & 0o7777, mtimeMs: st.mtimeMs };
      if (type === 'symlink') out.target = await fsp.readlink(r.abs);
      return out;
    });
  }

  async mkdir(p: In<typeof MkdirParamsSchema>): Promise<ResultOf<'fs.mkdir'>> {
    return this.guard(p.path, async () => {
      const r = this.ws.resolve(p.path, { missing: p.parents ? 'parents' : 'final' });
      if (r.stat) {
        if (r.stat.isDirectory() && p.parents) return { path: this.ws.display(r.rel), created: false };
        throw new HutchError('already_exists', `${p.path} already exists`, { path: p.path });
      }
      await this.makeParents(r, true);
      return { path: this.ws.display(r.rel), created: true };
    });
  }

  async remove(p: In<typeof RemoveParamsSchema>): Promise<ResultOf<'fs.remove'>> {
    return this.guard(p.path, async () => {
      const r = this.ws.resolve(p.path, { followFinal: false });
      if (r.rel === '') throw new HutchError('bad_request', 'refusing to remove the workspace root', { path: p.path });
      const st = r.stat as Stats;
      if (st.isDirectory()) {
        if (p.recursive) await fsp.rm(r.abs, { recursive: true });
        else await fsp.rmdir(r.abs);
      } else await fsp.unlink(r.abs);
      return { path: this.ws.display(r.rel), removed: true };
    });
  }

  async move(p: In<typeof MoveParamsSchema>): Promise<ResultOf<'fs.move'>> {
    return this.guard(p.from, async () => {
      const from = this.ws.resolve(p.from, { followFinal: false });
      const to = this.ws.resolve(p.to, { followFinal: false, missing: 'parents' });
      if (from.rel === '' || to.rel === '') throw new HutchError('bad_request', 'cannot move the workspace root', { from: p.from, to: p.to });
      if (to.rel === from.rel || to.rel.startsWith(`${from.rel}/`)) throw new HutchError('bad_request', `cannot move ${p.from} into itself`, { from: p.from, to: p.to });
      if (to.stat && !p.overwrite) throw new HutchError('already_exists', `${p.to} already exists`, { path: p.to });
      await this.makeParents(to);
      await fsp.rename(from.abs, to.abs);
      return { from: this.ws.display(from.rel), to: this.ws.display(to.rel) };
    });
  }

  // ------------------------------------------------------------ helpers

  /** Runs a tool, turning errno failures into typed errors that name the tenant path, never the host path. */
  private async guard<T>(path: string, fn: () => Promise<T>): Promise<T> {
    try {
      return await fn();
    } catch (err) {
      throw toHutchError(err, { path });
    }
  }

  private dir(p: string | undefined): ResolvedPath {
    const r = this.ws.resolve(p ?? '.');
    if (!r.stat?.isDirectory()) throw new HutchError('not_a_directory', `${p} is not a directory`, { path: p });
    return r;
  }

  private childDisplay(base: ResolvedPath, rel: string): string {
    return base.rel === '' ? rel : `${base.rel}/${rel}`;
  }

  /** Reads a regular file without following a final symlink and without blocking on a FIFO. */
  private async readRegular(r: ResolvedPath, shown: string): Promise<Buffer> {
    if (!r.stat) throw new HutchError('not_found', `no such file: ${shown}`, { path: shown });
    if (r.stat.isDirectory()) throw new HutchError('is_a_directory', `${shown} is a directory`, { path: shown });
    if (!r.stat.isFile()) throw new HutchError('bad_request', `${shown} is not a regular file`, { path: shown });
    if (r.stat.size > this.maxFileBytes) {
      throw new HutchError('too_large', `${shown} is ${r.stat.size} bytes, above the limit of ${this.maxFileBytes}`, { path: shown, bytes: r.stat.size, limit: this.maxFileBytes });
    }
    const fh = await fsp.open(r.abs, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK);
    try {
      const st = await fh.stat();
      if (!st.isFile() || st.ino !== r.stat.ino) throw new HutchError('bad_request', `${shown} changed while being opened`, { path: shown });
      return await fh.readFile();
    } finally {
      await fh.close();
    }
  }

  /** Creates the missing directories of a resolved path (all of them with `includeFinal`). */
  private async makeParents(r: ResolvedPath, includeFinal = false): Promise<void> {
    const depth = includeFinal ? r.missingDepth : r.missingDepth - 1;
    if (depth <= 0) return;
    const parts = r.rel.split('/');
    const upto = includeFinal ? parts.length : parts.length - 1;
    for (let i = upto - depth; i < upto; i++) {
      const abs = this.ws.hostPath(parts.slice(0, i + 1).join('/'));
      await fsp.mkdir(abs, { mode: DEFAULT_DIR_MODE });
      if (this.opts.owner) await fsp.chown(abs, this.opts.owner.uid, this.opts.owner.gid);
    }
  }
}

export function entryType(st: Stats): WalkType {
  return st.isFile() ? 'file' : st.isDirectory() ? 'dir' : st.isSymbolicLink() ? 'symlink' : 'other';
}
