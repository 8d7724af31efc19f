#!/usr/bin/env bash
# The whole test suite: static checks, unit tests, privileged tests (real
# namespaces, real dbus-daemon, real Nix) and system tests (a booted systemd
# in systemd-nspawn), then a bounded fuzz run. Run as root on Debian 12:
#   bash checks/test.sh
# Every step runs even when an earlier one failed; the run ends with a
# per-tier summary (checks/summary) whose last line is
# "N passed, N failed, N skipped", and exits non-zero if anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/local/go/bin:/usr/sbin:/sbin
start=$SECONDS

bash checks/deps.sh || { echo "checks/test.sh: checks/deps.sh failed, nothing was tested" >&2; exit 1; }

work=$(mktemp -d /tmp/nixcage-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
steps=$work/steps.tsv
: >"$steps"

step() { printf '\n== %s\n' "$*"; }
# check TIER NAME CMD...: runs a step and records its outcome for the summary.
check() {
  local tier=$1 name=$2
  shift 2
  if "$@"; then
    printf '%s\t%s\tpass\n' "$tier" "$name" >>"$steps"
  else
    printf '%s\t%s\tfail\t%s\n' "$tier" "$name" "see its output above" >>"$steps"
  fi
}

gofmt_clean() {
  local bad
  bad=$(gofmt -l $(git ls-files '*.go' 2>/dev/null || find . -name '*.go')) || return 1
  [ -z "$bad" ] || { echo "gofmt would change:"; echo "$bad"; return 1; }
}

# Test-scoped Nix config (docs/testing.md): Debian's nix-bin names a build
# group only nix-setup-systemd creates; parsing needs none, so say so.
nix_parse() {
  local f n=0 rc=0
  for f in $(git ls-files '*.nix'); do
    NIX_CONFIG='build-users-group =' nix-instantiate --parse "$f" >/dev/null || rc=1
    n=$((n + 1))
  done
  echo "parsed $n .nix files"
  return $rc
}

step "gofmt"
check "static checks" gofmt gofmt_clean

step "go vet"
check "static checks" "go vet" go vet ./...

step "nix syntax"
check "static checks" "nix syntax" nix_parse

step "vendorHash"
check "static checks" vendorHash bash checks/vendor-hash.sh

step "build the summary (checks/summary)"
if ! go build -o "$work/summary" ./checks/summary; then
  echo "checks/test.sh: checks/summary does not build, so no summary"
  echo "0 passed, 1 failed, 0 skipped"
  exit 1
fi

# nixpkgs' lib for evaluating the NixOS module (checks/nixeval): NIXPKGS_LIB
# if set, else /var/cache/nixcage/nixpkgs-lib if it holds one, else those
# tests skip and say so (CI's network cannot fetch it).

step "tests (unit, privileged, system)"
# One go test run for every tier: each test's tier is the marker its testenv
# gate logs, so nothing here lists packages or tests.
NIXCAGE_TEST_PRIVILEGED=1 NIXCAGE_TEST_SYSTEM=1 \
  go test -json -count=1 -timeout 20m ./... 2>&1 | "$work/summary" stream -record "$work/tests.json"
gotest=${PIPESTATUS[0]}

step "the in-kernel relay floor's own module (bench/egress/sockmap)"
# Its own Go module (cilium/ebpf is no dependency of nixcage), so ./... above
# does not reach it; its tests need root and BPF and skip naming what is
# missing.
check privileged "bench/egress/sockmap (vet, tests)" sh -c 'cd bench/egress/sockmap && go vet ./... && go test -count=1 ./...'

# Fuzz budgets are execution counts, not durations: Go 1.26's fuzz
# coordinator can fail a -fuzztime <duration> run with a bare "context
# deadline exceeded" when the deadline races a worker mid-input on a loaded
# machine (go.dev/issue/75804, fixed in Go 1.27; checks/fresh.sh hit it on
# FuzzUpstreamResponse). A count has no deadline to race. Each count is
# about what the step ran in 10-20 s on this 2-core machine under CI load.
step "fuzz the config loader (50000 inputs)"
check fuzz "FuzzLoad (50000x)" go test -run '^$' -fuzz FuzzLoad -fuzztime 50000x ./internal/config/
step "fuzz the gateway's CONNECT parser (25000 inputs)"
check fuzz "FuzzReadConnectHead (25000x)" go test -run '^$' -fuzz FuzzReadConnectHead -fuzztime 25000x ./internal/egress/
step "fuzz the intercepted tunnels' upstream client (10000 inputs)"
check fuzz "FuzzUpstreamResponse (10000x)" go test -run '^$' -fuzz FuzzUpstreamResponse -fuzztime 10000x ./internal/egress/
step "fuzz the tunnels' ClientHello gate against crypto/tls (30000 inputs)"
# Differential: every input also runs a crypto/tls handshake, the oracle.
# -fuzzminimizetime is a count too: the default 60 s per new interesting
# input stalled a fresh corpus for minutes on 8 KiB ClientHellos.
check fuzz "FuzzClientHelloPeek (30000x)" go test -run '^$' -fuzz FuzzClientHelloPeek -fuzztime 30000x -fuzzminimizetime 100x ./internal/egress/

step "fuzz the audit record encoder (40000 inputs)"
check fuzz "FuzzAppendJSON (40000x)" go test -run '^$' -fuzz FuzzAppendJSON -fuzztime 40000x ./internal/auditlog/

step "summary"
s=$((SECONDS - start))
echo "took $((s / 60))m$((s % 60))s"
"$work/summary" report -steps "$steps" -go-test-status "$gotest" "$work/tests.json"
