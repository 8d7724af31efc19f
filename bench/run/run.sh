#!/usr/bin/env bash
# Time from `cagectl run -- true` to its exit (both backends) against
# `systemd-run --wait --pipe true` and against `srt true` (Anthropic's
# sandbox-runtime on bubblewrap), in one disposable machine with a real
# systemd, in the same run; prints medians, p90 and ratios to systemd-run.
# Targets: cagectl run <= 1.5x systemd-run, and faster than srt.
# Run as root on Debian 12 (what checks/deps.sh installs, plus node and npm
# for srt; srt and its .debs are cached in /var/cache/nixcage-bench):
#   bash bench/run/run.sh [-n 20]
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH=$PATH:/usr/local/go/bin:/usr/sbin:/sbin
exec go run ./bench/run "$@"
