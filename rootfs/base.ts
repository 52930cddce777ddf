/**
 * The base layer of the guest root: Debian minbase (debootstrap) plus the
 * guest packages, trimmed and with Python's bytecode compiled, kept as a
 * directory tree in `<cache>/rootfs-base/<hash>/tree`.
 *
 * Keyed by the package list, the in-chroot setup script and this file, so the
 * slow part (a minute or two of downloads and dpkg) runs again only when what
 * goes into the tree changes; the agent and init live in the image layer
 * (image.ts) and are cheap to change.
 */
import { mkdir, readFile, rm, writeFile, copyFile, chmod } from "node:fs/promises";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { cacheDir, cacheRoot, exists, fillAtomically, hashInputs, notCached, withLock } from "../build/cache.ts";
import { ensureHostPackages } from "../build/host-apt.ts";
import { capture, run } from "../build/run.ts";
import { assertNoMountsUnder, runInChroot, unmountAllUnder } from "./chroot.ts";
import { pruneCache } from "./prune.ts";
import { DPKG_PATH_FILTERS, GUEST_ARCH, GUEST_MIRROR, GUEST_PACKAGES, GUEST_SECURITY_MIRROR, GUEST_SUITE, PYTHON_OPT_LEVELS } from "./packages.ts";
import { defaultLog, fmtBytes, fmtSeconds, Phases, throttledLines, type LogFn } from "./progress.ts";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const THIS_FILE = fileURLToPath(import.meta.url);
const PACKAGES_FILE = path.join(HERE, "packages.ts");
const SETUP_SCRIPT = path.join(HERE, "guest", "base-setup.sh");
const DEBIAN_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg";
/** Base trees kept in the cache (the current one included). */
const KEEP_BASES = 2;
/** Build-time only dpkg setting, removed before the tree is cached. */
const UNSAFE_IO_CFG = "99-hutch-build-unsafe-io";

export interface BaseInfo {
  hash: string;
  suite: string;
  /** Packages asked for on top of minbase. */
  requested: string[];
  /** Every installed package as name=version (dpkg-query). */
  installed: string[];
  /** Apparent size of the tree (sum of file sizes). */
  sizeBytes: number;
  files: number;
  buildSeconds: number;
  debootstrapSeconds: number;
  setupSeconds: number;
  builtAt: string;
}

export interface BaseTree {
  dir: string;
  /** The root directory of the guest tree. */
  tree: string;
  info: BaseInfo;
  cached: boolean;
}

export interface EnsureBaseOptions {
  force?: boolean;
  log?: LogFn;
  /** Fail (notCached) on a cache miss instead of building. */
  cachedOnly?: boolean;
}

/** The cache key of the base tree (also used as part of the image's key). */
export function baseHash(): Promise<string> {
  return hashInputs([
    { file: PACKAGES_FILE },
    { file: SETUP_SCRIPT },
    { file: THIS_FILE },
    { label: "suite", value: `${GUEST_SUITE}/${GUEST_ARCH}` },
  ]);
}

async function readCached(dir: string): Promise<BaseTree | undefined> {
  const json = path.join(dir, "base.json");
  const tree = path.join(dir, "tree");
  if (!(await exists(json)) || !(await exists(path.join(tree, "usr/bin/node")))) return undefined;
  return { dir, tree, info: JSON.parse(await readFile(json, "utf8")) as BaseInfo, cached: true };
}

async function treeStats(tree: string): Promise<{ sizeBytes: number; files: number }> {
  const size = await capture(["du", "-s", "--apparent-size", "--block-size=1", tree]);
  const files = await capture(["sh", "-c", 'find "$1" -xdev | wc -l', "sh", tree]);
  return { sizeBytes: Number.parseInt(size, 10), files: Number.parseInt(files, 10) };
}

