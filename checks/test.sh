#!/usr/bin/env bash
# The whole test suite: static checks, unit tests, privileged tests (real
# namespaces, real dbus-daemon, real Nix) and system tests (a booted systemd
# in systemd-nspawn). Run as root on Debian 12: bash checks/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/local/go/bin:/usr/sbin:/sbin

bash checks/deps.sh

step() { printf '\n== %s\n' "$*"; }

step "gofmt"
bad=$(gofmt -l $(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))
if [ -n "$bad" ]; then echo "gofmt would change:"; echo "$bad"; exit 1; fi

step "go vet"
go vet ./...

step "nix syntax"
# Test-scoped Nix config (docs/testing.md): Debian's nix-bin names a build
# group only nix-setup-systemd creates; parsing needs none, so say so.
for f in $(git ls-files '*.nix'); do NIX_CONFIG='build-users-group =' nix-instantiate --parse "$f" >/dev/null; done
echo "parsed $(git ls-files '*.nix' | wc -l) .nix files"

step "vendorHash"
bash checks/vendor-hash.sh

# nixpkgs' lib for evaluating the NixOS module (checks/nixeval): NIXPKGS_LIB
# if set, else /var/cache/nixcage/nixpkgs-lib if it holds one, else those
# tests skip and say so (CI's network cannot fetch it).

step "tests (unit, privileged, system)"
export NIXCAGE_TEST_PRIVILEGED=1 NIXCAGE_TEST_SYSTEM=1
go test -count=1 -timeout 20m ./...

step "fuzz the config loader (20s)"
go test -run '^$' -fuzz FuzzLoad -fuzztime 20s ./internal/config/
