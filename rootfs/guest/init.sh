#!/bin/sh
# hutch guest init: /sbin/init of the agent layer, PID 1 until it execs tini.
#
# The kernel's root (/dev/vda) is hutch's read-only agent layer: this script, a static
# busybox, tini, Node with its own glibc and libraries, the agent bundle and its helpers.
# The template's root filesystem (the user's image) is the second read-only disk. Init:
#   1. proc, sys, devtmpfs; settings from hutch.* kernel parameters
#      (hutch.mode=build hands over to /build.sh: a template build, see there)
#   2. the template's root becomes an overlay: lower = its read-only ext4, upper and
#      work on a tmpfs at /run/hutch/overlay; the agent layer moves to /opt/hutch in it.
#      Every write outside /work and /tmp lands in /run/hutch/overlay/upper, so "the VM
#      is dirty" is exactly "that directory is not empty" (init leaves it empty).
#   3. /work (tenant-owned) and /tmp are their own tmpfs mounts, outside the overlay
#   4. swap on the spare virtio disk, zswap, cgroup v2 (agent / workload)
#   5. loopback up; the template's start command (/etc/hutch/start: the default
#      template imports Python's stdlib once) warms the page cache before the host
#      takes the pristine snapshot
#   6. exec tini, which runs agent-start (the agent in its cgroup; HUTCH_READY)
# Console protocol (lines the host may parse): HUTCH_READY <uptime s>,
# HUTCH_WARN <text>, HUTCH_FAILED <text>, HUTCH_AGENT_EXITED <status>.
#
# POSIX sh (busybox ash, from the agent layer): under TCG every process start costs
# milliseconds, so this script uses builtins wherever it can. Every tool it runs is the
# layer's busybox (/bin here, /opt/hutch/bin after the switch), never the template's.

PATH=/bin
export PATH
umask 022

HUTCH_RUN=/run/hutch
NEWROOT=/newroot
# Where the agent layer is seen from inside the template's root.
LAYER=/opt/hutch
# The template's root filesystem: the second virtio disk (hutch.rootdisk= overrides).
rootdisk=/dev/vdb
TENANT_UID=1000
TENANT_GID=1000

say() { echo "hutch-init: $*"; }
warn() { echo "HUTCH_WARN $*"; }
# PID 1 exiting panics the kernel; with panic=-1 and QEMU's -no-reboot the VM
# then exits, which is how the host learns that a boot failed.
die() {
  echo "HUTCH_FAILED $*"
  exit 1
}
# Progress with the guest uptime, for boot profiling (no subshell: read is a builtin).
mark() {
  read -r up _ < /proc/uptime
  echo "hutch-init: $* at $up s"
}
# Writes a value to a kernel knob; returns non-zero (quietly) if the knob refuses it.
knob() { { printf '%s\n' "$2" > "$1"; } 2>/dev/null; }

# --- 1. kernel filesystems ----------------------------------------------------
[ -e /proc/self ] || mount -n -t proc -o nosuid,nodev,noexec proc /proc || die "cannot mount /proc"
[ -d /sys/kernel ] || mount -n -t sysfs -o nosuid,nodev,noexec sysfs /sys || die "cannot mount /sys"
# What is mounted already: the root device (major:minor, so the swap search
# never picks it) and whether the kernel (DEVTMPFS_MOUNT) or the fallback
# initramfs put devtmpfs on /dev.
rootdev=
devtmpfs=0
while read -r _ _ majmin _ mnt rest; do
  [ "$mnt" = / ] && rootdev=$majmin
  case "$mnt $rest" in "/dev "*" - devtmpfs "*) devtmpfs=1 ;; esac
done < /proc/self/mountinfo
[ "$devtmpfs" = 1 ] || mount -n -t devtmpfs -o nosuid,mode=0755 devtmpfs /dev || die "cannot mount /dev"

