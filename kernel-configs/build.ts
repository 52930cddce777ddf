/**
 * Build hutch's guest kernel from Debian's linux-source-6.12 package.
 *
 *   npx tsx kernel-configs/build.ts [--force] [--json]
 *
 * Config = allnoconfig with tinyconfig's and kvm_guest.config's settings and
 * then kernel-configs/fragments/*.config (in name order, later lines win) as
 * KCONFIG_ALLCONFIG, so nothing is on unless asked for; every fragment line is verified
 * to have survived the merge, since Kconfig silently drops a value whose
 * dependencies are unmet. Everything is built in: no modules, no initramfs.
 *
 * Artifacts land in <cache>/kernel/<hash>/ (vmlinux for PVH/Firecracker,
 * bzImage, config, build.json), where the hash covers the fragments, the
 * source package version and this file. A cache hit costs no build. The
 * source tree and object dir stay in <cache>/kernel-build/ so a fragment
 * change rebuilds incrementally.
 */
import { createWriteStream } from "node:fs";
import { copyFile, mkdir, readFile, readdir, rm, writeFile } from "node:fs/promises";
import { availableParallelism } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { cacheDir, exists, fillAtomically, hashInputs, notCached, withLock } from "../build/cache.ts";
import { extractDeb, fetchDebianPackages } from "../build/debian-fetch.ts";
import { ensureHostPackages } from "../build/host-apt.ts";
import { capture, run, runAsScript } from "../build/run.ts";
import { capabilitiesOf, checkConfig, fragmentFiles, parseConfig, type Capability } from "./check.ts";

/** Debian suite and binary package that carry the kernel source tarball. */
export const SOURCE_SUITE = "trixie";
export const SOURCE_PACKAGE = "linux-source-6.12";

/** Host (bookworm) packages the kernel build needs. */
const BUILD_DEPS = ["gcc", "make", "bc", "bison", "flex", "libelf-dev", "libssl-dev", "cpio", "xz-utils", "binutils", "perl", "libc6-dev"];

/** Make's step count for a full build of this config (CC/LD/AR... lines); refined after each full build. */
const DEFAULT_FULL_BUILD_STEPS = 1700;

export interface BuildInfo {
  sourcePackage: string;
  sourceVersion: string;
  sourceSuite: string;
  hash: string;
  buildSeconds: number;
  /** CPU seconds (user+sys) of the compile; divide by `jobs` for the wall time on an otherwise idle machine. */
  buildCpuSeconds: number;
  /** Whole-run time including fetch, extraction and config. */
  totalSeconds: number;
  jobs: number;
  incremental: boolean;
  builtAt: string;
  capabilities: Capability[];
}

export interface KernelArtifacts {
  dir: string;
  vmlinux: string;
  bzImage: string;
  config: string;
  buildJson: string;
  info: BuildInfo;
  /** True when nothing was built in this call. */
  cached: boolean;
}

export interface EnsureKernelOptions {
  /** Rebuild even if the cache has this kernel. */
  force?: boolean;
  /** Parallel make jobs; default: all CPUs. */
  jobs?: number;
  /** Progress lines; default: stderr with a [kernel] prefix. */
  log?: (message: string) => void;
  /** Fail (notCached) on a cache miss instead of building. */
  cachedOnly?: boolean;
}

const THIS_FILE = fileURLToPath(import.meta.url);
const SRC_STAMP = ".hutch-extracted";

function defaultLog(message: string): void {
  process.stderr.write(`[kernel] ${message}\n`);
}

function fmtSeconds(s: number): string {
  return s >= 60 ? `${Math.floor(s / 60)}m${String(Math.round(s % 60)).padStart(2, "0")}s` : `${s.toFixed(1)}s`;
}

