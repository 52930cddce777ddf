/**
 * The Debian packages hutch uses on the host, installed by `./hutch setup` (and, in a clone,
 * before any other command runs, once its options are known to be good): the sandbox
 * (bubblewrap), the VMM (QEMU), the guest image builders (debootstrap, e2fsprogs, busybox
 * for the Debian-kernel initramfs) and the guest kernel build (gcc, make, bc, bison, flex,
 * libelf, libssl). The test suite needs a Redis beside them (the cluster tests). Debian
 * bookworm's kubectl (1.20) is not installed for test/deploy-kubernetes.test.ts: its
 * kustomize cannot read deploy/kubernetes (`labels` needs kustomize >= 4.1), so that test
 * runs where a newer kubectl or kustomize is on PATH and says why it is skipped elsewhere.
 */
import { ensureHostPackages, missingHostPackages } from "./host-apt.ts";

export const HOST_PACKAGES = [
  "util-linux", "procps", "bubblewrap", "qemu-system-x86", "debootstrap", "e2fsprogs", "busybox-static", "cpio", "xz-utils",
  "gcc", "make", "bc", "bison", "flex", "libelf-dev", "libssl-dev", "libc6-dev", "binutils", "perl", "git", "tar", "python3", "socat",
] as const;

/** What the tests use beyond a broker's packages. */
export const TEST_PACKAGES = ["redis-server"] as const;

/** Installs what is missing (nothing to do, and no apt, on a machine that has it all). */
export async function installHostPackages(log: (m: string) => void, o: { tests?: boolean } = { tests: true }): Promise<{ installed: string[] }> {
  const names: string[] = [...HOST_PACKAGES, ...(o.tests ? TEST_PACKAGES : [])];
  const missing = await missingHostPackages(names);
  if (missing.length > 0) await ensureHostPackages(missing, log);
  return { installed: missing };
}
