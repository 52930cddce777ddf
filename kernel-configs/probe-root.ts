/**
 * A tiny busybox root whose init inspects the running kernel and reports,
 * for kernel tests and the boot probe (boot-probe.ts). Not the hutch rootfs:
 * just enough userland to prove what a kernel can do from inside a guest.
 *
 * The init prints `hutch-probe: init` as its first line (the host's boot
 * timer stops there), runs the checks, writes one JSON line prefixed with
 * `hutch-probe-result ` to the console and to the virtio-serial port named
 * `agent` (found via /sys/class/virtio-ports/* /name, as the real agent does),
 * then reboots (QEMU runs with -no-reboot, so the VM exits).
 */
import { chmod, copyFile, mkdir, rm, symlink, writeFile } from "node:fs/promises";
import path from "node:path";
import { ensureStaticBusybox } from "../build/busybox.ts";
import { ensureHostPackages } from "../build/host-apt.ts";
import { capture, run } from "../build/run.ts";

export const PROBE_MARKER_INIT = "hutch-probe: init";
export const PROBE_RESULT_PREFIX = "hutch-probe-result ";

/** The checks, as shell: each `check NAME CMD...` records ok/fail plus a value. */
const PROBE_INIT = String.raw`#!/bin/sh
# hutch kernel probe init: reports what the running kernel provides.
export PATH=/bin:/sbin
echo "${PROBE_MARKER_INIT} uptime=$(cut -d' ' -f1 /proc/uptime 2>/dev/null)"
mkdir -p /proc /sys /dev /tmp /run
mount -t proc proc /proc 2>/dev/null
mount -t sysfs sysfs /sys 2>/dev/null
# devtmpfs is automounted on a disk root (DEVTMPFS_MOUNT) but not in an initramfs.
grep -q "^devtmpfs /dev " /proc/mounts || mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
UPTIME_INIT=$(cut -d' ' -f1 /proc/uptime)
OUT=""
add() { OUT="$OUT\"$1\":\"$(echo "$2" | tr -d '"\\\n' | cut -c1-200)\","; }
flag() { if eval "$2" >/dev/null 2>&1; then add "$1" yes; else add "$1" no; fi; }

add kernel "$(uname -r)"
add uptime_at_init "$UPTIME_INIT"
add clocksource "$(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>/dev/null)"
add timer_log "$(dmesg | grep -E 'tsc:|Switched to clocksource|APIC timer|Calibrating delay' | cut -c16- | tr '\n' ';')"
# Quick mode (boot-time loops): report the boot, skip the slow checks.
if grep -q "hutch.probe=quick" /proc/cmdline; then
  echo "${PROBE_RESULT_PREFIX}{$(echo "$OUT" | sed 's/,$//')}"
  reboot -f
fi
add cmdline "$(cat /proc/cmdline)"
add cpus "$(grep -c ^processor /proc/cpuinfo)"
flag page_idle_bitmap "test -e /sys/kernel/mm/page_idle/bitmap"
flag damon_reclaim_params "test -d /sys/module/damon_reclaim/parameters"
add zswap_enabled "$(cat /sys/module/zswap/parameters/enabled 2>/dev/null)"
add zswap_zpool "$(cat /sys/module/zswap/parameters/zpool 2>/dev/null)"
add zswap_compressor "$(cat /sys/module/zswap/parameters/compressor 2>/dev/null)"
add lru_gen_enabled "$(cat /sys/kernel/mm/lru_gen/enabled 2>/dev/null)"
flag pagemap "test -e /proc/self/pagemap"
flag psi "test -e /proc/pressure/memory"
flag vsock_dev "test -e /dev/vsock"
flag userfaultfd_dev "test -e /dev/userfaultfd || grep -q userfaultfd /proc/kallsyms"
add hwrng "$(cat /sys/class/misc/hw_random/rng_current 2>/dev/null)"
flag balloon "ls /sys/bus/virtio/drivers/virtio_balloon/ 2>/dev/null | grep -q virtio"
mkdir -p /sys/fs/cgroup
if mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null; then
  add cgroup2 yes
  add cgroup_controllers "$(cat /sys/fs/cgroup/cgroup.controllers)"
else
  add cgroup2 no
fi
PORTNAMES=""
for n in /sys/class/virtio-ports/*/name; do [ -e "$n" ] && PORTNAMES="$PORTNAMES$(cat "$n") "; done
add virtio_ports "$PORTNAMES"
if [ -e /proc/config.gz ]; then
  CFG=$(zcat /proc/config.gz)
  for o in EPOLL EVENTFD SIGNALFD TIMERFD INOTIFY_USER FUTEX POSIX_TIMERS UNIX; do
    echo "$CFG" | grep -q "^CONFIG_$o=y" && add "config_$o" yes || add "config_$o" no
  done
else
  add config_gz no
fi
# zswap for real: fill tmpfs, reclaim, and look for compressed pages.
if [ -b /dev/vdb ] && mkswap /dev/vdb >/dev/null 2>&1 && swapon /dev/vdb 2>/dev/null; then
  add swap yes
  seq 1 1000000 > /tmp/fill
  if [ -e /sys/fs/cgroup/memory.reclaim ]; then echo 8M > /sys/fs/cgroup/memory.reclaim 2>/dev/null; fi
  add zswapped_kb "$(grep '^Zswapped:' /proc/meminfo | tr -s ' ' | cut -d' ' -f2)"
  add swap_used_kb "$(free | grep Swap: | tr -s ' ' | cut -d' ' -f3)"
  rm -f /tmp/fill
fi
for m in /proc/modules; do [ -e $m ] && add modules "$(cut -d' ' -f1 /proc/modules | tr '\n' ' ')"; done
add uptime_done "$(cut -d' ' -f1 /proc/uptime)"
JSON="{$(echo "$OUT" | sed 's/,$//')}"
echo "${PROBE_RESULT_PREFIX}$JSON"
for n in /sys/class/virtio-ports/*/name; do
  [ -e "$n" ] || continue
  if [ "$(cat "$n")" = agent ]; then
    dev=/dev/$(basename "$(dirname "$n")")
    echo "${PROBE_RESULT_PREFIX}$JSON" > "$dev"
  fi
done
sync
reboot -f
sleep 5
`;

