/**
 * Keeps the rootfs caches from growing without bound: every agent change makes
 * a new ~300 MiB image and every package-list change a new base tree. After a
 * build, the newest few entries stay (a broker may still hold snapshots made
 * from the previous image), older ones and leftovers of crashed builds go.
 */
import { readFile, readdir, readlink, rm, stat } from "node:fs/promises";
import path from "node:path";
import { pidAlive } from "../build/cache.ts";
import { assertNoMountsUnder, unmountAllUnder } from "./chroot.ts";
import type { LogFn } from "./progress.ts";


/**
 * In `dir` (a cache root such as <cache>/rootfs), keeps `current` and the
 * newest `keep - 1` other entries; removes older entries, and temp dirs and lock
 * files of builds whose process is gone (fillAtomically names its temp dirs
 * `<hash>.tmp-<pid>-<ms>`; withLock's files hold the holder's pid).
 */
export async function pruneCache(dir: string, current: string, keep: number, log: LogFn): Promise<void> {
  const entries: { name: string; mtime: number }[] = [];
  for (const name of await readdir(dir)) {
    const full = path.join(dir, name);
    const tmp = /\.tmp-(\d+)-\d+$/.exec(name);
    if (tmp) {
      if (!pidAlive(Number(tmp[1]))) {
        log(`removing leftover of a crashed build: ${full}`);
        await unmountAllUnder(full);
        await assertNoMountsUnder(full);
        await rm(full, { recursive: true, force: true });
      }
      continue;
    }
    const lock = /^([0-9a-f]{16})\.lock$/.exec(name);
    if (lock) {
      // withLock takes over a dead holder's lock, but only for the same hash: other hashes' locks stay.
      const holder = Number.parseInt(await readFile(full, "utf8").catch(() => ""), 10);
      if (lock[1] !== current && Number.isFinite(holder) && !pidAlive(holder)) await rm(full, { force: true });
      continue;
    }
    if (!/^[0-9a-f]{16}$/.test(name) || name === current) continue;
    entries.push({ name, mtime: (await stat(full)).mtimeMs });
  }
  entries.sort((a, b) => b.mtime - a.mtime);
  const open = await openPaths();
  for (const e of entries.slice(Math.max(0, keep - 1))) {
    const full = path.join(dir, e.name);
    // A running broker's VMs hold their image open, and a broker touches its image dir
    // while it uses it (qemu-backend.ts): neither may lose the image under it.
    if ([...open].some((p) => p === full || p.startsWith(`${full}/`)) || Date.now() - e.mtime < IN_USE_MS) {
      log(`keeping old cache entry ${full}: in use`);
      continue;
    }
    log(`pruning old cache entry ${full}`);
    await assertNoMountsUnder(full);
    await rm(full, { recursive: true, force: true });
  }
}

/** An entry touched this recently counts as in use (a broker touches its image while it runs). */
const IN_USE_MS = 6 * 3600_000;

/** Every path some process has open (the targets of /proc/<pid>/fd/*). */
async function openPaths(): Promise<Set<string>> {
  const out = new Set<string>();
  for (const pid of await readdir("/proc").catch(() => [] as string[])) {
    if (!/^\d+$/.test(pid)) continue;
    for (const fd of await readdir(`/proc/${pid}/fd`).catch(() => [] as string[])) {
      const target = await readlink(`/proc/${pid}/fd/${fd}`).catch(() => undefined);
      if (target?.startsWith("/")) out.add(target);
    }
  }
  return out;
}
