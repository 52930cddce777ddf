import type { Stats } from 'node:fs';
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
import { ANSWER_MAX_BYTES, AnswerCap, BoundedAnswer, READ_DEFAULT_LINES, textBytes, WALK_MAX_DEPTH, WALK_MAX_ENTRIES } from './answer-bounds.ts';
import { writeFileAtomic } from './atomic-write.ts';
import type { ResolveOptions, Resolution, Workspace } from './confine.ts';
import { lstatAt, readFileAt, readlinkAt, type OpenedFile, removeTreeAt, renameAt, rmdirAt, unlinkAt } from './fd-path.ts';
import { compileGlob } from './glob-match.ts';
import { nameFromBytes } from './names.ts';
import { RegexSearch, type Match } from './regex-search.ts';
import { firstOccurrence, lineWindow, looksBinary, MAX_LINE_CHARS, splitOccurrences } from './text.ts';
import { walk, type WalkBudget, type WalkType } from './walk.ts';
import { LoopSlicer, WorkBudget } from './work-budget.ts';

/** Directories the listing and search tools skip, as opencode's do. */
export const DEFAULT_IGNORED_DIRS: ReadonlySet<string> = new Set([
  '.git', 'node_modules', '__pycache__', '.venv', 'venv', '.mypy_cache', '.pytest_cache', '.tox', 'dist', 'build', 'target', '.next', '.cache', 'coverage',
]);
/** Search tools skip only what is never source. */
const SEARCH_SKIPPED_DIRS: ReadonlySet<string> = new Set(['.git', 'node_modules']);

export interface FileToolsOptions {
  /** Largest file read, written, edited or searched (bytes). */
  maxFileBytes?: number;
  /** Owner of files and directories the tools create (the tenant user in the guest). */
  owner?: { uid: number; gid: number };
  /** fsync writes (the host workspace is the source of truth). */
  durable?: boolean;
  /** Time one grep, glob or list may take (ms), after which it fails with `timeout` (work-budget.ts). */
  searchTimeoutMs?: number;
  /** How deep and how many entries one grep, glob or list walks (default WALK_MAX_DEPTH, WALK_MAX_ENTRIES). */
  walk?: { maxDepth?: number; maxEntries?: number };
  /**
   * Called with what a write, edit or mkdir is about to add, before anything is written;
   * throwing refuses the call (the broker's workspace quota, sessions/workspace-quota.ts).
   */
  beforeGrow?: (g: PlannedGrowth) => void;
  /**
   * Called before a read or edit loads a file of `bytes` into memory; resolves to the release
   * once there is room (the broker's budget of file bytes held at once, util/byte-budget.ts).
   */
  holdBytes?: (bytes: number) => Promise<() => void>;
}

/** What one call will add: `dirs` new directories and maybe a file (`replaces`: the file it overwrites). */
/** A searched file up to this size goes in grep's batch without holding room in the broker's file bytes (the batch is bounded per search). */
const SEARCH_UNHELD_BYTES = 64 * 1024;

export interface PlannedGrowth {
  path: string;
  dirs: number;
  file?: { bytes: number; replaces: Stats | undefined };
}

type In<S extends z.ZodType> = z.output<S>;

const DEFAULT_FILE_MODE = 0o644;
const DEFAULT_DIR_MODE = 0o755;
const DEFAULT_SEARCH_TIMEOUT_MS = 30_000;

