#!/usr/bin/env bash
# Cage start latency per backend (service, nspawn, podman) against
# `systemd-run` of the same command with no cage, measured in the same
# disposable machine in the same run; prints medians, p90 and ratios.
# Targets: service <= 1.5x the baseline, nspawn <= 150 ms, podman reported.
# Also prints where the time goes per backend: systemd's own stamps of
# every unit of the start chain, warm and cold (docs/performance.md).
# Run as root on Debian 12 (needs what checks/demo.sh installs):
#   bash bench/system/start-latency.sh [-n 20]
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH=$PATH:/usr/local/go/bin:/usr/sbin:/sbin
exec go run ./bench/system/latency "$@"
