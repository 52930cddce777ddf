/**
 * The on-disk cache shared by hutch's builders (kernel, rootfs, snapshots).
 *
 * Everything expensive lives under one root, `~/.cache/hutch` by default, so a
 * CI run on the same machine reuses it and a person can delete it in one go.
 * `HUTCH_CACHE` overrides the root (tests point it at a temp dir).
 *
 * Artifacts are keyed by a content hash of their inputs (see `hashInputs`), so
 * changing a config fragment or a build script yields a new directory instead
 * of silently reusing a stale artifact.
 */
import { createHash } from "node:crypto";
import { mkdir, open, readFile, rename, rm, stat } from "node:fs/promises";
import { homedir } from "node:os";
import path from "node:path";
import { HutchError } from "../guest-agent/src/protocol/errors.ts";

/** Root of the hutch cache: $HUTCH_CACHE, else ~/.cache/hutch. */
export function cacheRoot(): string {
  const fromEnv = process.env["HUTCH_CACHE"];
  if (fromEnv !== undefined && fromEnv !== "") return path.resolve(fromEnv);
  return path.join(homedir(), ".cache", "hutch");
}

/** A directory under the cache root, created if missing. */
export async function cacheDir(...parts: string[]): Promise<string> {
  const dir = path.join(cacheRoot(), ...parts);
  await mkdir(dir, { recursive: true });
  return dir;
}

/** Where downloaded inputs (.deb files, source tarballs) are kept. */
export function downloadsDir(): Promise<string> {
  return cacheDir("downloads");
}

/**
 * One input to a cache key. A bare string is hashed as itself; `{ file }` is
 * hashed by content (its path relative to nothing: moving the repo must not
 * invalidate the cache); `{ label, value }` names a string so two inputs that
 * happen to be equal strings in different roles still hash differently.
 */
export type HashInput = string | { file: string } | { label: string; value: string };

/**
 * A stable hex digest of a list of inputs. Each input is length-prefixed so
 * that ["ab", "c"] and ["a", "bc"] do not collide.
 */
export async function hashInputs(inputs: readonly HashInput[], length = 16): Promise<string> {
  const hash = createHash("sha256");
  for (const input of inputs) {
    let kind: string;
    let data: Buffer;
    if (typeof input === "string") {
      kind = "s";
      data = Buffer.from(input, "utf8");
    } else if ("file" in input) {
      kind = `f:${path.basename(input.file)}`;
      try {
        data = await readFile(input.file);
      } catch (err) {
        throw new Error(`hashInputs: cannot read input file ${input.file}: ${(err as Error).message}`, { cause: err });
      }
    } else {
      kind = `l:${input.label}`;
      data = Buffer.from(input.value, "utf8");
    }
    hash.update(`${kind}\0${data.length}\0`);
    hash.update(data);
  }
  return hash.digest("hex").slice(0, length);
}

/** True if `p` exists (any type). */
export async function exists(p: string): Promise<boolean> {
  try {
    await stat(p);
    return true;
  } catch {
    return false;
  }
}

/**
 * Populate a cache entry atomically: `fill` writes into a fresh temp dir next
 * to `finalDir`, which is renamed into place only when `fill` succeeds. A
 * crashed or interrupted build therefore never leaves a half-written entry
 * that a later run would mistake for a complete one.
 */
export async function fillAtomically(finalDir: string, fill: (tmpDir: string) => Promise<void>): Promise<void> {
  const tmpDir = `${finalDir}.tmp-${process.pid}-${Date.now()}`;
  await mkdir(tmpDir, { recursive: true });
  try {
    await fill(tmpDir);
    await rm(finalDir, { recursive: true, force: true });
    await rename(tmpDir, finalDir);
  } catch (err) {
    await rm(tmpDir, { recursive: true, force: true });
    throw err;
  }
}

/** Whether a pid names a live process (EPERM still means it exists): sweeps what dead processes left. */
export function pidAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === "EPERM";
  }
}

/**
 * Run `fn` while holding an exclusive lock file (created with O_EXCL, holding
 * our pid). Two builders sharing a build tree (say, CI and a developer's
 * setup script) would otherwise corrupt each other's objects. A lock left by
 * a dead process is taken over; a live holder is waited for, with a message.
 */
export async function withLock<T>(lockFile: string, fn: () => Promise<T>, log?: (message: string) => void): Promise<T> {
  await mkdir(path.dirname(lockFile), { recursive: true });
  let announced = false;
  for (;;) {
    try {
      const fh = await open(lockFile, "wx");
      await fh.writeFile(String(process.pid));
      await fh.close();
      break;
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code !== "EEXIST") throw err;
    }
    const holder = Number.parseInt(await readFile(lockFile, "utf8").catch(() => ""), 10);
    // An empty lock file may be one whose creator has not written its pid yet.
    const young = Date.now() - ((await stat(lockFile).catch(() => null))?.mtimeMs ?? 0) < 5000;
    if ((!Number.isFinite(holder) && !young) || (Number.isFinite(holder) && !pidAlive(holder))) {
      await rm(lockFile, { force: true });
      continue;
    }
    if (!announced && Number.isFinite(holder)) {
      log?.(`waiting for process ${holder}, which holds ${lockFile}`);
      announced = true;
    }
    await new Promise((r) => setTimeout(r, 1000));
  }
  try {
    return await fn();
  } finally {
    await rm(lockFile, { force: true });
  }
}

/**
 * A builder's answer to a cache miss when building is off (`hutch serve --no-build`):
 * says what is missing and how to build it, instead of starting a long build.
 */
export function notCached(what: string, dir: string): never {
  throw new HutchError("unavailable", `${what} is not in the cache (${dir}) and building is off (--no-build): run ./hutch setup to build it`, { dir });
}
