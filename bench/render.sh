#!/usr/bin/env bash
# Rendering cost per agent at 10, 100 and 1000 agents, and the ratio of the
# per-agent cost at 1000 to that at 10 (1.0 = perfectly linear growth).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(go test -run '^$' -bench BenchmarkRender -benchtime 20x -count 5 ./internal/render/)
echo "$out" | grep '^Benchmark'
echo "$out" | awk '
  /^BenchmarkRender/ {
    split($1, a, "="); n = a[2]; sub(/-.*/, "", n)
    for (i = 2; i <= NF; i++) {
      if ($(i+1) == "ns/agent") { t[n] += $i; c[n]++ }
      if ($(i+1) == "B/op") b[n] += $i
      if ($(i+1) == "allocs/op") al[n] += $i
    }
  }
  END {
    printf "\n%-8s %12s %12s %12s\n", "agents", "us/agent", "KiB/agent", "allocs/agent"
    for (n = 10; n <= 1000; n *= 10) {
      us[n] = t[n] / c[n] / 1000
      printf "%-8d %12.1f %12.1f %12.1f\n", n, us[n], b[n] / c[n] / n / 1024, al[n] / c[n] / n
    }
    printf "\nper-agent time ratio 1000/10: %.2f (1.00 = linear)\n", us[1000] / us[10]
  }'
