#!/usr/bin/env bash
# The quick start in one command, on a fresh Debian 12 machine, as root:
#
#   bash checks/demo.sh          # boot, run the demo agent, show, tear down
#   bash checks/demo.sh --keep   # leave the machine running, print how to enter it
#
# It installs what it needs with apt-get (debootstrap, systemd-container, ...),
# gets a Go toolchain if there is none (from the Go module proxy), builds
# cagectl and cage-egress, boots a disposable Debian machine with a real
# systemd (systemd-nspawn, private network, throw-away overlay), installs
# nixcage into it from examples/quickstart.hcl and starts agent "demo": its
# allowed request succeeds with the API key injected by the gateway, its
# exfiltration attempt is refused, and the audit trail shows both. Nothing on
# the host changes except the package installs and the cached machine tree in
# /var/cache/nixcage-systest (first run: ~2 minutes for debootstrap).
#
# Other flags go to the demo program: --config FILE, --agent NAME,
# --secret PATH=VALUE (see `go run ./checks/system/demo -h`).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "checks/demo.sh: run as root (it boots a machine with systemd-nspawn)" >&2
  exit 1
fi
if ! grep -q 'VERSION_CODENAME=bookworm' /etc/os-release 2>/dev/null; then
  echo "checks/demo.sh: note: made for Debian 12 (bookworm); trying anyway" >&2
fi

# Host packages: debootstrap builds the machine tree, systemd-container has
# systemd-nspawn, util-linux has unshare/nsenter, unzip unpacks a Go toolchain.
pkgs=(debootstrap systemd-container util-linux iproute2 ca-certificates curl unzip)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "==> apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

# Go: any Go >= 1.21 fetches the toolchain go.mod asks for by itself. Debian
# 12's own golang is 1.19, so without a usable go, take the toolchain module
# from the Go proxy (the same zip `go` downloads for GOTOOLCHAIN=auto).
export PATH=$PATH:/usr/local/go/bin:/usr/sbin:/sbin
go_ok() {
  command -v go >/dev/null 2>&1 || return 1
  local v; v=$(go env GOVERSION 2>/dev/null | sed -n 's/^go1\.\([0-9]*\).*/\1/p')
  [ -n "$v" ] && [ "$v" -ge 21 ]
}
if ! go_ok; then
  gover=${NIXCAGE_GO_VERSION:-1.26.8}
  arch=$(dpkg --print-architecture)
  dir=/var/cache/nixcage-demo/go$gover
  if [ ! -x "$dir/bin/go" ]; then
    proxy=${GOPROXY:-https://proxy.golang.org}; proxy=${proxy%%,*}
    url="$proxy/golang.org/toolchain/@v/v0.0.1-go$gover.linux-$arch.zip"
    echo "==> fetching Go $gover from $url"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    curl -fsSL -o "$tmp/go.zip" "$url"
    unzip -q "$tmp/go.zip" -d "$tmp"
    mkdir -p "$(dirname "$dir")"
    rm -rf "$dir"
    mv "$tmp/golang.org/toolchain@v0.0.1-go$gover.linux-$arch" "$dir"
    chmod +x "$dir"/bin/* "$dir"/pkg/tool/*/* 2>/dev/null || true
  fi
  export PATH=$dir/bin:$PATH GOTOOLCHAIN=local
fi
echo "==> $(go version)"

exec go run ./checks/system/demo "$@"
