/**
 * Install build tools from the host's own (bookworm) apt sources.
 *
 * Only packages that are not already installed are requested, so a warm
 * machine never runs apt at all. Another process may hold the dpkg lock
 * (other builders, unattended upgrades), hence the generous lock timeout.
 * Packages from newer suites never go through here: see debian-fetch.ts.
 */
import { spawnSync } from "node:child_process";
import { run } from "./run.ts";

/** Names among `names` that dpkg does not report as installed (one dpkg-query for all of them). */
export async function missingHostPackages(names: readonly string[]): Promise<string[]> {
  if (names.length === 0) return [];
  // dpkg-query exits 1 when it has never heard of one of them, after listing the others.
  const r = spawnSync("dpkg-query", ["-W", "-f=${Package}\t${Status}\n", ...names], { encoding: "utf8" });
  if (r.error) throw new Error(`cannot run dpkg-query (hutch needs a Debian host): ${r.error.message}`);
  const installed = new Set(
    r.stdout
      .split("\n")
      .filter((l) => l.endsWith("install ok installed"))
      .map((l) => l.split("\t")[0]?.split(":")[0]),
  );
  return names.filter((n) => !installed.has(n));
}

/**
 * Make sure the named host packages are installed; runs `apt-get update` and
 * retries once when the host's index is missing or stale.
 */
export async function ensureHostPackages(names: readonly string[], log?: (message: string) => void): Promise<void> {
  const missing = await missingHostPackages(names);
  if (missing.length === 0) return;
  if (process.getuid?.() !== 0) {
    throw new Error(`missing host packages (${missing.join(" ")}); install them as root: apt-get install ${missing.join(" ")}`);
  }
  const install = ["apt-get", "-o", "DPkg::Lock::Timeout=600", "install", "-y", "-q", "--no-install-recommends", ...missing];
  const env = { ...process.env, DEBIAN_FRONTEND: "noninteractive" };
  log?.(`apt: installing host packages ${missing.join(" ")}`);
  try {
    await run(install, { env });
  } catch {
    log?.("apt: install failed, refreshing the host index and retrying");
    await run(["apt-get", "-o", "DPkg::Lock::Timeout=600", "-q", "update"], { env });
    await run(install, { env });
  }
}
