/**
 * Fallback guest kernel (`--kernel debian`): Debian trixie's packaged 6.12
 * kernel plus a busybox initramfs that loads the virtio/ext4/overlay/vsock
 * modules it has as modules, mounts the root given on the command line
 * (root=/dev/vda) read-only and switch_roots to its /sbin/init.
 *
 *   npx tsx kernel-configs/debian-kernel.ts [--json]
 *
 * Nothing is installed on the host: the package is fetched with
 * build/debian-fetch.ts and unpacked. Cached in <cache>/kernel-debian/<hash>/
 * (vmlinuz, initrd.img, config, build.json with the capabilities it lacks).
 *
 * Boot it with microvm's ACPI on (see boot-params.ts): the Debian kernel lacks
 * VIRTIO_MMIO_CMDLINE_DEVICES and finds virtio-mmio devices through ACPI.
 */
import { createHash } from "node:crypto";
import { copyFile, mkdir, mkdtemp, readFile, readdir, rm, writeFile } from "node:fs/promises";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { ensureStaticBusybox } from "../build/busybox.ts";
import { cacheDir, exists, fillAtomically, hashInputs, notCached } from "../build/cache.ts";
import { extractDeb, fetchDebianPackages, showPackage } from "../build/debian-fetch.ts";
import { ensureHostPackages } from "../build/host-apt.ts";
import { packInitramfs } from "../build/image-pack.ts";
import { run, runAsScript } from "../build/run.ts";
import { capabilitiesOf, parseConfig, type Capability, type CapabilityName } from "./check.ts";
import { installBusyboxLinks } from "./probe-root.ts";

export const DEBIAN_KERNEL_SUITE = "trixie";
/** Metapackage whose Depends names the current 6.12 image package. */
const META_PACKAGE = "linux-image-amd64";

/**
 * Modules the initramfs loads, in this order after their dependencies. crc32c
 * is not a declared dependency of ext4 (it is looked up through the crypto
 * API, which would need modprobe), so it is listed explicitly.
 */
export const INITRAMFS_MODULES: readonly string[] = [
  "virtio_mmio",
  "virtio_blk",
  "virtio_console",
  "virtio_rng",
  "virtio_balloon",
  "crc32c_generic",
  "crc16",
  "mbcache",
  "jbd2",
  "ext4",
  "overlay",
  "vsock",
  "vmw_vsock_virtio_transport_common",
  "vmw_vsock_virtio_transport",
];

export interface DebianKernel {
  dir: string;
  vmlinuz: string;
  initrd: string;
  config: string;
  kernelRelease: string;
  packageVersion: string;
  capabilities: Capability[];
  /** Capabilities this kernel does not have at all (e.g. idle_page_tracking). */
  lacking: CapabilityName[];
  /** Modules loaded by the initramfs, in load order. */
  modules: string[];
  cached: boolean;
}

const THIS_FILE = fileURLToPath(import.meta.url);

function normalizeModuleName(fileOrName: string): string {
  return path.basename(fileOrName).replace(/\.ko(\.(xz|zst|gz))?$/, "").replace(/-/g, "_");
}

/** Index every module file in an unpacked image: module name -> path. */
async function indexModules(modulesDir: string): Promise<Map<string, string>> {
  const index = new Map<string, string>();
  const walk = async (dir: string): Promise<void> => {
    for (const e of await readdir(dir, { withFileTypes: true })) {
      const p = path.join(dir, e.name);
      if (e.isDirectory()) await walk(p);
      else if (/\.ko(\.(xz|zst|gz))?$/.test(e.name)) index.set(normalizeModuleName(e.name), p);
    }
  };
  await walk(modulesDir);
  return index;
}

/** Decompress a module file into `out` (.ko), whatever its compression. */
async function decompressModule(src: string, out: string): Promise<void> {
  if (src.endsWith(".ko")) return copyFile(src, out);
  const tool = src.endsWith(".xz") ? ["xz", "-dc"] : src.endsWith(".zst") ? ["zstd", "-dc"] : ["gzip", "-dc"];
  await run(["sh", "-c", '"$@" > "$0"', out, ...tool, src]);
}

