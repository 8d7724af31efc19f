#!/usr/bin/env bash
# Smoke test of caged --units render on a real, booted systemd 252 in
# systemd-nspawn (run as root on Debian 12; takes a few minutes the first
# time for debootstrap). It installs caged, cagectl, the D-Bus policy and the
# caged unit the way docs/operations.md says, boots, and drives status,
# start, kill, quarantine (evidence verified with sha256sum -c), caged
# restart (agent stays down), release, reload and events. cage-egress is a
# stand-in script here: this checks caged, not the gateway.
# Usage: bash bench/caged/smoke-systemd.sh [WORKDIR]
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${1:-/var/tmp/nixcage-caged-smoke}
export PATH=$PATH:/usr/local/go/bin:/usr/sbin:/sbin
mkdir -p "$work"; cd "$work"
if [ ! -x root/usr/bin/systemctl ]; then
  debootstrap --variant=minbase --include=systemd,systemd-sysv,dbus,iproute2 bookworm root http://deb.debian.org/debian >debootstrap.log
fi
(cd "$repo" && CGO_ENABLED=0 go build -o "$work/caged" ./cmd/caged && CGO_ENABLED=0 go build -o "$work/cagectl" ./cmd/cagectl)
cat >cage-egress <<'SH'
#!/bin/sh
if [ "$1" = prepare ]; then
  agent=$(basename "$(dirname "$3")"); rt=/run/nixcage/cage/$agent; st=/var/lib/nixcage/egress/$agent
  : >"$rt/agent.env"; echo "nameserver 127.0.0.1" >"$rt/resolv.conf"; : >"$st/ca.crt"; : >"$st/bundle.crt"; : >"$st/ca.key"
  exit 0
fi
exec sleep infinity
SH
cat >cage.hcl <<'HCL'
agent "alpha" {
  backend = "service"
  command = ["/bin/sleep", "infinity"]
}
agent "beta" {
  backend   = "service"
  command   = ["/bin/sleep", "infinity"]
  autostart = false
}
account "viewers" {
  user = "nobody"
  role = "viewer"
}
HCL
install -m755 caged cagectl cage-egress root/usr/local/bin/
rm -rf render && ./cagectl render cage.hcl --out render >/dev/null
install -D -m644 render/systemd/system/nixcage-caged.service root/etc/systemd/system/nixcage-caged.service
install -D -m644 render/dbus-1/system.d/org.nixcage.cage1.conf root/etc/dbus-1/system.d/org.nixcage.cage1.conf
install -D -m644 render/nixcage/nixcage.json root/etc/nixcage/nixcage.json
mkdir -p root/etc/systemd/system/multi-user.target.wants
ln -sf /etc/systemd/system/nixcage-caged.service root/etc/systemd/system/multi-user.target.wants/
rm -rf root/var/lib/nixcage root/etc/systemd/system/*.wants/nixcage-agent@*
systemd-nspawn --register=no --keep-unit --private-network -D root -b >boot.log 2>&1 &
nspawn=$!
trap 'kill $nspawn 2>/dev/null; wait $nspawn 2>/dev/null || true' EXIT
for _ in $(seq 60); do
  leader=$(pgrep -P $nspawn | head -1 || true)
  [ -n "$leader" ] && nsenter -t "$leader" -a systemctl is-active -q nixcage-caged 2>/dev/null && break
  sleep 1
done
run() { nsenter -t "$leader" -a "$@"; }
step() { printf '\n== %s\n' "$*"; }
step status; run cagectl status
step "nobody may read, not kill (exit 3)"; run setpriv --reuid=65534 --regid=65534 --clear-groups cagectl status --names
set +e; run setpriv --reuid=65534 --regid=65534 --clear-groups cagectl kill alpha; [ $? -eq 3 ] || { echo "FAIL: kill by nobody not refused"; exit 1; }; set -e
step "start, kill"; run cagectl start beta; run cagectl kill beta
step quarantine; run sh -c 'echo evidence >/var/lib/nixcage/agents/alpha/work.txt'
run cagectl quarantine alpha --reason smoke
run sh -c 'cd /var/lib/nixcage/evidence/alpha-* && sha256sum -c SHA256SUMS'
step "caged restart keeps it down"; run systemctl restart nixcage-caged
[ "$(run systemctl show -p ActiveState --value nixcage-agent@alpha.service)" = inactive ] || { echo "FAIL: quarantined agent runs"; exit 1; }
set +e; run cagectl start alpha; [ $? -eq 1 ] || { echo "FAIL: start of quarantined agent"; exit 1; }; set -e
step "release, start, reload"; run cagectl release alpha; run cagectl start alpha; run systemctl reload nixcage-caged
run cagectl status
step "reconcile: alpha's command changes, beta disappears"
pid=$(run systemctl show -p MainPID --value nixcage-agent@alpha.service)
sed 's|"/bin/sleep", "infinity"\]|"/bin/sleep", "86400"]|' cage.hcl | awk '/^agent "beta"/{skip=1} skip&&/^}/{skip=0;next} !skip' >cage2.hcl
./cagectl render cage2.hcl --out render2 >/dev/null
install -m644 render2/nixcage/nixcage.json root/etc/nixcage/nixcage.json
run cagectl reload
npid=$(run systemctl show -p MainPID --value nixcage-agent@alpha.service)
[ "$pid" != "$npid" ] && [ "$npid" != 0 ] || { echo "FAIL: alpha not restarted ($pid -> $npid)"; exit 1; }
run systemctl cat nixcage-agent@alpha.service | grep -q 86400 || { echo "FAIL: alpha runs the old unit"; exit 1; }
run test ! -e /run/systemd/system/nixcage-agent@beta.service || { echo "FAIL: beta's unit left behind"; exit 1; }
[ "$(run systemctl show -p ActiveState --value nixcage-agent@beta.service)" = inactive ] || { echo "FAIL: beta still runs"; exit 1; }
run cagectl status
step "watchdog"; run systemctl show nixcage-caged -p WatchdogUSec -p WatchdogTimestamp -p NRestarts
echo; echo "smoke test passed"
