/**
 * A static busybox binary for tiny guest userlands (test roots, initramfs).
 *
 * Taken from Debian's busybox-static package through debian-fetch (unpacked,
 * never installed): installing busybox-static on the host would replace the
 * host's own busybox package.
 */
import { chmod, copyFile, mkdtemp, rm } from "node:fs/promises";
import path from "node:path";
import { cacheDir, exists } from "./cache.ts";
import { extractDeb, fetchDebianPackages } from "./debian-fetch.ts";

/** Suite the busybox comes from: the host's own release, so it matches what the host could run. */
export const BUSYBOX_SUITE = "bookworm";

/** Path to a cached static busybox (x86_64), fetched on first use. */
export async function ensureStaticBusybox(log?: (message: string) => void): Promise<string> {
  const [pkg] = await fetchDebianPackages({ suite: BUSYBOX_SUITE, log }, ["busybox-static"]);
  if (!pkg) throw new Error(`busybox-static not found in Debian ${BUSYBOX_SUITE}`);
  const dir = await cacheDir("busybox", pkg.version.replace(/[^A-Za-z0-9.+~-]/g, "_"));
  const bin = path.join(dir, "busybox");
  if (await exists(bin)) return bin;
  const tmp = await mkdtemp(path.join(dir, ".x-"));
  try {
    await extractDeb(pkg.path, tmp);
    const candidates = ["bin/busybox", "usr/bin/busybox"].map((p) => path.join(tmp, p));
    let found: string | undefined;
    for (const c of candidates) if (await exists(c)) found = c;
    if (!found) throw new Error(`${pkg.path} has no busybox binary in /bin or /usr/bin`);
    await copyFile(found, `${bin}.tmp`);
    await chmod(`${bin}.tmp`, 0o755);
    await rm(bin, { force: true });
    await copyFile(`${bin}.tmp`, bin);
    await chmod(bin, 0o755);
    await rm(`${bin}.tmp`, { force: true });
  } finally {
    await rm(tmp, { recursive: true, force: true });
  }
  return bin;
}
