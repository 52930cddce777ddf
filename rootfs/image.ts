/**
 * The default template's root filesystem: the base tree (base.ts) + the tenant user,
 * mount points and the template settings (/etc/hutch/start: the Python preload), as a
 * reproducible ext4 file at `<cache>/rootfs/<hash>/rootfs.ext4`.
 *
 * The agent, Node for it, init and the helpers are not in here: they are the agent layer
 * (agent-layer.ts), a disk of their own. The hash covers the base's hash, the guest files
 * and the build code; an agent change rebuilds only the agent layer.
 */
import { createHash } from "node:crypto";
import { createReadStream } from "node:fs";
import { mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { cacheDir, cacheRoot, exists, fillAtomically, hashInputs, notCached, withLock } from "../build/cache.ts";
import { ensureHostPackages } from "../build/host-apt.ts";
import { ensureBase, type BaseInfo } from "./base.ts";
import { makeReproducibleExt4 } from "./ext4.ts";
import { pruneCache } from "./prune.ts";
import { defaultLog, fmtBytes, fmtSeconds, Phases, type LogFn } from "./progress.ts";
import { GUEST_FILES, stageTree } from "./stage.ts";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const BUILD_CODE = ["image.ts", "stage.ts", "ext4.ts"].map((f) => path.join(HERE, f));

/** Timestamp on every file when SOURCE_DATE_EPOCH is not set: 2024-01-01T00:00:00Z. */
export const DEFAULT_EPOCH = 1704067200;

/** Images kept in the cache, the current one included: snapshots made from the previous one stay usable. */
const KEEP_IMAGES = 3;

/** Where the image is staged: a tmpfs, for the deterministic directory order (see stage.ts). */
export const STAGING_PARENT = process.env["HUTCH_ROOTFS_STAGING"] ?? "/dev/shm";

export interface RootfsOptions {
  /** Rebuild the image even if cached (the base is reused). */
  force?: boolean;
  /** Rebuild the base tree too. */
  forceBase?: boolean;
  log?: LogFn;
  /** Fail (notCached) on a cache miss instead of building. */
  cachedOnly?: boolean;
}

/** What rootfs.json records next to the image. */
export interface RootfsInfo {
  hash: string;
  baseHash: string;
  epoch: number;
  uuid: string;
  /** Filesystem size (the image file's length). */
  sizeBytes: number;
  /** What the sparse image file occupies on the host. */
  allocatedBytes: number;
  imageSha256: string;
  inodes: number;
  usedInodes: number;
  buildSeconds: number;
  builtAt: string;
}

export interface RootfsImage {
  /** Path of rootfs.ext4: attach read-only as the VM's first virtio-blk disk. */
  image: string;
  sizeBytes: number;
  /** Time this image took to build (recorded at build time for a cache hit). */
  buildSeconds: number;
  hash: string;
  allocatedBytes: number;
  imageSha256: string;
  dir: string;
  cached: boolean;
  base: { hash: string; sizeBytes: number; files: number; buildSeconds: number; cached: boolean; packages: number; dir: string };
}

export function epochFromEnv(): number {
  const raw = process.env["SOURCE_DATE_EPOCH"];
  if (raw === undefined || raw === "") return DEFAULT_EPOCH;
  const n = Number(raw);
  if (!Number.isInteger(n) || n <= 0) throw new Error(`SOURCE_DATE_EPOCH must be a positive integer, got ${JSON.stringify(raw)}`);
  return n;
}

/** A UUID derived from the image hash: fixed for given inputs, different between images. */
export function uuidFor(hash: string): string {
  const h = createHash("sha256").update(`hutch-rootfs:${hash}`).digest("hex");
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-4${h.slice(13, 16)}-8${h.slice(17, 20)}-${h.slice(20, 32)}`;
}

/**
 * Options the guest's agent gets on top of agent-start.sh's basics: it owns this machine
 * (may set the clock after a restore, manage guest memory), where the overlay's upper
 * layer is (dirtiness: writes outside /work and /tmp) and which cgroup tenant commands
 * run in. The agent is built from the same checkout, so it knows them.
 */
export function guestAgentFlags(): string[] {
  return ['--guest', '--overlay-upper=/run/hutch/overlay/upper', '--workload-cgroup=/sys/fs/cgroup/workload'];
}

export async function sha256File(file: string): Promise<string> {
  const hash = createHash("sha256");
  for await (const chunk of createReadStream(file)) hash.update(chunk as Buffer);
  return hash.digest("hex");
}

function toResult(dir: string, info: RootfsInfo, base: { dir: string; info: BaseInfo; cached: boolean }, cached: boolean): RootfsImage {
  return {
    image: path.join(dir, "rootfs.ext4"),
    sizeBytes: info.sizeBytes,
    buildSeconds: info.buildSeconds,
    hash: info.hash,
    allocatedBytes: info.allocatedBytes,
    imageSha256: info.imageSha256,
    dir,
    cached,
    base: {
      hash: base.info.hash,
      sizeBytes: base.info.sizeBytes,
      files: base.info.files,
      buildSeconds: base.info.buildSeconds,
      cached: base.cached,
      packages: base.info.installed.length,
      dir: base.dir,
    },
  };
}

async function readCached(dir: string): Promise<RootfsInfo | undefined> {
  const json = path.join(dir, "rootfs.json");
  if (!(await exists(json)) || !(await exists(path.join(dir, "rootfs.ext4")))) return undefined;
  return JSON.parse(await readFile(json, "utf8")) as RootfsInfo;
}

/**
 * The guest rootfs image for the current base, agent and init; built on a
 * cache miss (base: minutes, once; image: seconds).
 */
export async function ensureRootfs(opts: RootfsOptions = {}): Promise<RootfsImage> {
  const log = opts.log ?? defaultLog;
  if (process.getuid?.() !== 0) throw new Error("building the guest rootfs needs root (chroot, device nodes, file ownership)");
  const base = await ensureBase({ force: opts.forceBase, log, ...(opts.cachedOnly ? { cachedOnly: true } : {}) });
  if (!base.cached) log(`base: built in ${fmtSeconds(base.info.buildSeconds)} (${fmtBytes(base.info.sizeBytes)})`);

  const rootfsCache = await cacheDir("rootfs");
  {
    const epoch = epochFromEnv();
    const hash = await hashInputs([
      { label: "base", value: base.info.hash },
      { label: "epoch", value: String(epoch) },
      ...GUEST_FILES.map((f) => ({ file: f.src })),
      ...BUILD_CODE.map((file) => ({ file })),
    ]);
    const dir = path.join(rootfsCache, hash);
    if (!opts.force && !opts.forceBase) {
      const hit = await readCached(dir);
      if (hit) return toResult(dir, hit, base, true);
    }
    if (opts.cachedOnly) notCached("the guest rootfs image for this agent", dir);
    await ensureHostPackages(["e2fsprogs", "tar", "findutils"], log);
    return await withLock(
      path.join(cacheRoot(), "rootfs", `${hash}.lock`),
      async () => {
        if (!opts.force && !opts.forceBase) {
          const hit = await readCached(dir);
          if (hit) return toResult(dir, hit, base, true);
        }
        const phases = new Phases("image", log);
        const uuid = uuidFor(hash);
        let info: RootfsInfo | undefined;
        await fillAtomically(dir, async (tmp) => {
          const stageDir = await mkdtemp(path.join(STAGING_PARENT, `hutch-rootfs-${hash}-`));
          try {
            await phases.run("stage base + tenant + template settings (sorted copy to tmpfs)", () =>
              stageTree({
                baseTree: base.tree,
                stageDir,
                epoch,
                imageInfo: { hash, baseHash: base.info.hash, epoch, packages: base.info.installed },
              }),
            );
            const image = path.join(tmp, "rootfs.ext4");
            const fs = await phases.run("mkfs.ext4 -d (reproducible)", () =>
              makeReproducibleExt4({ dir: stageDir, out: image, epoch, uuid, label: "hutch-root", log }),
            );
            const imageSha256 = await phases.run("sha256", () => sha256File(image));
            info = {
              hash,
              baseHash: base.info.hash,
              epoch,
              uuid,
              sizeBytes: fs.sizeBytes,
              allocatedBytes: fs.allocatedBytes,
              imageSha256,
              inodes: fs.inodes,
              usedInodes: fs.usedInodes,
              buildSeconds: Math.round(phases.elapsed() * 10) / 10,
              builtAt: new Date().toISOString(),
            };
            await writeFile(path.join(tmp, "rootfs.json"), `${JSON.stringify(info, null, 2)}\n`);
          } finally {
            await rm(stageDir, { recursive: true, force: true });
          }
        });
        if (!info) throw new Error("image build finished without build info");
        await pruneCache(rootfsCache, hash, KEEP_IMAGES, log);
        log(
          `image ${hash}: ${fmtBytes(info.sizeBytes)} filesystem, ${fmtBytes(info.allocatedBytes)} on disk, built in ${fmtSeconds(info.buildSeconds)}; sha256 ${info.imageSha256.slice(0, 16)}`,
        );
        return toResult(dir, info, base, false);
      },
      log,
    );
  }
}