/** The `depends=` entry of a module's .modinfo (comma-separated module names). */
async function moduleDepends(koFile: string): Promise<string[]> {
  const data = await readFile(koFile);
  const key = Buffer.from("\0depends=");
  const at = data.indexOf(key);
  if (at < 0) return [];
  const end = data.indexOf(0, at + key.length);
  const value = data.subarray(at + key.length, end).toString("utf8");
  return value.split(",").filter(Boolean).map(normalizeModuleName);
}

/**
 * Decompress the wanted modules and their dependencies into `outDir`;
 * returns their names in a valid load order (dependencies first). Modules the
 * kernel has built in are skipped.
 */
async function collectModules(index: Map<string, string>, outDir: string, log: (m: string) => void): Promise<string[]> {
  const order: string[] = [];
  const visiting = new Set<string>();
  const done = new Set<string>();
  const visit = async (name: string, wantedBy: string): Promise<void> => {
    if (done.has(name)) return;
    if (visiting.has(name)) throw new Error(`module dependency cycle at ${name}`);
    const src = index.get(name);
    if (!src) {
      // Built in (e.g. virtio_console here) or genuinely absent: only the former is fine.
      log(`module ${name} (for ${wantedBy}) is not a module in this kernel; assuming built in`);
      done.add(name);
      return;
    }
    visiting.add(name);
    const ko = path.join(outDir, `${name}.ko`);
    await decompressModule(src, ko);
    for (const dep of await moduleDepends(ko)) await visit(dep, name);
    visiting.delete(name);
    done.add(name);
    order.push(name);
  };
  for (const m of INITRAMFS_MODULES) await visit(m, "initramfs");
  return order;
}

function initScript(modules: readonly string[]): string {
  return `#!/bin/sh
# hutch fallback initramfs for Debian's kernel: load the drivers Debian builds
# as modules, mount root= read-only and hand over to its /sbin/init.
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in ${modules.join(" ")}; do
  insmod /lib/modules/$m.ko 2>/dev/null || echo "initramfs: cannot load $m" > /dev/console
done
root=/dev/vda; fstype=ext4; init=/sbin/init; mode=ro
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    root=*) root=\${arg#root=} ;;
    rootfstype=*) fstype=\${arg#rootfstype=} ;;
    init=*) init=\${arg#init=} ;;
    rw) mode=rw ;;
    ro) mode=ro ;;
  esac
done
# The disk appears asynchronously after virtio_blk probes it.
i=0
while [ ! -b "$root" ] && [ $i -lt 100 ]; do usleep 50000; i=$((i+1)); done
mkdir -p /newroot
if ! mount -t "$fstype" -o "$mode" "$root" /newroot; then
  echo "initramfs: cannot mount $root ($fstype, $mode)" > /dev/console
  sleep 1; reboot -f
fi
# Same view as hutch's own kernel gives its init: devtmpfs on /dev, nothing else.
mount --move /dev /newroot/dev 2>/dev/null || mount -t devtmpfs devtmpfs /newroot/dev
umount /proc /sys
exec switch_root /newroot "$init"
`;
}

