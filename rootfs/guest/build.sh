#!/bin/sh
# hutch template build, inside a microVM (init.sh hands over here for hutch.mode=build).
#
# A template's source and its --run steps are not trusted, so nothing of them is ever
# unpacked or run on the host: the host attaches them as disks of a throwaway VM and
# this script, running from the read-only agent layer (busybox), turns them into the
# template's root filesystem on the target disk. Whatever a tarball holds (setuid files,
# device nodes, absolute or ../ names, links to "host" files) or a step does lands in
# this VM and on the target disk, which the host only ever attaches to later VMs as a
# read-only disk (it never mounts it).
#
# Disks: /dev/vda this layer (root, read-only); /dev/vdb the input (read-only): the build
# spec (a tar: spec, steps/N, start, env, workdir; hutch.build_spec_bytes= long) at offset
# 0, then the source's layers, each at a MiB-aligned offset the spec names; /dev/vdc the
# target (an empty ext4 the host made, writable). One input disk, not one per layer:
# QEMU's microvm has 8 virtio-mmio slots in all.
# Console lines for the host: "hutch-build: <progress>", "HUTCH_BUILD_STEP <n> <text>",
# and one of HUTCH_BUILD_OK / HUTCH_BUILD_REFUSED <missing,...> / HUTCH_BUILD_FAILED <why>.

PATH=/bin
export PATH
umask 022
T=/run/target
S=/run/spec

say() { echo "hutch-build: $*"; }
# The VM ends either way; the host reads the verdict from the console.
finish() {
  sync
  cd /
  umount -l "$T/opt/hutch" "$T/proc" "$T/sys" "$T/dev" "$T/tmp" 2>/dev/null
  umount "$T" 2>/dev/null || { sync; umount -l "$T"; }
  sync
  echo "$1"
  # No ACPI: "power off" would only halt. A reboot ends QEMU (-no-reboot); so does PID 1 exiting.
  reboot -f
  exit 1
}
fail() { finish "HUTCH_BUILD_FAILED $*"; }

mount -n -t tmpfs -o mode=0755 run /run || fail "cannot mount /run"
mkdir -p "$T" "$S"
IN=/dev/vdb
mount -n -t ext4 /dev/vdc "$T" || fail "cannot mount the target disk"
spec_bytes=
egress=
read -r cmdline < /proc/cmdline
for arg in $cmdline; do
  case "$arg" in
    hutch.build_spec_bytes=*) spec_bytes=${arg#*=} ;;
    hutch.build_egress=*) egress=${arg#*=} ;;
  esac
done
case "$spec_bytes" in *[!0-9]* | '') fail "no hutch.build_spec_bytes= on the command line" ;; esac
# The network --run steps get: a NIC whose only peer is hutch's egress proxy (QEMU user
# networking with restrict=on: no DNS, no host loopback, no direct connection). Steps reach
# it as an HTTP/HTTPS proxy; the host decides where each connection may go.
proxy=
if [ -n "$egress" ]; then
  case "$egress" in 10.0.2.*:*) ;; *) fail "bad hutch.build_egress=$egress" ;; esac
  case "$egress" in *[!0-9.:]*) fail "bad hutch.build_egress=$egress" ;; esac
  ip link set lo up 2>/dev/null
  { ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0; } || fail "cannot bring up the build VM's network"
  proxy="http://$egress"
fi
head -c "$spec_bytes" "$IN" | tar -xf - -C "$S" || fail "cannot read the build spec"
[ -r "$S/spec" ] || fail "no build spec"
# A layer's bytes: MiB-aligned offset, exact length.
layer_bytes() { dd if="$IN" bs=1048576 skip=$(($1 / 1048576)) 2>/dev/null | head -c "$2"; }

