#!/usr/bin/env bash
# cagectl status round trip with 10, 100 and 1000 agents, against a real
# caged (fake systemd, private dbus-daemon), compared with an empty busctl
# call (org.freedesktop.DBus.Peer.Ping to caged) on the same bus, both as
# fresh processes; then the in-process client round trips (Go benchmark).
# Needs dbus-daemon and busctl. Usage: bash bench/caged/status.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH=$PATH:/usr/local/go/bin
echo "== process round trips (median of 101 runs each, interleaved)"
NIXCAGE_BENCH=1 go test -count=1 -run '^TestStatusLatencyReport$' -v ./internal/daemon/ | grep '^|'
echo
echo "== in-process client round trips"
go test -count=1 -run '^$' -bench 'BenchmarkStatus' -benchtime 300x ./internal/daemon/ | grep '^Benchmark'