# --- settings from the kernel command line (hutch.KEY=VALUE) -------------------
listen=vport:hutch-agent
swap=auto
zswap=1
zswap_compressor=lz4
zswap_zpool=zsmalloc
zswap_max_pool_percent=
# Empty: derived from the VM's memory below (a hutch.* parameter overrides).
pids_max=
nproc=
preload=1
preload_node=0
work_size=
tmp_size=
overlay_size=
agent_log_level=info
debug=0
mode=run
read -r cmdline < /proc/cmdline
for arg in $cmdline; do
  case "$arg" in
    hutch.*=*)
      key=${arg%%=*}
      key=${key#hutch.}
      val=${arg#*=}
      case "$key" in
        listen) listen=$val ;;
        swap) swap=$val ;;
        zswap) zswap=$val ;;
        zswap_compressor) zswap_compressor=$val ;;
        zswap_zpool) zswap_zpool=$val ;;
        zswap_max_pool_percent) zswap_max_pool_percent=$val ;;
        pids_max) pids_max=$val ;;
        nproc) nproc=$val ;;
        preload) preload=$val ;;
        preload_node) preload_node=$val ;;
        work_size) work_size=$val ;;
        tmp_size) tmp_size=$val ;;
        overlay_size) overlay_size=$val ;;
        agent_log_level) agent_log_level=$val ;;
        debug) debug=$val ;;
        mode) mode=$val ;;
        rootdisk) rootdisk=$val ;;
        build_*) ;; # for /build.sh
        *) warn "unknown kernel parameter hutch.$key (ignored)" ;;
      esac
      ;;
  esac
done
[ "$debug" = 1 ] && set -x
mark "starting"
# A template build: no agent, no overlay; /build.sh prepares the target disk and ends the VM.
[ "$mode" = build ] && exec /bin/sh /build.sh

# --- 2. the overlay root -------------------------------------------------------
mount -n -t tmpfs -o "nosuid,nodev,mode=0755${overlay_size:+,size=$overlay_size}" run /run || die "cannot mount /run"
mkdir -p "$HUTCH_RUN/overlay/upper" "$HUTCH_RUN/overlay/work" "$HUTCH_RUN/lower" || die "cannot create $HUTCH_RUN"
# The upper dir stays 0755: it is also the merged root's own inode (its mode is
# what / shows), and it lets an unprivileged exec check dirtiness with a plain
# `ls -A`. Files inside keep their own permissions; overlayfs's work dir is root's.
chmod 0700 "$HUTCH_RUN/overlay/work"
mount -n -t ext4 -o ro "$rootdisk" "$HUTCH_RUN/lower" || die "cannot mount the template's root filesystem $rootdisk"
# What every template root must have (the template build checks it; this catches a
# disk that is not a hutch template at all).
[ -d "$HUTCH_RUN/lower$LAYER" ] || die "$rootdisk is not a hutch template root (no $LAYER mount point)"
mount -n -t overlay overlay \
  -o "lowerdir=$HUTCH_RUN/lower,upperdir=$HUTCH_RUN/overlay/upper,workdir=$HUTCH_RUN/overlay/work,index=off,metacopy=off" \
  "$NEWROOT" || die "cannot mount the overlay root (is overlayfs in the kernel?)"
for m in /proc /sys /dev /run; do
  mount -n --move "$m" "$NEWROOT$m" || die "cannot move $m into the overlay root"
done
cd "$NEWROOT" || die "cannot enter $NEWROOT"
# The agent layer (the current root) becomes /opt/hutch of the template's root, read-only.
pivot_root . "${LAYER#/}" || die "pivot_root into the overlay failed"
cd /
PATH=$LAYER/bin
mark "overlay root ready"

# --- 3. writable places outside the overlay, and the rest of /dev ----------------
mount -n -t tmpfs -o "nosuid,nodev,mode=1777${tmp_size:+,size=$tmp_size}" tmp /tmp || die "cannot mount /tmp"
mount -n -t tmpfs -o "nosuid,nodev,mode=0755,uid=$TENANT_UID,gid=$TENANT_GID${work_size:+,size=$work_size}" work /work || die "cannot mount /work"
mkdir -p /dev/pts /dev/shm
mount -n -t devpts -o nosuid,noexec,gid=5,mode=0620,ptmxmode=0666 devpts /dev/pts || warn "no devpts: ptys unavailable"
mount -n -t tmpfs -o nosuid,nodev,mode=1777 shm /dev/shm || warn "no /dev/shm"
# devtmpfs has no /dev/fd: bash process substitution and many tools need it.
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd
[ -e /dev/stdin ] || ln -s /proc/self/fd/0 /dev/stdin
[ -e /dev/stdout ] || ln -s /proc/self/fd/1 /dev/stdout
[ -e /dev/stderr ] || ln -s /proc/self/fd/2 /dev/stderr
# The agent's channel is root's alone (devtmpfs creates it 0600; make sure).
for p in /dev/vport*; do [ -c "$p" ] && chmod 0600 "$p"; done
knob /proc/sys/kernel/hostname hutch

