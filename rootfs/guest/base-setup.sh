#!/bin/sh
# Runs once inside a fresh debootstrap minbase tree (chroot, as root), called by
# rootfs/base.ts with the package list as arguments. Environment:
#   HUTCH_SUITE, HUTCH_MIRROR, HUTCH_SECURITY_MIRROR, HUTCH_PYC_OPT_LEVELS
# The dpkg path filters (/etc/dpkg/dpkg.cfg.d/90-hutch-nodoc) are already in
# place, and so is a build-only force-unsafe-io that base.ts removes afterwards.
set -eu

say() { printf 'base-setup: %s\n' "$*"; }

# Point release + security updates: the guest runs untrusted code, so it gets
# the fixed nodejs/python3/git, not the bookworm point-zero versions.
cat > /etc/apt/sources.list <<EOF
deb $HUTCH_MIRROR $HUTCH_SUITE main
deb $HUTCH_MIRROR $HUTCH_SUITE-updates main
deb $HUTCH_SECURITY_MIRROR $HUTCH_SUITE-security main
EOF
cat > /etc/apt/apt.conf.d/90-hutch <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
EOF
# Nothing may start services inside the build chroot.
printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
chmod 755 /usr/sbin/policy-rc.d

say "apt-get update"
apt-get -q update
say "upgrading minbase to $HUTCH_SUITE-updates/-security"
apt-get -q -y -o Dpkg::Options::=--force-confold dist-upgrade
say "installing: $*"
apt-get -q -y -o Dpkg::Options::=--force-confold install "$@"

say "trimming"
rm -f /usr/sbin/policy-rc.d
# The downloaded .debs stay in /var/cache/apt/archives: base.ts keeps them for the next build, then removes them.
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/partial/*
# Packages unpacked by debootstrap itself predate the dpkg filters: apply them by hand.
find /usr/share/doc -mindepth 1 ! -type d ! -name copyright -delete
find /usr/share/doc -mindepth 1 -type d -empty -delete
for d in man info groff lintian linda bug; do
  if [ -d "/usr/share/$d" ]; then find "/usr/share/$d" -mindepth 1 -delete; fi
done
if [ -d /usr/share/locale ]; then
  find /usr/share/locale -mindepth 1 ! -name locale.alias -delete 2>/dev/null || true
fi
# Logs, backups and caches that only record when this tree was built.
find /var/log -type f -delete
rm -f /var/cache/debconf/*-old /var/lib/dpkg/*-old /var/cache/ldconfig/aux-cache
rm -f /etc/resolv.conf /etc/hostname
rm -rf /tmp/* /var/tmp/* /root/.cache
# No init system here: an empty machine-id (nothing reads it; keeps the tree identical between builds).
: > /etc/machine-id

# The root is read-only at run time (writes land in a tmpfs overlay that marks
# the VM dirty), so Python must never need to write bytecode: compile the
# stdlib now. unchecked-hash pycs are never compared with their sources, so
# file timestamps do not matter and imports skip a stat per module.
say "compiling Python bytecode (levels: $HUTCH_PYC_OPT_LEVELS)"
find /usr/lib/python3* -name __pycache__ -type d -prune -exec rm -rf {} +
levels=""
for l in $HUTCH_PYC_OPT_LEVELS; do levels="$levels -o $l"; done
# Everything, test.support included (some suites import it); lib2to3's test data, when
# present, is deliberately invalid Python.
dirs=""
for d in /usr/lib/python3.11 /usr/lib/python3/dist-packages; do
  if [ -d "$d" ]; then dirs="$dirs $d"; fi
done
# shellcheck disable=SC2086
PYTHONHASHSEED=0 python3 -m compileall -q -f -j 1 $levels --invalidation-mode unchecked-hash \
  -x '/lib2to3/tests/data/' $dirs

say "installed packages: $(dpkg-query -W -f '.\n' | wc -l)"