# --- 1. the source's layers, in order -------------------------------------------
# spec lines: "layer OFFSET BYTES COMPRESSION WHITEOUTS" (compression: none|gzip;
# WHITEOUTS=oci applies .wh. entries: OCI image layers).
n=0
while read -r kind offset bytes comp wh; do
  [ "$kind" = layer ] || continue
  n=$((n + 1))
  case "$offset$bytes" in *[!0-9]* | '') fail "bad layer offset/size $offset $bytes" ;; esac
  [ $((offset % 1048576)) = 0 ] || fail "layer offset $offset is not MiB-aligned"
  z=
  case "$comp" in gzip) z=z ;; none) ;; *) fail "layer compression $comp is not supported" ;; esac
  say "unpacking layer $n ($bytes bytes${z:+, gzip})"
  if [ "$wh" = oci ]; then
    # Whiteouts delete what lower layers left: ".wh.NAME" removes NAME, ".wh..wh..opq"
    # empties its directory. Names with ".." are refused (they could only reach outside
    # the target inside this VM, but a template has no business with them).
    layer_bytes "$offset" "$bytes" | tar -t${z}f - > /run/entries || fail "layer $n is not a readable tar"
    while IFS= read -r e; do
      e=${e#./}
      case "$e" in *..*) fail "layer $n: entry name with '..': $e" ;; esac
      base=${e##*/}
      dir=
      case "$e" in */*) dir=${e%/*} ;; esac
      case "$base" in
        .wh..wh..opq) [ -d "$T/$dir" ] && find "$T/$dir" -mindepth 1 -maxdepth 1 -exec rm -rf {} + ;;
        .wh.*) rm -rf "$T/${dir:+$dir/}${base#.wh.}" ;;
      esac
    done < /run/entries
  fi
  layer_bytes "$offset" "$bytes" | tar -x${z}f - -C "$T" 2> /run/tar.err || {
    # tar's own words reach the host (the first few), then the verdict.
    head -n 5 /run/tar.err | while IFS= read -r l; do say "tar: $l"; done
    fail "layer $n could not be unpacked: $(head -n 1 /run/tar.err)"
  }
  [ "$wh" = oci ] && find "$T" -xdev -name '.wh.*' -exec rm -rf {} +
done < "$S/spec"
[ "$n" -gt 0 ] || fail "the build spec names no layer"

# --- 2. hutch's part of the root: mount points, tenant user, template settings --------
for d in work tmp run proc sys dev opt/hutch etc/hutch home; do
  [ -L "$T/$d" ] && rm -f "$T/$d"
  mkdir -p "$T/$d" || fail "cannot create /$d in the image"
done
chmod 1777 "$T/tmp"
chown 1000:1000 "$T/work"
# The agent layer, for the checks and the steps below: static busybox runs on any root.
mount -n --bind / "$T/opt/hutch" || fail "cannot bind the agent layer"
mount -n -o remount,bind,ro "$T/opt/hutch"
BB=/opt/hutch/bin/busybox
# The layer's busybox tools first: the image may lack grep, cat and the rest.
inroot() { chroot "$T" $BB sh -c "PATH=/opt/hutch/bin; $1"; }

# The tenant user (uid/gid 1000, /home/tenant): whatever held uid 1000 or the name
# "tenant" is replaced, so the agent's --run-as 1000:1000 is always this user.
inroot '
  set -e
  cd /etc
  for f in passwd group shadow gshadow; do [ -e $f ] || : > $f; done
  grep -q "^root:" passwd || echo "root:x:0:0:root:/root:/bin/sh" >> passwd
  grep -q "^root:" group || echo "root:x:0:" >> group
  grep -v -e "^tenant:" -e "^[^:]*:[^:]*:1000:" passwd > passwd.new || true
  grep -v -e "^tenant:" -e "^[^:]*:[^:]*:1000:" group > group.new || true
  grep -v "^tenant:" shadow > shadow.new || true
  grep -v "^tenant:" gshadow > gshadow.new || true
  shell=/bin/sh; [ -x /bin/bash ] && shell=/bin/bash
  echo "tenant:x:1000:1000:hutch tenant:/home/tenant:$shell" >> passwd.new
  echo "tenant:x:1000:" >> group.new
  echo "tenant:!:19723:0:99999:7:::" >> shadow.new
  echo "tenant:!::" >> gshadow.new
  for f in passwd group shadow gshadow; do cat $f.new > $f; rm -f $f.new; done
  chmod 0640 shadow gshadow
  mkdir -p /home/tenant
  [ -d /etc/skel ] && cp -a /etc/skel/. /home/tenant/ 2>/dev/null
  chown -R 1000:1000 /home/tenant
  chmod 0755 /home/tenant
  echo hutch > /etc/hostname
  printf "127.0.0.1\tlocalhost hutch\n::1\t\tlocalhost ip6-localhost ip6-loopback\n" > /etc/hosts
' || fail "cannot set up the tenant user"
rm -f "$T/etc/hutch/start" "$T/etc/hutch/env" "$T/etc/hutch/workdir"
for f in start env workdir; do
  [ -r "$S/$f" ] && cat "$S/$f" > "$T/etc/hutch/$f"
done

# --- 3. --run steps, as root in the image (network: only through the egress proxy) ------
[ -n "$proxy" ] && say "network: --run steps go out through hutch's egress proxy ($proxy as http_proxy and https_proxy; no DNS or direct connections)"

wd=/
[ -r "$S/workdir" ] && read -r wd < "$S/workdir"
i=0
while [ -r "$S/steps/$((i + 1))" ]; do
  i=$((i + 1))
  echo "HUTCH_BUILD_STEP $i $(head -c 200 "$S/steps/$i" | tr '\n' ' ')"
  mount -n -t proc proc "$T/proc" && mount -n --rbind /dev "$T/dev" && mount -n -t sysfs sys "$T/sys" &&
    mount -n -t tmpfs -o mode=1777 tmp "$T/tmp" || fail "cannot mount /proc, /dev, /sys, /tmp for step $i"
  cp "$S/steps/$i" "$T/tmp/.hutch-step"
  [ -r "$S/env" ] && cp "$S/env" "$T/tmp/.hutch-env"
  # Unquoted on purpose: no proxy, no words; the values hold no spaces.
  chroot "$T" $BB env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    ${proxy:+http_proxy=$proxy https_proxy=$proxy HTTP_PROXY=$proxy HTTPS_PROXY=$proxy no_proxy=localhost,127.0.0.1 NO_PROXY=localhost,127.0.0.1} \
    $BB sh -c 'if [ -r /tmp/.hutch-env ]; then while IFS= read -r kv; do case "$kv" in *=*) export "$kv" ;; esac; done < /tmp/.hutch-env; fi; cd "$1" || exit 1; exec /bin/sh /tmp/.hutch-step' sh "$wd" < /dev/null 2>&1
  status=$?
  umount -l "$T/tmp" "$T/sys" "$T/dev" "$T/proc"
  [ "$status" = 0 ] || fail "step $i exited with status $status"
done

# --- 4. what every template root must provide ---------------------------------------
missing=
inroot '[ -x /bin/sh ]' || missing="$missing,/bin/sh"
# glibc's x86-64 dynamic loader: the interpreter of every glibc program (musl roots lack it).
inroot '[ -e /lib64/ld-linux-x86-64.so.2 ]' || missing="$missing,glibc (/lib64/ld-linux-x86-64.so.2)"
# The agent runs `command` strings with bash.
inroot '[ -x /bin/bash ] || [ -x /usr/bin/bash ]' || missing="$missing,bash"
[ -z "$missing" ] && { chroot "$T" /bin/sh -c 'exit 0' < /dev/null || missing="$missing,a working /bin/sh"; }
[ -n "$missing" ] && finish "HUTCH_BUILD_REFUSED ${missing#,}"
say "root filesystem: /bin/sh, glibc, bash present"
finish HUTCH_BUILD_OK
