/**
 * The submodules a git index lists: its gitlink entries (mode 160000). `git status` and
 * `git diff` look into each populated one (a child `git status` there, which runs that
 * repository's filters and reads its configuration), so the router must check those
 * repositories too, and only the index says which directories they are.
 *
 * Versions 2, 3 and 4 (prefix-compressed names) with SHA-1 or SHA-256 object names. A
 * split index (its `link` extension: entries live in a second file) and anything this
 * reader does not follow are errors: the caller sends git to the VM. The index is the
 * tenant's, so the work is sliced on the event loop.
 */
import { LoopSlicer } from '../../../guest-agent/src/workspace/work-budget.ts';

export type IndexGitlinks = { ok: true; paths: Buffer[] } | { ok: false; error: string };

const SIGNATURE = 0x44495243; // "DIRC"
const GITLINK = 0o160000;
const TYPE_MASK = 0o170000;
/** ctime, mtime (8 each), dev, ino, mode, uid, gid, size (4 each): then the object name. */
const STAT_BYTES = 40;
const MODE_OFFSET = 24;
const EXTENDED_FLAG = 0x4000;
const NAME_MASK = 0x0fff;
/** Entries between two looks at the event loop's clock. */
const TICK_EVERY = 1024;
/** Longer than any path a file system holds (PATH_MAX). */
const MAX_NAME_BYTES = 4096;

export async function indexGitlinks(buf: Buffer, hashBytes: number): Promise<IndexGitlinks> {
  const fail = (error: string): IndexGitlinks => ({ ok: false, error });
  const end = buf.length - hashBytes; // the trailing checksum
  if (end < 12 || buf.readUInt32BE(0) !== SIGNATURE) return fail('not a git index');
  const version = buf.readUInt32BE(4);
  if (version < 2 || version > 4) return fail(`index version ${version}`);
  const count = buf.readUInt32BE(8);
  const slicer = new LoopSlicer();
  const paths: Buffer[] = [];
  // Version 4's names build on the previous one: rebuilt here in place, copied only for a gitlink.
  const name = Buffer.alloc(MAX_NAME_BYTES);
  let nameLength = 0;
  let at = 12;
  for (let n = 0; n < count; n++) {
    if (n % TICK_EVERY === 0) await slicer.tick();
    const start = at;
    const flagsAt = start + STAT_BYTES + hashBytes;
    if (flagsAt + 2 > end) return fail('an entry past the end');
    const gitlink = (buf.readUInt32BE(start + MODE_OFFSET) & TYPE_MASK) === GITLINK;
    const flags = buf.readUInt16BE(flagsAt);
    at = flagsAt + 2;
    if (flags & EXTENDED_FLAG) {
      if (version < 3) return fail('an extended entry in a version 2 index');
      at += 2;
    }
    if (version === 4) {
      // A varint (git's offset encoding): bytes to drop from the end of the previous name.
      if (at >= end) return fail('an entry past the end');
      let c = buf[at++] as number;
      let drop = c & 0x7f;
      while (c & 0x80) {
        if (at >= end || drop > MAX_NAME_BYTES) return fail('a malformed name');
        c = buf[at++] as number;
        drop = (drop + 1) * 128 + (c & 0x7f);
      }
      const nul = buf.indexOf(0, at);
      if (nul < 0 || nul >= end || drop > nameLength || nameLength - drop + (nul - at) > MAX_NAME_BYTES) return fail('a malformed name');
      nameLength = nameLength - drop + buf.copy(name, nameLength - drop, at, nul);
      at = nul + 1;
      if (gitlink) paths.push(Buffer.from(name.subarray(0, nameLength)));
    } else {
      const length = flags & NAME_MASK;
      const nul = length < NAME_MASK ? at + length : buf.indexOf(0, at);
      if (nul < 0 || nul >= end || buf[nul] !== 0) return fail('a malformed name');
      if (gitlink) paths.push(Buffer.from(buf.subarray(at, nul)));
      // Padded with 1 to 8 NULs to a multiple of 8 bytes from the entry's start.
      at = start + ((nul - start + 8) & ~7);
    }
  }
  // Extensions, up to the checksum: a split index keeps entries in another file.
  while (at + 8 <= end) {
    const sig = buf.toString('latin1', at, at + 4);
    const size = buf.readUInt32BE(at + 4);
    if (sig === 'link') return fail('a split index (its entries are in another file)');
    at += 8 + size;
  }
  if (at !== end) return fail('extensions that do not end at the checksum');
  return { ok: true, paths };
}
