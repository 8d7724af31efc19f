#!/usr/bin/env bash
# Recomputes buildGoModule's vendorHash (the NAR hash, SRI sha256, of the tree
# `go mod vendor` writes) and checks it against nix/vendor.json, which the
# flake's package reads. With --update, rewrites nix/vendor.json instead.
#
# Needs go and nix (Debian: nix-bin); works offline once the module cache
# holds the dependencies (go test ./... fills it), else via the Go proxy.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/local/go/bin

update=no
case "${1:-}" in
  --update) update=yes ;;
  "") ;;
  *) echo "usage: $0 [--update]" >&2; exit 2 ;;
esac

for tool in go nix; do
  command -v "$tool" >/dev/null || { echo "vendor-hash: $tool not found (apt-get install nix-bin; Go from go.dev)" >&2; exit 1; }
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
go mod vendor -o "$tmp/vendor"
hash=$(nix --extra-experimental-features nix-command hash path "$tmp/vendor")
gosum=$(sha256sum go.sum | cut -d' ' -f1)

if [ "$update" = yes ]; then
  printf '{\n  "vendorHash": "%s",\n  "goSum": "%s"\n}\n' "$hash" "$gosum" > nix/vendor.json
  echo "vendor-hash: wrote nix/vendor.json (vendorHash $hash)"
  exit 0
fi

if [ ! -f nix/vendor.json ]; then
  echo "vendor-hash: nix/vendor.json is missing; run: bash checks/vendor-hash.sh --update" >&2
  exit 1
fi
want=$(sed -n 's/.*"vendorHash": *"\([^"]*\)".*/\1/p' nix/vendor.json)
wantsum=$(sed -n 's/.*"goSum": *"\([^"]*\)".*/\1/p' nix/vendor.json)
if [ "$hash" != "$want" ] || [ "$gosum" != "$wantsum" ]; then
  echo "vendor-hash: nix/vendor.json is stale:" >&2
  echo "  vendorHash recorded $want, vendor tree hashes to $hash" >&2
  echo "  go.sum recorded $wantsum, is $gosum" >&2
  echo "  run: bash checks/vendor-hash.sh --update   (and commit nix/vendor.json)" >&2
  exit 1
fi
echo "vendor-hash: nix/vendor.json matches ($hash)"