mark "mounts ready"

# --- 4. memory: swap, zswap; cgroups -------------------------------------------
swapdev=
case "$swap" in
  off | 0 | none) ;;
  auto)
    # The first writable virtio disk that is not the root: a per-VM sparse file the host attaches.
    for b in /sys/block/vd*; do
      [ -e "$b/dev" ] || continue
      read -r devnum < "$b/dev"
      read -r ro < "$b/ro"
      if [ "$devnum" != "$rootdev" ] && [ "$ro" = 0 ]; then
        swapdev=/dev/${b##*/}
        break
      fi
    done
    ;;
  /dev/*) swapdev=$swap ;;
  *) warn "hutch.swap=$swap: expected auto, off or /dev/NAME" ;;
esac
if [ -n "$swapdev" ]; then
  # A swap signature sits in the last 10 bytes of the first 4 KiB page.
  kind=
  [ "$(dd if="$swapdev" bs=1 skip=4086 count=10 2>/dev/null)" = SWAPSPACE2 ] && kind=swap
  if [ -z "$kind" ] && cmp -s -n 1048576 "$swapdev" /dev/zero; then
    # A fresh (all-zero) disk: format it. Anything else non-swap is left alone.
    mkswap -L hutch-swap "$swapdev" > /dev/null && kind=swap
  fi
  if [ "$kind" = swap ]; then
    swapon "$swapdev" || warn "swapon $swapdev failed"
  else
    warn "$swapdev holds ${kind:-data} (not swap, not blank): not using it as swap"
  fi
fi
zs=/sys/module/zswap/parameters
if [ "$zswap" = 1 ] && [ -d "$zs" ]; then
  # lz4 only if the kernel has it (built in: no modules in this root); else keep the default (lzo).
  # Not a warning: lz4 is a nice-to-have; the zswap line below says what is in use.
  knob "$zs/compressor" "$zswap_compressor" || say "zswap: compressor $zswap_compressor not in this kernel"
  knob "$zs/zpool" "$zswap_zpool" || warn "zswap zpool $zswap_zpool unavailable, keeping $(cat "$zs/zpool")"
  [ -n "$zswap_max_pool_percent" ] && knob "$zs/max_pool_percent" "$zswap_max_pool_percent"
  knob "$zs/enabled" Y || warn "cannot enable zswap"
  read -r z_on < "$zs/enabled"
  read -r z_comp < "$zs/compressor"
  read -r z_pool < "$zs/zpool"
  say "zswap enabled=$z_on compressor=$z_comp zpool=$z_pool; swap ${swapdev:-none}"
elif [ "$zswap" = 1 ]; then
  warn "kernel has no zswap"
else
  knob "$zs/enabled" N
fi

cg=/sys/fs/cgroup
mount -n -t cgroup2 -o nosuid,nodev,noexec,nsdelegate,memory_recursiveprot cgroup2 "$cg" || die "cannot mount cgroup2 at $cg"
read -r available < "$cg/cgroup.controllers"
enable=
for c in memory pids cpu; do
  case " $available " in *" $c "*) enable="$enable +$c" ;; *) warn "cgroup controller $c missing from the kernel" ;; esac
done
[ -n "$enable" ] && { knob "$cg/cgroup.subtree_control" "${enable# }" || warn "cannot enable cgroup controllers:$enable"; }
mkdir -p "$cg/agent" "$cg/workload" || die "cannot create cgroups"
# Workload limits come from this VM's size, so a fork bomb or a memory hog exhausts only
# its own cgroup and the agent always has room to answer (with a typed error, and the
# next call works). The agent keeps a reserve the workload cannot take: a quarter of RAM,
# at least 128 MiB (kernel, page tables, the agent's Node heap). memory.high throttles
# and reclaims before memory.max OOM-kills inside the workload; swap is bounded too, or a
# hog would first push the whole VM through zswap/swap. Processes: one per 512 KiB of
# RAM (each costs kernel stack, page tables and a little private memory), 64..4096.
mem_kb=
while read -r k v _; do
  [ "$k" = MemTotal: ] && { mem_kb=$v; break; }
done < /proc/meminfo
if [ -n "$mem_kb" ]; then
  reserve_kb=$((mem_kb / 4))
  [ "$reserve_kb" -lt 131072 ] && reserve_kb=131072
  work_kb=$((mem_kb - reserve_kb))
  [ "$work_kb" -lt 65536 ] && work_kb=65536
  derived_pids=$((mem_kb / 512))
  [ "$derived_pids" -lt 64 ] && derived_pids=64
  [ "$derived_pids" -gt 4096 ] && derived_pids=4096
else
  warn "no MemTotal in /proc/meminfo: workload memory is not limited"
  derived_pids=1024
fi
[ -n "$pids_max" ] || pids_max=$derived_pids
[ -n "$nproc" ] || nproc=$pids_max
[ -e "$cg/workload/pids.max" ] && { knob "$cg/workload/pids.max" "$pids_max" || warn "cannot set workload pids.max"; }
if [ -n "$work_kb" ] && [ -e "$cg/workload/memory.max" ]; then
  knob "$cg/workload/memory.high" "$((work_kb * 7 / 8 * 1024))" || warn "cannot set workload memory.high"
  knob "$cg/workload/memory.max" "$((work_kb * 1024))" || warn "cannot set workload memory.max"
  [ -e "$cg/workload/memory.swap.max" ] && { knob "$cg/workload/memory.swap.max" "$((work_kb / 2 * 1024))" || warn "cannot set workload memory.swap.max"; }
  # The agent's own pages are protected from the reclaim the workload causes.
  [ -e "$cg/agent/memory.min" ] && knob "$cg/agent/memory.min" $((64 * 1024 * 1024))
  say "workload limits: memory.max=$((work_kb / 1024))M pids.max=$pids_max (VM $((mem_kb / 1024))M)"
fi
# The agent relays every byte of output: it wins CPU contention against tenant commands.
[ -e "$cg/agent/cpu.weight" ] && knob "$cg/agent/cpu.weight" 1000

mark "swap, zswap and cgroups ready"

# --- 5. network, warm caches ----------------------------------------------------
# Loopback only (no NIC in the hutch kernel): test suites and dev servers bind 127.0.0.1.
ip link set lo up || warn "cannot bring up loopback"
# The template's start command (written by the template build): warms what its users
# will run, so every VM restored from the pristine snapshot inherits a warm page cache.
# Run as root in the template's user space, with its environment; whatever it writes
# outside /tmp lands in the overlay (and is reported below: a dirty fresh VM).
if [ -r /etc/hutch/start ]; then
  (
    # The template's own PATH and tools from here on; the layer's busybox last.
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$LAYER/bin
    HOME=/root
    export HOME HUTCH_PRELOAD="$preload"
    if [ -r /etc/hutch/env ]; then
      while IFS= read -r kv; do case "$kv" in *=*) export "$kv" ;; esac; done < /etc/hutch/env
    fi
    wd=/
    [ -r /etc/hutch/workdir ] && read -r wd < /etc/hutch/workdir
    cd "$wd" 2>/dev/null || cd /
    exec /bin/sh /etc/hutch/start
  ) || warn "the template's start command failed (status $?)"
fi
mark "start command done"
if [ "$preload_node" = 1 ]; then
  $LAYER/bin/node -e 0 || warn "node -e 0 failed"
  mark "node warm-up done"
fi

# --- 6. hand over --------------------------------------------------------------
# Init must leave the overlay upper empty: anything there now would make every
# VM look dirty. Report it loudly instead of hiding it.
for f in "$HUTCH_RUN"/overlay/upper/* "$HUTCH_RUN"/overlay/upper/.[!.]*; do
  [ -e "$f" ] || [ -L "$f" ] || continue
  warn "overlay upper is not empty at boot: ${f#"$HUTCH_RUN"/overlay/upper}"
done
(
  umask 077
  {
    echo "listen=$listen"
    echo "nproc=$nproc"
    echo "agent_log_level=$agent_log_level"
    echo "swap=$swapdev"
  } > "$HUTCH_RUN/settings"
)
mark "handing over to tini"
exec $LAYER/bin/tini -- $LAYER/bin/sh $LAYER/agent-start.sh
die "cannot exec tini"