/**
 * Symlink every applet to /bin/busybox (relative to the guest's root, not the
 * host path `busybox --install` would write).
 */
export async function installBusyboxLinks(root: string): Promise<void> {
  const applets = (await capture([path.join(root, "bin/busybox"), "--list-full"])).split("\n").filter(Boolean);
  for (const rel of applets) {
    const target = path.join(root, rel);
    if (rel === "bin/busybox") continue;
    await mkdir(path.dirname(target), { recursive: true });
    await rm(target, { force: true });
    await symlink("/bin/busybox", target);
  }
}

/**
 * Lay out the probe root in `dir` (replacing it): busybox with its applet
 * links, /dev/console for the initramfs case, the init at /init and
 * /sbin/init so one tree serves as initramfs or ext4 root.
 */
export async function makeProbeRoot(dir: string, log?: (m: string) => void): Promise<void> {
  await ensureHostPackages(["cpio", "e2fsprogs"], log);
  const busybox = await ensureStaticBusybox(log);
  await rm(dir, { recursive: true, force: true });
  for (const d of ["bin", "sbin", "dev", "proc", "sys", "tmp", "run", "etc", "mnt"]) await mkdir(path.join(dir, d), { recursive: true });
  await copyFile(busybox, path.join(dir, "bin/busybox"));
  await chmod(path.join(dir, "bin/busybox"), 0o755);
  await installBusyboxLinks(dir);
  // Console for the initramfs case (the kernel opens /dev/console before init runs, and devtmpfs is not mounted there yet).
  await run(["mknod", "-m", "600", path.join(dir, "dev/console"), "c", "5", "1"]);
  await run(["mknod", "-m", "666", path.join(dir, "dev/null"), "c", "1", "3"]);
  for (const p of ["init", "sbin/init"]) {
    // sbin/init is a busybox applet link to the absolute /bin/busybox: writing
    // through it would overwrite the host's busybox. Replace the link instead.
    await rm(path.join(dir, p), { force: true });
    await writeFile(path.join(dir, p), PROBE_INIT, { mode: 0o755, flag: "wx" });
  }
}