/** Unpack the source tarball from the .deb once per source version. */
async function ensureSourceTree(debPath: string, version: string, buildRoot: string, log: (m: string) => void): Promise<string> {
  const srcDir = path.join(buildRoot, `linux-source-${version}`);
  if (await exists(path.join(srcDir, SRC_STAMP))) return srcDir;
  log(`extracting ${path.basename(debPath)}`);
  const started = Date.now();
  const unpack = path.join(buildRoot, `.deb-${process.pid}`);
  await rm(unpack, { recursive: true, force: true });
  await rm(srcDir, { recursive: true, force: true });
  try {
    await extractDeb(debPath, unpack);
    const usrSrc = path.join(unpack, "usr/src");
    const tarball = (await readdir(usrSrc)).find((f) => /^linux-source-.*\.tar\.(xz|gz|bz2|zst)$/.test(f));
    if (!tarball) throw new Error(`${debPath} has no linux-source tarball under /usr/src`);
    await mkdir(srcDir, { recursive: true });
    await run(["tar", "-xf", path.join(usrSrc, tarball), "-C", srcDir, "--strip-components=1"]);
    await writeFile(path.join(srcDir, SRC_STAMP), `${version}\n`);
  } finally {
    await rm(unpack, { recursive: true, force: true });
  }
  log(`extracted in ${fmtSeconds((Date.now() - started) / 1000)}`);
  return srcDir;
}

/** Fragment lines as option -> value ("n" for "is not set"), later files winning. */
async function fragmentSettings(): Promise<Map<string, string>> {
  const wanted = new Map<string, string>();
  for (const file of fragmentFiles()) {
    for (const [k, v] of parseConfig(await readFile(file, "utf8"))) wanted.set(k, v);
  }
  return wanted;
}

/**
 * The base configs `make tinyconfig` and `make kvm_guest.config` would apply,
 * in that order; our fragments follow them.
 */
const BASE_CONFIGS = ["kernel/configs/tiny-base.config", "kernel/configs/tiny.config", "arch/x86/configs/tiny.config", "kernel/configs/kvm_guest.config"];

async function configure(srcDir: string, objDir: string, log: (m: string) => void): Promise<string> {
  log("configuring: allnoconfig with tinyconfig + kvm_guest.config + fragments");
  // One allnoconfig pass with everything as KCONFIG_ALLCONFIG, instead of
  // tinyconfig followed by merges: a merge ends in olddefconfig, which gives
  // every option that the merge made visible its *default* (often y: ethtool
  // netlink, TCP extras, cpufreq...). allnoconfig leaves them off unless a
  // fragment asks, which is what keeps this kernel small and quick to build.
  const allconfig = path.join(objDir, "hutch-allconfig");
  const chunks: string[] = [];
  for (const file of [...BASE_CONFIGS.map((p) => path.join(srcDir, p)), ...fragmentFiles()]) {
    chunks.push(`# ---- ${path.basename(file)}\n${await readFile(file, "utf8")}\n`);
  }
  await writeFile(allconfig, chunks.join(""));
  await run(["make", "-C", srcDir, `O=${objDir}`, "ARCH=x86_64", "-s", `KCONFIG_ALLCONFIG=${allconfig}`, "allnoconfig"]);
  const configText = await readFile(path.join(objDir, ".config"), "utf8");
  const actual = parseConfig(configText);
  const dropped: string[] = [];
  for (const [option, value] of await fragmentSettings()) {
    const got = actual.get(option) ?? "n";
    if (got !== value) dropped.push(`${option}: fragment says ${value}, config has ${got}`);
  }
  if (dropped.length > 0) {
    throw new Error(`kernel config lost fragment settings (unmet dependencies or conflicts):\n  ${dropped.join("\n  ")}`);
  }
  const check = checkConfig(configText);
  if (!check.ok) throw new Error(`kernel config fails its own check: ${JSON.stringify(check.problems)}`);
  return configText;
}

interface MakeStats {
  steps: number;
  seconds: number;
  /** CPU time (user+sys) of make and everything it ran: comparable across machines and load, unlike wall time. */
  cpuSeconds: number;
}

/**
 * CPU seconds used by this process's reaped descendants (cutime + cstime in
 * /proc/self/stat). make waits for its compilers, so after make exits this
 * covers the whole build.
 */
async function childCpuSeconds(): Promise<number> {
  const stat = await readFile("/proc/self/stat", "utf8");
  // Fields after the command name (which may contain spaces) start at ") ".
  const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  const ticks = Number(fields[13]) + Number(fields[14]);
  return ticks / 100; // USER_HZ is 100 on Linux/x86
}