/** Find the image package the metapackage currently points at. */
async function imagePackageName(log: (m: string) => void): Promise<string> {
  const meta = await showPackage({ suite: DEBIAN_KERNEL_SUITE, log }, META_PACKAGE);
  const m = /(linux-image-6\.12[^\s,(]*)/.exec(meta.depends);
  if (!m) throw new Error(`${META_PACKAGE} in ${DEBIAN_KERNEL_SUITE} does not depend on a 6.12 image (Depends: ${meta.depends})`);
  return m[1]!;
}

/** Debian's kernel + a generated initramfs, built once per package version. */
export async function ensureDebianKernel(opts: { force?: boolean; log?: (m: string) => void; cachedOnly?: boolean } = {}): Promise<DebianKernel> {
  const log = opts.log ?? ((m: string) => process.stderr.write(`[debian-kernel] ${m}\n`));
  const imageName = await imagePackageName(log);
  const [image] = await fetchDebianPackages({ suite: DEBIAN_KERNEL_SUITE, log }, [imageName]);
  if (!image) throw new Error(`no ${imageName} in Debian ${DEBIAN_KERNEL_SUITE}`);
  const busybox = await ensureStaticBusybox(log);
  const busyboxSum = createHash("sha256").update(await readFile(busybox)).digest("hex");
  const hash = await hashInputs([{ file: THIS_FILE }, { label: "image", value: `${image.name}=${image.version}` }, { label: "busybox", value: busyboxSum }]);
  const dir = path.join(await cacheDir("kernel-debian"), hash);
  const buildJson = path.join(dir, "build.json");
  if (!opts.force && (await exists(buildJson))) {
    return { ...(JSON.parse(await readFile(buildJson, "utf8")) as DebianKernel), cached: true };
  }
  if (opts.cachedOnly) notCached("the Debian guest kernel", dir);
  await ensureHostPackages(["xz-utils", "cpio", "gzip"], log);

  const work = await mkdtemp(path.join(await cacheDir("kernel-debian"), ".work-"));
  try {
    log(`unpacking ${image.name} ${image.version}`);
    const unpacked = path.join(work, "deb");
    await extractDeb(image.path, unpacked);
    const boot = path.join(unpacked, "boot");
    const bootFiles = await readdir(boot);
    const vmlinuzName = bootFiles.find((f) => f.startsWith("vmlinuz-"));
    const configName = bootFiles.find((f) => f.startsWith("config-"));
    if (!vmlinuzName || !configName) throw new Error(`${image.path} has no /boot/vmlinuz-* or /boot/config-*`);
    const release = vmlinuzName.slice("vmlinuz-".length);
    let modulesDir = path.join(unpacked, "usr/lib/modules", release);
    if (!(await exists(modulesDir))) modulesDir = path.join(unpacked, "lib/modules", release);
    const configText = await readFile(path.join(boot, configName), "utf8");
    const config = parseConfig(configText);

    log("building the initramfs");
    const root = path.join(work, "initramfs");
    for (const d of ["bin", "sbin", "dev", "proc", "sys", "newroot", "lib/modules"]) await mkdir(path.join(root, d), { recursive: true });
    await copyFile(busybox, path.join(root, "bin/busybox"));
    await run(["chmod", "755", path.join(root, "bin/busybox")]);
    await installBusyboxLinks(root);
    await run(["mknod", "-m", "600", path.join(root, "dev/console"), "c", "5", "1"]);
    const modules = await collectModules(await indexModules(modulesDir), path.join(root, "lib/modules"), log);
    await rm(path.join(root, "init"), { force: true });
    await writeFile(path.join(root, "init"), initScript(modules), { mode: 0o755, flag: "wx" });

    const capabilities = capabilitiesOf(config);
    const lacking = capabilities.filter((c) => !c.available).map((c) => c.name);
    const result: DebianKernel = {
      dir,
      vmlinuz: path.join(dir, "vmlinuz"),
      initrd: path.join(dir, "initrd.img"),
      config: path.join(dir, "config"),
      kernelRelease: release,
      packageVersion: image.version,
      capabilities,
      lacking,
      modules,
      cached: false,
    };
    await fillAtomically(dir, async (tmp) => {
      await copyFile(path.join(boot, vmlinuzName), path.join(tmp, "vmlinuz"));
      await writeFile(path.join(tmp, "config"), configText);
      await packInitramfs(root, path.join(tmp, "initrd.img"));
      await writeFile(path.join(tmp, "build.json"), `${JSON.stringify(result, null, 2)}\n`);
    });
    log(`ready: ${release}, ${modules.length} modules in the initramfs; lacks: ${lacking.join(", ") || "nothing"}`);
    return result;
  } finally {
    await rm(work, { recursive: true, force: true });
  }
}

async function main(argv: string[]): Promise<number> {
  const k = await ensureDebianKernel({ force: argv.includes("--force") });
  if (argv.includes("--json")) {
    process.stdout.write(`${JSON.stringify({ ...k, capabilities: undefined })}\n`);
  } else {
    process.stdout.write(
      `${k.cached ? "cached" : "built"} Debian kernel ${k.kernelRelease} (${k.packageVersion})\n  vmlinuz: ${k.vmlinuz}\n  initrd:  ${k.initrd}\n` +
        `  modules: ${k.modules.join(" ")}\n  lacks:   ${k.lacking.join(", ") || "nothing"}\n`,
    );
  }
  return 0;
}

runAsScript(import.meta.url, "[debian-kernel]", main);
