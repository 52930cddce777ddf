import { promises as fsp } from 'node:fs';
import { isAtomicTempName } from './atomic-write.ts';

export type WalkType = 'file' | 'dir' | 'symlink' | 'other';
export interface WalkEntry {
  /** Path relative to the walk's start ('' never appears). */
  rel: string;
  type: WalkType;
}

export interface WalkOptions {
  /** Directory names never descended into (matched against the name only). */
  skipDirs?: ReadonlySet<string>;
  /** Entries to leave out; a directory left out is not descended into either. */
  skip?: (rel: string, type: WalkType) => boolean;
  /** Stop after this many entries. */
  limit?: number;
}

/**
 * Depth-first walk that never follows symlinks (a link is reported, not entered), so it
 * cannot leave the tree it started in. Entries come sorted by name within a directory,
 * which makes results deterministic.
 */
export async function* walk(startAbs: string, opts: WalkOptions = {}): AsyncGenerator<WalkEntry> {
  const stack: string[] = [''];
  let count = 0;
  while (stack.length > 0) {
    const relDir = stack.pop() as string;
    let dirents;
    try {
      dirents = await fsp.readdir(relDir === '' ? startAbs : `${startAbs}/${relDir}`, { withFileTypes: true });
    } catch {
      continue; // vanished or unreadable while walking: skip, as find does
    }
    dirents.sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0));
    const subdirs: string[] = [];
    for (const d of dirents) {
      if (isAtomicTempName(d.name)) continue;
      const rel = relDir === '' ? d.name : `${relDir}/${d.name}`;
      const type: WalkType = d.isFile() ? 'file' : d.isDirectory() ? 'dir' : d.isSymbolicLink() ? 'symlink' : 'other';
      if (type === 'dir' && opts.skipDirs?.has(d.name)) continue;
      if (opts.skip?.(rel, type)) continue;
      yield { rel, type };
      if (opts.limit !== undefined && ++count >= opts.limit) return;
      if (type === 'dir') subdirs.push(rel);
    }
    for (let i = subdirs.length - 1; i >= 0; i--) stack.push(subdirs[i] as string);
  }
}
