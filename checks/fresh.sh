#!/usr/bin/env bash
# Rehearsal of a brand-new machine (issue 10, docs/testing.md): builds a
# clean Debian 12 tree (debootstrap minbase, nothing else), copies in a clean
# clone of this checkout's HEAD and the host's Go toolchain (/usr/local/go)
# and nothing else, and runs the README's test command in it, exactly as
# written, as root under systemd-nspawn:
#
#   cd /root/nixcage && bash checks/test.sh
#
# so checks/deps.sh must install every package from apt there, Go must fetch
# every module, the system tests must build their own machine tree. Then it
# prints which tiers ran. Run as root on Debian 12:
#
#   bash checks/fresh.sh [--keep]      # --keep leaves the tree for inspection
#
# The base tree is cached in /var/cache/nixcage-fresh (NIXCAGE_FRESH_CACHE);
# every run works on a new copy of it, so each run starts cold. Takes about
# 10 minutes; not part of .ci/run (see docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/local/go/bin:/usr/sbin:/sbin

keep=
for a in "$@"; do
  case $a in
    --keep) keep=1 ;;
    *) echo "usage: bash checks/fresh.sh [--keep]" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "checks/fresh.sh: run as root (debootstrap, systemd-nspawn)" >&2; exit 1; }
[ -x /usr/local/go/bin/go ] || { echo "checks/fresh.sh: needs the Go toolchain in /usr/local/go (it is copied into the tree)" >&2; exit 1; }
git rev-parse --verify -q HEAD >/dev/null || { echo "checks/fresh.sh: run from a git checkout (HEAD is cloned into the tree)" >&2; exit 1; }

# The host's tools for building and entering the tree; the tree gets none of them.
need=()
for p in debootstrap systemd-container git; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
  echo "checks/fresh.sh: installing ${need[*]} on the host"
  DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
fi

# Mirror and proxy as apt on this host has them, as internal/systest does, so
# the tree's apt reaches Debian the same way the host's does.
mapfile -t lines < <(go run ./internal/systest/mirror)
mirror=${lines[0]}
proxy_env=("${lines[@]:1}")

cache=${NIXCAGE_FRESH_CACHE:-/var/cache/nixcage-fresh}
base=$cache/bookworm-minbase-$(printf '%s' "$mirror" | sha256sum | cut -c1-12)
mkdir -p "$cache"
exec 9>"$cache/lock"
flock 9
if [ ! -e "$base/.complete" ]; then
  rm -rf "$cache"/building-*
  tmp=$(mktemp -d "$cache/building-XXXXXX")
  echo "checks/fresh.sh: debootstrap --variant=minbase bookworm from $mirror (cached in $base)"
  env "${proxy_env[@]}" debootstrap --variant=minbase bookworm "$tmp" "$mirror" >"$tmp.log" 2>&1 ||
    { tail -20 "$tmp.log"; echo "checks/fresh.sh: debootstrap failed" >&2; exit 1; }
  # A fresh machine's apt sources: the suite, its updates and security, from
  # the host's mirror; the host's apt settings that make the mirror usable
  # (proxy, snapshot validity) come along, nothing else of the host.
  sec=${mirror%/debian}/debian-security
  cat >"$tmp/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $sec bookworm-security main
EOF
  apt-config dump | grep -E '^Acquire::(http::Proxy|https::Proxy|Check-Valid-Until|Check-Date) ' \
    >"$tmp/etc/apt/apt.conf.d/90host-mirror" || true
  rm -f "$tmp.log"
  touch "$tmp/.complete"
  mv "$tmp" "$base"
fi
flock -u 9

tree=$(mktemp -d /var/tmp/nixcage-fresh-XXXXXX)
cleanup() {
  if [ -n "$keep" ]; then echo "checks/fresh.sh: tree kept: $tree"; else rm -rf "$tree"; fi
}
trap cleanup EXIT
echo "checks/fresh.sh: fresh copy of the base tree in $tree"
cp -a "$base/." "$tree/"
# cp gives $tree the mode of $base (a mktemp directory, 0700); it becomes
# the machine's /, which other uids must traverse.
chmod 0755 "$tree"
rm -f "$tree/.complete"
# Only the checkout (a clean clone of HEAD: what is committed, no build
# products, no caches) and the Go toolchain go in.
git clone -q --no-hardlinks "$PWD" "$tree/root/nixcage"
git -C "$tree/root/nixcage" checkout -q "$(git rev-parse HEAD)"
cp -a /usr/local/go "$tree/usr/local/go"
# The network this host reaches the Go module proxy through may intercept
# TLS with local CAs (installed the Debian way, in
# /usr/local/share/ca-certificates); a new machine on the same network has
# them too, so they come along. They take effect when checks/deps.sh
# installs ca-certificates (its postinst runs update-ca-certificates).
if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
  mkdir -p "$tree/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$tree/usr/local/share/ca-certificates/"
fi
echo "checks/fresh.sh: checkout $(git rev-parse --short HEAD), Go $(/usr/local/go/bin/go env GOVERSION)"

# How the tree is entered, and why (docs/testing.md, "Rehearsal"):
#  - the host's network namespace: apt and the Go module proxy must be
#    reachable, as on a real machine; the tests create their own namespaces
#    and add no interfaces to this one;
#  - all capabilities, no seccomp filter, writable /proc/sys and /sys, a
#    cgroup2 mount: the privileged and system tiers create network
#    namespaces and boot machines with systemd-nspawn themselves;
#  - --register=no --keep-unit: the host's systemd is not PID 1.
log=$tree.log
start=$SECONDS
set +e
nspawn=(systemd-nspawn --quiet --pipe --register=no --keep-unit --capability=all
  --resolv-conf=copy-host --timezone=off --link-journal=no
  --machine="nixcage-fresh-${tree##*-}" -D "$tree" --chdir=/root/nixcage
  --setenv=CI="${CI:-}" bash -c 'bash checks/test.sh')
# In its own PID and mount namespace (as internal/systest runs nspawn): all
# of it dies with this script, and nspawn's propagation directory is a
# tmpfs of its own.
SYSTEMD_SECCOMP=0 SYSTEMD_NSPAWN_API_VFS_WRITABLE=1 SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1 \
  unshare --pid --fork --kill-child=SIGKILL --mount-proc --mount --propagation=private -- \
  sh -c 'mkdir -p /run/systemd/nspawn && mount -t tmpfs -o mode=0755 tmpfs /run/systemd/nspawn && exec "$@"' sh "${nspawn[@]}" \
  </dev/null 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
s=$((SECONDS - start))

echo
echo "== checks/fresh.sh: the README's test command in a fresh Debian 12 tree"
echo "exit status $rc after $((s / 60))m$((s % 60))s"
# The summary's tier table: "tier run passed failed skipped".
awk '/^tier +run +passed/ {t=1; next} t && NF==0 {exit} t {
  n=NF; tier=$1; for (i=2; i<=n-4; i++) tier=tier" "$i
  printf "  %-14s %s\n", tier, ($(n-3) > 0 ? "ran (" $(n-3) " run, " $(n-1) " failed, " $n " skipped)" : "did not run (" $n " skipped; reasons above)")
}' "$log"
tail -1 "$log"
rm -f "$log"
exit "$rc"
