/**
 * What goes into the guest's base tree: the Debian release, the archive and
 * the packages on top of debootstrap's minbase. Part of the base cache key,
 * so editing this file rebuilds the base.
 */

/** The guest userland's Debian release (the host's own; see DEVELOPERS.md). */
export const GUEST_SUITE = "bookworm";
export const GUEST_ARCH = "amd64";
export const GUEST_MIRROR = "http://deb.debian.org/debian";
export const GUEST_SECURITY_MIRROR = "http://deb.debian.org/debian-security";

/**
 * Installed with --no-install-recommends on top of minbase. Several are
 * already in minbase (Essential); they are named so the intent survives a
 * change of variant.
 */
export const GUEST_PACKAGES: readonly string[] = [
  // Tenant toolchain.
  "nodejs", // 18.x in bookworm; the agent bundle targets node18
  "python3",
  "git",
  "make",
  // Package managers and the network tools an agent reaches for (through the agent's proxy:
  // README "Network"); ca-certificates so HTTPS clients have a trust store of their own.
  "npm",
  "python3-pip",
  "python3-venv",
  "curl",
  "ca-certificates",
  // Shell and the usual tools.
  "bash",
  "coreutils",
  "grep",
  "sed",
  "findutils",
  "diffutils",
  "procps", // ps, free, pkill for tenants; the agent reads /proc itself
  "util-linux", // mount, pivot_root, mkswap, swapon, setpriv, blkid for init
  // Runtime plumbing.
  "tini", // PID 1: reaps orphans the tenant leaves behind
  "socat", // the agent's vsock mode relays through it
];

/**
 * dpkg path filters (dpkg.cfg.d) installed before the packages above, so docs,
 * man pages and translations are never unpacked. Copyright files stay: they
 * are tiny and the licences ask for them.
 */
export const DPKG_PATH_FILTERS: readonly string[] = [
  "path-exclude=/usr/share/doc/*",
  "path-include=/usr/share/doc/*/copyright",
  "path-exclude=/usr/share/man/*",
  "path-exclude=/usr/share/info/*",
  "path-exclude=/usr/share/groff/*",
  "path-exclude=/usr/share/lintian/*",
  "path-exclude=/usr/share/linda/*",
  "path-exclude=/usr/share/bug/*",
  "path-exclude=/usr/share/locale/*",
  "path-include=/usr/share/locale/locale.alias",
];

/**
 * Python bytecode optimisation levels compiled into the image. The runtime
 * imports level 0 (no -O, PYTHONOPTIMIZE unset); `python3 -O` would still
 * work, it just could not cache its .opt-1.pyc on the read-only root.
 */
export const PYTHON_OPT_LEVELS: readonly number[] = [0];