async function compile(srcDir: string, objDir: string, jobs: number, expectedSteps: number, log: (m: string) => void): Promise<MakeStats> {
  const logFile = path.join(objDir, "hutch-make.log");
  const out = createWriteStream(logFile);
  const started = Date.now();
  const cpuBefore = await childCpuSeconds();
  let steps = 0;
  let lastReport = started;
  let lastStep = "";
  log(`make -j${jobs} vmlinux bzImage (full log: ${logFile})`);
  try {
    await run(["make", "-C", srcDir, `O=${objDir}`, "ARCH=x86_64", `-j${jobs}`, "vmlinux", "bzImage"], {
      onLine(line) {
        out.write(`${line}\n`);
        // Kbuild's quiet lines look like "  CC      kernel/fork.o": one per build step.
        if (/^\s{2}[A-Z][A-Z0-9_-]*\s+\S/.test(line)) {
          steps += 1;
          lastStep = line.trim().replace(/\s+/g, " ");
        }
        const now = Date.now();
        if (now - lastReport >= 15_000) {
          lastReport = now;
          const pct = Math.min(99, Math.floor((100 * steps) / expectedSteps));
          log(`build: ${steps} steps (~${pct}%), ${fmtSeconds((now - started) / 1000)} elapsed, at ${lastStep}`);
        }
      },
    });
  } catch (err) {
    throw new Error(`kernel build failed after ${steps} steps; full log: ${logFile}\n${(err as Error).message}`, { cause: err });
  } finally {
    await new Promise((r) => out.end(r));
  }
  return { steps, seconds: (Date.now() - started) / 1000, cpuSeconds: (await childCpuSeconds()) - cpuBefore };
}

/** vmlinux must carry the PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY), or QEMU/Firecracker cannot boot it directly. */
async function assertPvhNote(vmlinux: string): Promise<void> {
  const notes = await capture(["readelf", "--notes", vmlinux]);
  // readelf names the note PHYS32_ENTRY in newer binutils and "Unknown note type: (0x00000012)" in bookworm's.
  if (!/^\s*Xen\s+0x[0-9a-f]+\s+.*(PHYS32_ENTRY|\(0x00000012\))/im.test(notes)) {
    throw new Error(`${vmlinux} has no PVH entry note; QEMU -kernel and Firecracker cannot boot it directly`);
  }
}

async function removeOtherVersions(buildRoot: string, keep: string[], log: (m: string) => void): Promise<void> {
  for (const name of await readdir(buildRoot)) {
    if ((name.startsWith("linux-source-") || name.startsWith("obj-")) && !keep.includes(name)) {
      log(`removing stale build tree ${name}`);
      await rm(path.join(buildRoot, name), { recursive: true, force: true });
    }
  }
}

async function readCached(dir: string): Promise<KernelArtifacts | undefined> {
  const buildJson = path.join(dir, "build.json");
  const vmlinux = path.join(dir, "vmlinux");
  if (!(await exists(buildJson)) || !(await exists(vmlinux))) return undefined;
  const info = JSON.parse(await readFile(buildJson, "utf8")) as BuildInfo;
  return { dir, vmlinux, bzImage: path.join(dir, "bzImage"), config: path.join(dir, "config"), buildJson, info, cached: true };
}

/**
 * Return the guest kernel's artifacts, building it only when the cache has
 * no kernel for the current fragments, source version and build script.
 */
