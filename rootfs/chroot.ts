/**
 * Running commands inside a build tree (chroot) safely.
 *
 * Package maintainer scripts want /proc, so a fresh proc is mounted for the
 * duration of the command and always unmounted afterwards. Nothing from the
 * host (/dev, /sys) is bind-mounted: a recursive delete of a build tree with a
 * host bind mount still inside would reach into the host. `assertNoMountsUnder`
 * is the guard every delete of a build tree goes through.
 */
import { readFile } from "node:fs/promises";
import path from "node:path";
import { run, type RunOptions } from "../build/run.ts";

/** Mount points (from /proc/self/mountinfo) at or below `dir`, deepest first. */
export async function mountsUnder(dir: string): Promise<string[]> {
  const root = path.resolve(dir);
  const info = await readFile("/proc/self/mountinfo", "utf8");
  const found: string[] = [];
  for (const line of info.split("\n")) {
    const mountPoint = line.split(" ")[4];
    if (mountPoint === undefined) continue;
    // mountinfo escapes spaces and the like as \ooo octal.
    const decoded = mountPoint.replace(/\\([0-7]{3})/g, (_m, o: string) => String.fromCharCode(Number.parseInt(o, 8)));
    if (decoded === root || decoded.startsWith(`${root}/`)) found.push(decoded);
  }
  return found.sort((a, b) => b.length - a.length);
}

/** Throws if anything is mounted at or below `dir` (call before deleting it). */
export async function assertNoMountsUnder(dir: string): Promise<void> {
  const mounts = await mountsUnder(dir);
  if (mounts.length > 0) {
    throw new Error(`refusing to touch ${dir}: still mounted below it: ${mounts.join(", ")} (unmount them first: umount -R ${dir})`);
  }
}

/** Unmounts everything at or below `dir` (deepest first), lazily if busy. */
export async function unmountAllUnder(dir: string): Promise<void> {
  for (const m of await mountsUnder(dir)) {
    try {
      await run(["umount", m]);
    } catch {
      await run(["umount", "-l", m]);
    }
  }
}

export interface ChrootOptions extends Omit<RunOptions, "cwd"> {
  /** Mount a fresh proc at <root>/proc while the command runs; default true. */
  proc?: boolean;
}

/** Runs `argv` chrooted into `root` with a clean environment. */
export async function runInChroot(root: string, argv: readonly string[], opts: ChrootOptions = {}): Promise<string> {
  const env: NodeJS.ProcessEnv = {
    PATH: "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    HOME: "/root",
    LANG: "C.UTF-8",
    LC_ALL: "C.UTF-8",
    DEBIAN_FRONTEND: "noninteractive",
    ...opts.env,
  };
  const procDir = path.join(root, "proc");
  const mountProc = opts.proc !== false;
  if (mountProc) await run(["mount", "-t", "proc", "-o", "nosuid,nodev,noexec", "proc", procDir]);
  try {
    const { stdout } = await run(["chroot", root, ...argv], { ...opts, env });
    return stdout;
  } finally {
    if (mountProc) await unmountAllUnder(procDir);
  }
}
