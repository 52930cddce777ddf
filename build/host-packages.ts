/**
 * The Debian packages hutch uses on the host, installed by `./hutch setup` (and, in a clone,
 * before any other command runs, once its options are known to be good): the sandbox
 * (bubblewrap), the VMM (QEMU), the guest image builders (debootstrap, e2fsprogs, busybox
 * for the Debian-kernel initramfs), the guest kernel build (gcc, make, bc, bison, flex,
 * libelf, libssl), the catalog the cluster tests run (redis-server).
 */
import { accessSync, constants } from "node:fs";
import { join } from "node:path";
import { ensureHostPackages, missingHostPackages } from "./host-apt.ts";

export const HOST_PACKAGES = [
  "util-linux", "procps", "bubblewrap", "qemu-system-x86", "debootstrap", "e2fsprogs", "busybox-static", "cpio", "xz-utils",
  "gcc", "make", "bc", "bison", "flex", "libelf-dev", "libssl-dev", "libc6-dev", "binutils", "perl", "git", "tar", "python3", "socat",
  "redis-server",
] as const;

function onPath(cmd: string): boolean {
  return (process.env["PATH"] ?? "").split(":").some((d) => {
    try {
      accessSync(join(d || ".", cmd), constants.X_OK);
      return true;
    } catch {
      return false;
    }
  });
}

/** Installs what is missing (nothing to do, and no apt, on a machine that has it all). */
export async function installHostPackages(log: (m: string) => void): Promise<{ installed: string[] }> {
  // kubectl renders deploy/kubernetes offline (kubectl kustomize) in its test; any kubectl
  // will do, so Debian's is installed only where there is none.
  const names: string[] = [...HOST_PACKAGES, ...(onPath("kubectl") ? [] : ["kubernetes-client"])];
  const missing = await missingHostPackages(names);
  if (missing.length > 0) await ensureHostPackages(missing, log);
  return { installed: missing };
}