async function build(tmp: string, hash: string, log: LogFn): Promise<BaseInfo> {
  const phases = new Phases("base", log);
  const tree = path.join(tmp, "tree");
  await mkdir(tree, { recursive: true });
  const debCache = await cacheDir("downloads", `debootstrap-${GUEST_SUITE}-${GUEST_ARCH}`);

  // dpkg reads the target's dpkg.cfg.d during debootstrap's second stage: no
  // fsync per file while building (a crash just means rebuilding; the tree is
  // only used once complete), and no docs from the packages it installs there.
  await mkdir(path.join(tree, "etc/dpkg/dpkg.cfg.d"), { recursive: true });
  await writeFile(path.join(tree, "etc/dpkg/dpkg.cfg.d", UNSAFE_IO_CFG), "force-unsafe-io\n");
  await writeFile(path.join(tree, "etc/dpkg/dpkg.cfg.d/90-hutch-nodoc"), `# hutch: no docs, man pages or translations in the guest\n${DPKG_PATH_FILTERS.join("\n")}\n`);

  const t0 = performance.now();
  await phases.run(`debootstrap --variant=minbase ${GUEST_SUITE}`, () =>
    run(
      [
        "debootstrap",
        "--variant=minbase",
        `--arch=${GUEST_ARCH}`,
        "--components=main",
        `--keyring=${DEBIAN_KEYRING}`,
        `--cache-dir=${debCache}`,
        GUEST_SUITE,
        tree,
        GUEST_MIRROR,
      ],
      { onLine: throttledLines(log, "  debootstrap") },
    ),
  );
  const debootstrapSeconds = (performance.now() - t0) / 1000;

  const t1 = performance.now();
  await phases.run(`install ${GUEST_PACKAGES.length} packages, trim, compile bytecode`, async () => {
    // debootstrap leaves the host's resolver config out; apt in the chroot needs one.
    await copyFile("/etc/resolv.conf", path.join(tree, "etc/resolv.conf"));
    // Packages apt fetched on an earlier build are reused (apt checks their hashes).
    const archives = path.join(tree, "var/cache/apt/archives");
    await mkdir(archives, { recursive: true });
    await run(["sh", "-c", 'cp -n "$1"/*.deb "$2"/ 2>/dev/null || true', "sh", debCache, archives]);
    const script = path.join(tree, "tmp/hutch-base-setup.sh");
    await copyFile(SETUP_SCRIPT, script);
    await chmod(script, 0o755);
    await runInChroot(tree, ["/bin/sh", "/tmp/hutch-base-setup.sh", ...GUEST_PACKAGES], {
      env: {
        HUTCH_SUITE: GUEST_SUITE,
        HUTCH_MIRROR: GUEST_MIRROR,
        HUTCH_SECURITY_MIRROR: GUEST_SECURITY_MIRROR,
        HUTCH_PYC_OPT_LEVELS: PYTHON_OPT_LEVELS.join(" "),
      },
      onLine: (() => {
        // The script's own milestones always, apt/dpkg chatter at most every few seconds.
        const chatter = throttledLines(log, "   ");
        return (line: string) => (line.startsWith("base-setup:") ? log(`  ${line}`) : chatter(line));
      })(),
    });
    await rm(script, { force: true });
    await run(["sh", "-c", 'for f in "$1"/*.deb; do [ -e "$f" ] || continue; mv -n "$f" "$2"/; rm -f "$f"; done', "sh", archives, debCache]);
    await rm(path.join(tree, "etc/dpkg/dpkg.cfg.d", UNSAFE_IO_CFG), { force: true });
  });
  const setupSeconds = (performance.now() - t1) / 1000;

  const installed = (await runInChroot(tree, ["dpkg-query", "-W", "-f", "${Package}=${Version}\\n"], { captureStdout: true, proc: false }))
    .split("\n")
    .filter(Boolean)
    .sort();
  const stats = await treeStats(tree);
  return {
    hash,
    suite: GUEST_SUITE,
    requested: [...GUEST_PACKAGES],
    installed,
    ...stats,
    buildSeconds: Math.round(phases.elapsed() * 10) / 10,
    debootstrapSeconds: Math.round(debootstrapSeconds * 10) / 10,
    setupSeconds: Math.round(setupSeconds * 10) / 10,
    builtAt: new Date().toISOString(),
  };
}

/** The base tree for the current package list, built (a minute or two) only on a cache miss. */
export async function ensureBase(opts: EnsureBaseOptions = {}): Promise<BaseTree> {
  const log = opts.log ?? defaultLog;
  if (process.getuid?.() !== 0) throw new Error("building the guest base needs root (debootstrap, chroot, device nodes)");
  const hash = await baseHash();
  const dir = path.join(await cacheDir("rootfs-base"), hash);
  if (!opts.force) {
    const hit = await readCached(dir);
    if (hit) return hit;
  }
  if (opts.cachedOnly) notCached("the guest rootfs base", dir);
  await ensureHostPackages(["debootstrap", "debian-archive-keyring"], log);
  return withLock(
    path.join(cacheRoot(), "rootfs-base", `${hash}.lock`),
    async () => {
      if (!opts.force) {
        const hit = await readCached(dir);
        if (hit) return hit;
      }
      log(`base ${hash}: building (Debian ${GUEST_SUITE} minbase + ${GUEST_PACKAGES.join(" ")})`);
      let info: BaseInfo | undefined;
      await fillAtomically(dir, async (tmp) => {
        try {
          info = await build(tmp, hash, log);
          await writeFile(path.join(tmp, "base.json"), `${JSON.stringify(info, null, 2)}\n`);
        } catch (err) {
          // fillAtomically deletes tmp next: nothing may still be mounted inside it.
          await unmountAllUnder(tmp);
          await assertNoMountsUnder(tmp);
          throw err;
        }
        await assertNoMountsUnder(tmp);
      });
      if (!info) throw new Error("base build finished without build info");
      log(`base ${hash}: ${fmtBytes(info.sizeBytes)}, ${info.files} files, ${info.installed.length} packages, built in ${fmtSeconds(info.buildSeconds)}`);
      await pruneCache(path.dirname(dir), hash, KEEP_BASES, log);
      const built = await readCached(dir);
      if (!built) throw new Error(`base cache entry ${dir} is incomplete right after the build`);
      return { ...built, cached: false };
    },
    log,
  );
}
