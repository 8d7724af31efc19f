#!/usr/bin/env bash
# Installs what nixcage's tests and demo need on a Debian 12 host, as root.
# Idempotent: packages already present are not fetched again.
set -euo pipefail

pkgs=(
  ca-certificates curl git iproute2 dbus           # basics, ip netns, dbus-daemon
  systemd-container debootstrap                    # systemd-nspawn, booted test machines
  podman runc uidmap                               # podman backend (runc: crun fails on hybrid cgroups)
  nix-bin xz-utils                                 # real Nix stores and binary caches (xz NARs)
  zsh fish groff-base                              # cagectl's generated completions and man page, checked by their shells
  prometheus                                       # a real Prometheus scrapes caged's metrics (TestPrometheusScrapesCaged)
  openssl                                          # s_server as a real OpenSSL upstream (TestThreatTunnelHelloRetryFronting)
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "checks/deps.sh: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi
# npm fetches the real harness CLIs for checks/system (TestHarnessCLIs):
# only its download is used (the CLIs are native binaries), so Debian's npm
# serves; a host that already has npm (e.g. a newer Node.js) keeps its own.
if ! command -v npm >/dev/null; then
  echo "checks/deps.sh: installing npm"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends npm >/dev/null
fi
command -v go >/dev/null || { echo "checks/deps.sh: Go is required (https://go.dev/dl), e.g. /usr/local/go/bin" >&2; exit 1; }
