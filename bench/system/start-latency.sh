#!/usr/bin/env bash
# Cage start latency per backend (service, nspawn, podman) against
# `systemd-run` of the same command with no cage, measured in the same
# disposable machine in the same run; prints medians, p90 and ratios.
# Targets: service <= 1.5x the baseline, nspawn <= 300 ms, podman reported.
# Run as root on Debian 12 (needs what checks/demo.sh installs):
#   bash bench/system/start-latency.sh [-n 20]
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH=$PATH:/usr/local/go/bin:/usr/sbin:/sbin
exec go run ./bench/system/latency "$@"