/**
 * The file tools with opencode's semantics, all confined to one workspace. The same
 * class serves the agent's fs.* methods in the guest and the broker's in-process calls.
 *
 * Every tool acts through the directory fds a `Resolution` holds (confine.ts) and walks by
 * fds (walk.ts): no path string is re-resolved between the check and the use, so a tenant
 * process changing the tree meanwhile cannot redirect a call out of the workspace.
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
    return this.at(p.path, {}, (r) => this.holding(r, () => this.readLines(r, p)));
  }

  /** Runs `fn` (which loads the file `r` into memory) holding room for its size, when the caller bounds that. */
  private async holding<T>(r: Resolution, fn: () => Promise<T>): Promise<T> {
    const release = await this.opts.holdBytes?.(Math.min(r.stat?.size ?? 0, this.maxFileBytes));
    try {
      return await fn();
    } finally {
      release?.();
    }
  }

  private async readLines(r: Resolution, p: In<typeof ReadParamsSchema>): Promise<ResultOf<'fs.read'>> {
    const { buf } = await this.readRegular(r, p.path);
    if (looksBinary(buf)) throw new HutchError('binary_file', `${p.path} is a binary file`, { path: p.path, bytes: buf.length });
    const offset = p.offset ?? 0;
    const limit = p.limit ?? READ_DEFAULT_LINES;
    const numbered = p.numbered ?? true;
    const slicer = new LoopSlicer();
    const w = await lineWindow(buf, offset, limit, () => slicer.tick(), {
      maxBytes: ANSWER_MAX_BYTES,
      ...(numbered ? { prefix: (i: number) => `${String(i + 1).padStart(5, '0')}| ` } : {}),
    });
    if (offset > 0 && offset >= w.total) {
      throw new HutchError('bad_request', `offset ${offset} is beyond the end of ${p.path} (${w.total} lines)`, {
        path: p.path,
        offset,
        totalLines: w.total,
      });
    }
    const hasMore = offset + w.lines.length < w.total;
    return {
      path: this.ws.display(r.rel),
      content: w.lines.join('\n'),
      offset,
      lines: w.lines.length,
      totalLines: w.total,
      longLinesCut: w.cut,
      hasMore,
      truncated: w.full,
      ...(hasMore ? { nextOffset: offset + w.lines.length } : {}),
    };
  }

  async write(p: In<typeof WriteParamsSchema>): Promise<ResultOf<'fs.write'>> {
    const data = typeof p.content === 'string' ? Buffer.from(p.content, 'utf8') : p.content;
    this.checkSize(data.length, p.path);
    return this.at(p.path, { missing: 'parents' }, async (r) => {
      if (r.isRoot || r.stat?.isDirectory()) throw new HutchError('is_a_directory', `${p.path} is a directory`, { path: p.path });
      if (r.stat && !r.stat.isFile()) throw new HutchError('bad_request', `${p.path} is not a regular file`, { path: p.path });
      this.opts.beforeGrow?.({ path: p.path, dirs: r.stat ? 0 : Math.max(0, r.missingDepth - 1), file: { bytes: data.length, replaces: r.stat } });
      r.makeParents(DEFAULT_DIR_MODE, this.opts.owner);
      await writeFileAtomic({ dirFd: r.dirFd, name: r.name }, data, {
        mode: p.mode ?? (r.stat ? r.stat.mode : DEFAULT_FILE_MODE),
        owner: r.stat ? { uid: r.stat.uid, gid: r.stat.gid } : this.opts.owner,
        durable: this.opts.durable ?? false,
      });
      return { path: this.ws.display(r.rel), bytes: data.length, created: !r.stat };
    });
  }

  async edit(p: In<typeof EditParamsSchema>): Promise<ResultOf<'fs.edit'>> {
    if (p.oldString === p.newString) throw new HutchError('bad_request', 'oldString and newString are identical', { path: p.path });
    if (p.oldString === '') {
      // Empty oldString creates a file (opencode); refusing to clobber content keeps it lossless.
      await this.at(p.path, { missing: 'parents' }, async (r) => {
        if (r.stat && (!r.stat.isFile() || r.stat.size > 0)) {
          throw new HutchError('already_exists', `${p.path} exists and is not empty; an empty oldString only creates files`, { path: p.path });
        }
      });
      const w = await this.write({ path: p.path, content: p.newString });
      return { path: w.path, replacements: 1, bytes: w.bytes };
    }
    return this.at(p.path, {}, (r) => this.holding(r, async () => {
      const { buf, st } = await this.readRegular(r, p.path);
      if (looksBinary(buf)) throw new HutchError('binary_file', `${p.path} is a binary file`, { path: p.path });
      // Matched and replaced in the file's bytes, sliced (text.ts splitOccurrences): the file
      // is never decoded whole on the loop, and bytes that are not UTF-8 elsewhere are kept.
      const slicer = new LoopSlicer();
      const tick = () => slicer.tick();
      const from = Buffer.from(p.oldString, 'utf8');
      const to = Buffer.from(p.newString, 'utf8');
      const n = (await splitOccurrences(buf, from, undefined, tick)).count;
      if (n === 0) throw new HutchError('no_match', `oldString was not found in ${p.path} (0 matches)`, { path: p.path, matches: 0 });
      if (n > 1 && !p.replaceAll) {
        throw new HutchError('multiple_matches', `oldString matches ${n} times in ${p.path}; give more context or set replaceAll`, { path: p.path, matches: n });
      }
      const replaced = p.replaceAll ? n : 1;
      // Refused before the new content is built: replaceAll can multiply a file's size.
      this.checkSize(buf.length + replaced * (to.length - from.length), p.path);
      let data: Buffer;
      if (p.replaceAll) data = (await splitOccurrences(buf, from, to, tick)).out as Buffer;
      else {
        const at = await firstOccurrence(buf, from, tick);
        data = Buffer.concat([buf.subarray(0, at), to, buf.subarray(at + from.length)]);
      }
      this.checkSize(data.length, p.path);
      this.opts.beforeGrow?.({ path: p.path, dirs: 0, file: { bytes: data.length, replaces: st } });
      await writeFileAtomic({ dirFd: r.dirFd, name: r.name }, data, { mode: st.mode, owner: { uid: st.uid, gid: st.gid }, durable: this.opts.durable ?? false });
      return { path: this.ws.display(r.rel), replacements: replaced, bytes: data.length };
    }));
  }

  async glob(p: In<typeof GlobParamsSchema>): Promise<ResultOf<'fs.glob'>> {
    const match = compileGlob(p.pattern);
    const budget = this.budget('glob');
    const walked = this.walkBudget();
    return this.at(p.path ?? '.', {}, async (base) => {
      const limit = p.limit ?? 100;
      // Newest first, as opencode: the file the agent just touched is what it looks for.
      const found = new BoundedAnswer<{ rel: string; mtime: number }>((a, b) => b.mtime - a.mtime || (a.rel < b.rel ? -1 : a.rel > b.rel ? 1 : 0), limit, ANSWER_MAX_BYTES);
      for await (const e of walk(this.dirFd(base, p.path), { skipDirs: SEARCH_SKIPPED_DIRS, tick: () => budget.tick(), budget: walked })) {
        if (e.type === 'dir' || !match(e.rel)) continue;
        const st = lstatAt(e.dirFd, e.name);
        if (!st) continue;
        const rel = childRel(base, e.rel);
        found.offer({ rel, mtime: st.mtimeMs }, 1, textBytes(rel));
      }
      const answer = new AnswerCap(limit, ANSWER_MAX_BYTES);
      const files: string[] = [];
      for (const f of found.sorted()) {
        if (!answer.take(textBytes(f.rel))) break;
        files.push(f.rel);
      }
      return { files, truncated: found.offered > files.length || walked.hit !== undefined, ...walkLimit(walked) };
    });
  }

  async grep(p: In<typeof GrepParamsSchema>): Promise<ResultOf<'fs.grep'>> {
    const limit = p.limit ?? 100;
    const budget = this.budget('grep');
    const walked = this.walkBudget();
    // Files whose search has not answered yet, in the order their contents went to it (a
    // batch holds thousands: taken by index, not shifted).
    let pending: SearchedFile[] = [];
    let answered = 0;
    // Newest file first, its matches in line order; only what can still be in the answer is held.
    const found = new BoundedAnswer<SearchedFile & { matches: Match[] }>((a, b) => b.mtime - a.mtime || a.seq - b.seq, limit, ANSWER_MAX_BYTES);
    let seq = 0;
    let total = 0;
    const search = new RegexSearch(p.pattern, p.ignoreCase ? 'i' : '', { maxMatches: limit, maxLineChars: MAX_LINE_CHARS, maxBytes: ANSWER_MAX_BYTES }, budget, (r) => {
      const f = pending[answered++] as SearchedFile;
      if (answered === pending.length) {
        pending = [];
        answered = 0;
      }
      total += r.count;
      if (r.matches.length === 0) return;
      const bytes = r.matches.reduce((n, m) => n + matchBytes(f.rel, m), 0);
      found.offer({ ...f, matches: r.matches }, r.matches.length, bytes);
    });
    const include = p.include ? compileGlob(p.include) : undefined;
    try {
      return await this.at(p.path ?? '.', {}, async (start) => {
        let candidates = 0;
        const consider = async (dirFd: number, name: Buffer, rel: string) => {
          candidates++;
          // A large file holds room in the broker's file bytes while it waits for the worker
          // (a principal's 128 sessions grepping 64 MiB files held 8 GiB); small ones ride in
          // the batch, which is bounded per search.
          const size = this.opts.holdBytes ? Math.min(lstatAt(dirFd, name)?.size ?? 0, this.maxFileBytes) : 0;
          let release: (() => void) | undefined;
          if (size > SEARCH_UNHELD_BYTES) {
            await search.makeRoom(size);
            release = await this.opts.holdBytes?.(size);
          }
          const f = await this.readForSearch(dirFd, name);
          if (!f) {
            release?.();
            return;
          }
          pending.push({ rel, mtime: f.mtime, seq: seq++ });
          await search.add(f.buf, f.mtime, release);
        };
        if (start.stat?.isFile()) await consider(start.dirFd, start.name, start.rel);
        else if (start.stat?.isDirectory()) {
          for await (const e of walk(start.openDir(), { skipDirs: SEARCH_SKIPPED_DIRS, tick: () => budget.tick(), budget: walked })) {
            if (e.type !== 'file' || (include && !include(e.rel))) continue;
            await consider(e.dirFd, e.name, childRel(start, e.rel));
          }
        } else throw new HutchError('bad_request', `${p.path} is neither a file nor a directory`, { path: p.path });

        await search.finish();
        const answer = new AnswerCap(limit, ANSWER_MAX_BYTES);
        const matches: Array<{ path: string; line: number; text: string }> = [];
        taking: for (const f of found.sorted()) {
          for (const m of f.matches) {
            if (!answer.take(matchBytes(f.rel, m))) break taking;
            matches.push({ path: f.rel, line: m.line, text: m.text });
          }
        }
        return { matches, truncated: total > matches.length || walked.hit !== undefined, filesSearched: candidates, ...walkLimit(walked) };
      });
    } finally {
      search.close();
    }
  }

  async list(p: In<typeof ListParamsSchema>): Promise<ResultOf<'fs.list'>> {
    const ignore = p.ignore?.length ? p.ignore.map((g) => compileGlob(g)) : [];
    const budget = this.budget('list');
    const walked = this.walkBudget();
    return this.at(p.path ?? '.', {}, async (base) => {
      const offset = p.offset ?? 0;
      const answer = new AnswerCap(p.limit ?? 100, ANSWER_MAX_BYTES);
      const entries: Array<{ path: string; type: WalkType }> = [];
      let seen = 0;
      const skip = (rel: string) => ignore.some((m) => m(rel));
      for await (const e of walk(this.dirFd(base, p.path), { skipDirs: DEFAULT_IGNORED_DIRS, skip, tick: () => budget.tick(), budget: walked })) {
        if (seen++ < offset) continue;
        if (!answer.take(textBytes(e.rel))) break;
        entries.push({ path: e.rel, type: e.type });
      }
      return {
        path: this.ws.display(base.rel),
        entries,
        truncated: answer.full || walked.hit !== undefined,
        // The walk's order is the same each time (names sorted): the next call goes on from here.
        ...(answer.full ? { nextOffset: offset + entries.length } : {}),
        ...walkLimit(walked),
      };
    });
  }

  async stat(p: In<typeof StatParamsSchema>): Promise<ResultOf<'fs.stat'>> {
    return this.at(p.path, { followFinal: false }, async (r) => {
      const st = r.stat as Stats;
      const type = entryType(st);
      const out: ResultOf<'fs.stat'> = { path: this.ws.display(r.rel), type, size: st.size, mode: st.mode & 0o7777, mtimeMs: st.mtimeMs };
      if (type === 'symlink') out.target = nameFromBytes(readlinkAt(r.dirFd, r.name));
      return out;
    });
  }

  async mkdir(p: In<typeof MkdirParamsSchema>): Promise<ResultOf<'fs.mkdir'>> {
    return this.at(p.path, { missing: p.parents ? 'parents' : 'final' }, async (r) => {
      if (r.stat) {
        if (r.stat.isDirectory() && p.parents) return { path: this.ws.display(r.rel), created: false };
        throw new HutchError('already_exists', `${p.path} already exists`, { path: p.path });
      }
      this.opts.beforeGrow?.({ path: p.path, dirs: r.missingDepth });
      r.makeParents(DEFAULT_DIR_MODE, this.opts.owner, true);
      return { path: this.ws.display(r.rel), created: true };
    });
  }

  async remove(p: In<typeof RemoveParamsSchema>): Promise<ResultOf<'fs.remove'>> {
    return this.at(p.path, { followFinal: false }, async (r) => {
      if (r.isRoot) throw new HutchError('bad_request', 'refusing to remove the workspace root', { path: p.path });
      const st = r.stat as Stats;
      if (st.isDirectory()) {
        if (p.recursive) await removeTreeAt(r.dirFd, r.name);
        else rmdirAt(r.dirFd, r.name);
      } else unlinkAt(r.dirFd, r.name);
      return { path: this.ws.display(r.rel), removed: true };
    });
  }

  async move(p: In<typeof MoveParamsSchema>): Promise<ResultOf<'fs.move'>> {
    return this.at(p.from, { followFinal: false }, (from) =>
      this.at(p.to, { followFinal: false, missing: 'parents' }, async (to) => {
        if (from.isRoot || to.isRoot) throw new HutchError('bad_request', 'cannot move the workspace root', { from: p.from, to: p.to });
        const inside = to.raw.length > from.raw.length && to.raw[from.raw.length] === 0x2f && to.raw.subarray(0, from.raw.length).equals(from.raw);
        if (to.raw.equals(from.raw) || inside) throw new HutchError('bad_request', `cannot move ${p.from} into itself`, { from: p.from, to: p.to });
        if (to.stat && !p.overwrite) throw new HutchError('already_exists', `${p.to} already exists`, { path: p.to });
        to.makeParents(DEFAULT_DIR_MODE, this.opts.owner);
        renameAt(from.dirFd, from.name, to.dirFd, to.name);
        return { from: this.ws.display(from.rel), to: this.ws.display(to.rel) };
      }),
    );
  }

  // ------------------------------------------------------------ helpers

  /**
   * Resolves a tenant path, runs a tool on it with its directories held open, releases
   * them, and turns errno failures into typed errors that name the tenant path, never the
   * host path.
   */
  private async at<T>(path: string, opts: ResolveOptions, fn: (r: Resolution) => Promise<T>): Promise<T> {
    try {
      const r = this.ws.open(path, opts);
      try {
        return await fn(r);
      } finally {
        r.close();
      }
    } catch (err) {
      throw toHutchError(err, { path });
    }
  }

  private budget(tool: string): WorkBudget {
    return new WorkBudget(tool, this.opts.searchTimeoutMs ?? DEFAULT_SEARCH_TIMEOUT_MS);
  }

  private walkBudget(): WalkBudget {
    return { maxDepth: this.opts.walk?.maxDepth ?? WALK_MAX_DEPTH, maxEntries: this.opts.walk?.maxEntries ?? WALK_MAX_ENTRIES };
  }

  private checkSize(bytes: number, path: string): void {
    if (bytes > this.maxFileBytes) {
      throw new HutchError('too_large', `${bytes} bytes exceeds the file limit of ${this.maxFileBytes}`, { path, bytes, limit: this.maxFileBytes });
    }
  }

  private dirFd(r: Resolution, shown: string | undefined): number {
    if (!r.stat?.isDirectory()) throw new HutchError('not_a_directory', `${shown} is not a directory`, { path: shown });
    return r.openDir();
  }

  /** Reads a regular file without following a final symlink and without blocking on a FIFO. */
  private async readRegular(r: Resolution, shown: string): Promise<OpenedFile> {
    if (!r.stat) throw new HutchError('not_found', `no such file: ${shown}`, { path: shown });
    if (r.stat.isDirectory()) throw new HutchError('is_a_directory', `${shown} is a directory`, { path: shown });
    if (!r.stat.isFile()) throw new HutchError('bad_request', `${shown} is not a regular file`, { path: shown });
    const ino = r.stat.ino;
    return readFileAt(r.dirFd, r.name, (st) => {
      if (!st.isFile() || st.ino !== ino) throw new HutchError('bad_request', `${shown} changed while being opened`, { path: shown });
      if (st.size > this.maxFileBytes) {
        throw new HutchError('too_large', `${shown} is ${st.size} bytes, above the limit of ${this.maxFileBytes}`, { path: shown, bytes: st.size, limit: this.maxFileBytes });
      }
    });
  }

  /** A searchable file's content, or undefined for what grep skips (unreadable, special, too large, binary). */
  private async readForSearch(dirFd: number, name: Buffer): Promise<{ buf: Buffer; mtime: number } | undefined> {
    let f: OpenedFile;
    try {
      f = await readFileAt(dirFd, name, (st) => {
        if (!st.isFile() || st.size > this.maxFileBytes) throw SKIP;
      });
    } catch {
      return undefined; // vanished, swapped for a symlink, special or too large: skipped, as ripgrep does
    }
    return looksBinary(f.buf) ? undefined : { buf: f.buf, mtime: f.st.mtimeMs };
  }
}

const SKIP = new Error('skip');

interface SearchedFile {
  rel: string;
  mtime: number;
  /** Its place in the search's order: files of the same time keep it. */
  seq: number;
}

/** What a match adds to grep's answer, printed as `path:line: text`. */
function matchBytes(path: string, m: Match): number {
  return textBytes(path) + textBytes(m.text) + 8;
}

/** A walk that stopped short: the answer says where, so the caller narrows its path. */
function walkLimit(b: WalkBudget): { walkLimit?: 'depth' | 'entries' } {
  return b.hit ? { walkLimit: b.hit } : {};
}

/** A walked entry's path as the tenant names it (relative to the workspace, not the walk's start). */
function childRel(base: Resolution, rel: string): string {
  return base.rel === '' ? rel : `${base.rel}/${rel}`;
}

export function entryType(st: Stats): WalkType {
  return st.isFile() ? 'file' : st.isDirectory() ? 'dir' : st.isSymbolicLink() ? 'symlink' : 'other';
}