export async function ensureKernel(opts: EnsureKernelOptions = {}): Promise<KernelArtifacts> {
  const log = opts.log ?? defaultLog;
  const t0 = Date.now();
  const [source] = await fetchDebianPackages({ suite: SOURCE_SUITE, log }, [SOURCE_PACKAGE]);
  if (!source) throw new Error(`no ${SOURCE_PACKAGE} in Debian ${SOURCE_SUITE}`);
  const hash = await hashInputs([
    ...fragmentFiles().map((file) => ({ file })),
    { file: THIS_FILE },
    { label: "source", value: `${source.name}=${source.version}` },
  ]);
  const dir = path.join(await cacheDir("kernel"), hash);
  if (!opts.force) {
    const hit = await readCached(dir);
    if (hit) return hit;
  }
  if (opts.cachedOnly) notCached("the guest kernel", dir);

  await ensureHostPackages(BUILD_DEPS, log);
  const buildRoot = await cacheDir("kernel-build");
  return withLock(
    path.join(buildRoot, "lock"),
    async () => {
      // Another process may have built it while we waited for the lock.
      if (!opts.force) {
        const hit = await readCached(dir);
        if (hit) return hit;
      }
      const srcDir = await ensureSourceTree(source.path, source.version, buildRoot, log);
      const objName = `obj-${source.version}`;
      const objDir = await cacheDir("kernel-build", objName);
      const incremental = await exists(path.join(objDir, "vmlinux"));
      const configText = await configure(srcDir, objDir, log);

      const stepsFile = path.join(buildRoot, "full-build-steps.json");
      const expected = (await exists(stepsFile))
        ? (JSON.parse(await readFile(stepsFile, "utf8")) as { steps: number }).steps
        : DEFAULT_FULL_BUILD_STEPS;
      const jobs = opts.jobs ?? availableParallelism();
      const stats = await compile(srcDir, objDir, jobs, incremental ? expected / 4 : expected, log);
      if (!incremental) await writeFile(stepsFile, JSON.stringify({ steps: stats.steps }));
      log(`compiled in ${fmtSeconds(stats.seconds)} wall, ${fmtSeconds(stats.cpuSeconds)} CPU (${stats.steps} steps${incremental ? ", incremental" : ""})`);

      const vmlinuxBuilt = path.join(objDir, "vmlinux");
      await assertPvhNote(vmlinuxBuilt);
      const info: BuildInfo = {
        sourcePackage: source.name,
        sourceVersion: source.version,
        sourceSuite: SOURCE_SUITE,
        hash,
        buildSeconds: Math.round(stats.seconds * 10) / 10,
        buildCpuSeconds: Math.round(stats.cpuSeconds * 10) / 10,
        totalSeconds: Math.round((Date.now() - t0) / 100) / 10,
        jobs,
        incremental,
        builtAt: new Date().toISOString(),
        capabilities: capabilitiesOf(configText),
      };
      await fillAtomically(dir, async (tmp) => {
        await copyFile(vmlinuxBuilt, path.join(tmp, "vmlinux"));
        await copyFile(path.join(objDir, "arch/x86/boot/bzImage"), path.join(tmp, "bzImage"));
        await writeFile(path.join(tmp, "config"), configText);
        await writeFile(path.join(tmp, "build.json"), `${JSON.stringify(info, null, 2)}\n`);
      });
      await removeOtherVersions(buildRoot, [path.basename(srcDir), objName], log);
      const built = await readCached(dir);
      if (!built) throw new Error(`kernel cache entry ${dir} incomplete right after the build`);
      return { ...built, cached: false };
    },
    log,
  );
}

async function main(argv: string[]): Promise<number> {
  if (argv.includes("--help")) {
    process.stdout.write("usage: npx tsx kernel-configs/build.ts [--force] [--json]\n  builds (or finds in the cache) hutch's guest kernel and prints the artifact paths\n");
    return 0;
  }
  const unknown = argv.filter((a) => !["--force", "--json"].includes(a));
  if (unknown.length > 0) {
    process.stderr.write(`build: unknown argument(s) ${unknown.join(" ")}; see --help\n`);
    return 2;
  }
  const k = await ensureKernel({ force: argv.includes("--force") });
  const summary = {
    cached: k.cached,
    dir: k.dir,
    vmlinux: k.vmlinux,
    bzImage: k.bzImage,
    config: k.config,
    sourceVersion: k.info.sourceVersion,
    hash: k.info.hash,
    buildSeconds: k.info.buildSeconds,
    missingCapabilities: k.info.capabilities.filter((c) => !c.available).map((c) => c.name),
  };
  if (argv.includes("--json")) {
    process.stdout.write(`${JSON.stringify(summary)}\n`);
  } else {
    process.stdout.write(
      `${k.cached ? "cached" : "built"} kernel ${summary.sourceVersion} (${summary.hash}${k.cached ? "" : `, ${summary.buildSeconds} s`})\n` +
        `  vmlinux: ${summary.vmlinux}\n  bzImage: ${summary.bzImage}\n  config:  ${summary.config}\n`,
    );
  }
  return 0;
}

runAsScript(import.meta.url, "[kernel]", main);
