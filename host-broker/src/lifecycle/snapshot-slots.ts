import { existsSync, mkdirSync, readFileSync, readdirSync, renameSync, rmSync, writeFileSync, openSync, fsyncSync, closeSync, lstatSync } from 'node:fs';
import { join } from 'node:path';
import type { SlotRef } from '../backends/backend.ts';
import { SWAP_FILE } from '../vm/swap-disk.ts';

type SlotName = 'a' | 'b';

/**
 * Two alternating snapshot slots per session. A new snapshot is written completely and
 * durably into the slot that is not current, and only then does `current` flip to it
 * (an atomic rename). A write that fails or is cut short leaves the last good slot, and
 * the pointer to it, untouched. The older slot it replaces is removed before the write, so
 * a session never holds more than two slots on disk.
 *
 *   <state>/slots/a/ , <state>/slots/b/    state.bin, manifest.json, swap.img, slot.json
 *   <state>/slots/current                   "a" or "b"
 */
export class SnapshotSlots {
  private readonly root: string;

  constructor(stateDir: string) {
    this.root = join(stateDir, 'slots');
    // A broker that died while writing a slot left a temp dir; the slot it was replacing is intact.
    for (const t of ['a.tmp', 'b.tmp', 'current.tmp']) rmSync(join(this.root, t), { recursive: true, force: true });
  }

  /** The last good slot, if any. */
  current(): SlotRef | undefined {
    const name = this.currentName();
    return name ? this.read(name) : undefined;
  }

  /** The other slot, if it holds an older good snapshot (fallback when the current one will not restore). */
  previous(): SlotRef | undefined {
    const name = this.currentName();
    if (!name) return undefined;
    return this.read(name === 'a' ? 'b' : 'a');
  }

  /** Disk the slots take (allocated bytes: the state and swap files are sparse). */
  bytes(): number {
    return dirBytes(join(this.root, 'a')) + dirBytes(join(this.root, 'b'));
  }

  /** Disk the slot the next write replaces takes. */
  replacedBytes(): number {
    return dirBytes(join(this.root, this.currentName() === 'a' ? 'b' : 'a'));
  }

  /**
   * Writes a snapshot with `write(dir)` into the non-current slot, then flips to it.
   * The callback must leave complete, fsynced files in `dir`.
   */
  async write(write: (dir: string) => Promise<SlotRef>): Promise<SlotRef> {
    mkdirSync(this.root, { recursive: true });
    const target: SlotName = this.currentName() === 'a' ? 'b' : 'a';
    const tmp = join(this.root, `${target}.tmp`);
    const final = join(this.root, target);
    rmSync(tmp, { recursive: true, force: true });
    // The older fallback goes first: with it, a write would hold three slots' disk at its peak.
    rmSync(final, { recursive: true, force: true });
    let ref: SlotRef;
    try {
      ref = await write(tmp);
      writeFileSync(join(tmp, 'slot.json'), JSON.stringify({ pristineKey: ref.pristineKey, writtenAt: new Date().toISOString(), ...(ref.syncMarker ? { syncMarker: ref.syncMarker } : {}) }));
      fsyncPath(join(tmp, 'slot.json'));
    } catch (err) {
      rmSync(tmp, { recursive: true, force: true });
      throw err;
    }
    renameSync(tmp, final);
    fsyncPath(this.root);
    const ptrTmp = join(this.root, 'current.tmp');
    writeFileSync(ptrTmp, target);
    fsyncPath(ptrTmp);
    renameSync(ptrTmp, join(this.root, 'current'));
    fsyncPath(this.root);
    return this.read(target) as SlotRef;
  }

  /** Forgets every slot (the session's state outside the workspace is discarded). */
  clear(): void {
    rmSync(this.root, { recursive: true, force: true });
  }

  private currentName(): SlotName | undefined {
    try {
      const n = readFileSync(join(this.root, 'current'), 'utf8').trim();
      return n === 'a' || n === 'b' ? n : undefined;
    } catch {
      return undefined;
    }
  }

  private read(name: SlotName): SlotRef | undefined {
    const dir = join(this.root, name);
    const meta = join(dir, 'slot.json');
    if (!existsSync(meta) || !existsSync(join(dir, 'state.bin')) || !existsSync(join(dir, 'manifest.json'))) return undefined;
    try {
      const m = JSON.parse(readFileSync(meta, 'utf8')) as { pristineKey: string; syncMarker?: unknown };
      const swap = join(dir, SWAP_FILE);
      const syncMarker = typeof m.syncMarker === 'string' ? m.syncMarker : undefined;
      return { dir, state: join(dir, 'state.bin'), manifest: join(dir, 'manifest.json'), pristineKey: m.pristineKey, ...(existsSync(swap) ? { swap } : {}), ...(syncMarker ? { syncMarker } : {}) };
    } catch {
      return undefined;
    }
  }
}

function dirBytes(dir: string): number {
  let n = 0;
  let names: string[];
  try {
    names = readdirSync(dir);
  } catch {
    return 0;
  }
  for (const name of names) {
    try {
      n += lstatSync(join(dir, name)).blocks * 512;
    } catch {
      // removed meanwhile
    }
  }
  return n;
}

/** Makes a written file (or directory entry) durable before it is relied on. */
export function fsyncPath(p: string): void {
  const fd = openSync(p, 'r');
  try {
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
}
