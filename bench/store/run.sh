#!/usr/bin/env bash
# Store benchmarks (not run in CI). Usage: bench/store/run.sh [SIZE_MIB] [PATHS]
#
#  1. apply: `cagectl apply --offline` of a deterministic closure of SIZE_MIB
#     (default 500) vs Nix importing the same binary cache into a local
#     chroot store (`nix copy --no-check-sigs --from file://DIR --to DIR2`),
#     for an uncompressed and an xz cache. Both start from a fresh target,
#     both read the cache from the page cache, both end durable (Nix syncs
#     its database, cagectl does syncfs + fsyncs).
#  2. hash: nixcage's NAR verification (go-nix parse + SHA-256 of every
#     byte) vs sha256sum over the same NAR file.
#
# Needs root, nix-bin (nix-store, nix-build, nix), xz-utils and bc. Takes a
# few minutes at 500 MiB, most of it writing the xz cache. Prints ratios
# measured in this one run; on a shared machine run it twice.
set -euo pipefail
SIZE=${1:-500}
NPATHS=${2:-8}
W=${BENCH_DIR:-/var/tmp/nixcage-bench-store}
NIX=(nix --extra-experimental-features nix-command)
cd "$(dirname "$0")/../.."

clean() { [ -e "$1" ] && chmod -R u+w "$1" 2>/dev/null; rm -rf "$1"; }
now() { date +%s.%N; }
secs() { echo "$2 - $1" | bc -l; }

clean "$W"; mkdir -p "$W"
go build -o "$W/cagectl" ./cmd/cagectl
go build -o "$W/gendata" ./bench/store/gendata
go build -o "$W/narhash" ./bench/store/narhash

echo "== generating ${SIZE} MiB in ${NPATHS} store paths"
"$W/gendata" "$W/src" "$SIZE" "$NPATHS"
deps=()
for d in "$W"/src/*; do deps+=("$(nix-store --add "$d")"); done
{
  echo 'derivation { name = "bench-env"; system = builtins.currentSystem; builder = "/bin/sh";'
  printf '  args = [ "-c" "/bin/mkdir $out; echo'
  for p in "${deps[@]}"; do printf ' ${builtins.storePath "%s"}' "$p"; done
  echo ' > $out/deps" ]; }'
} > "$W/top.nix"
TOP=$(nix-build --no-out-link --option sandbox false --option substituters '' --option build-users-group '' "$W/top.nix")
echo "top: $TOP ($(nix-store -qR "$TOP" | wc -l) paths, $(du -sh --apparent-size "${deps[@]}" | awk '{s+=$1} END {print s}') MiB apparent)"

"$W/cagectl" key generate --out "$W/key" >/dev/null
# Nix's default xz preset 6 compresses at a few MB/s here; the xz cache is
# written with `nix copy` at XZ_LEVEL (default 1) using both cores, then
# `release create` adds the manifest (its own nix copy finds every path
# present). Decoding cost is what is compared, and both sides decode the
# very same files.
COMPS=${COMPS:-none xz}
[[ $COMPS == *xz* ]] && "${NIX[@]}" copy --to "file://$W/rel-xz?compression=xz&parallel-compression=true&compression-level=${XZ_LEVEL:-1}" "$TOP"
for comp in $COMPS; do
  t0=$(now)
  "$W/cagectl" release create "$TOP" --key "$W/key.key" --channel bench --generation 1 --expires 7d --out "$W/rel-$comp" --compression "$comp" >/dev/null
  echo "release create ($comp): $(secs "$t0" "$(now)") s (re-hash + sign; not compared), cache $(du -sm "$W/rel-$comp" | cut -f1) MiB"
done

echo "== apply vs nix copy --from file:// (median of ${ROUNDS:=3} alternating rounds)"
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
# Every round writes to fresh directories and nothing is deleted until the
# end: ext4 makes inode allocation right after a mass delete expensive
# (recently_deleted() scans), which would penalise whichever tool runs
# next. The order alternates between rounds.
run_cagectl() {
  local t0; t0=$(now)
  "$W/cagectl" apply "$W/rel-$comp" --offline --store "$W/root-$comp-$r" --channel bench --key "$W/key.pub" >/dev/null
  ta+=("$(secs "$t0" "$(now)")")
}
run_nix() {
  local t0 t1; t0=$(now)
  "${NIX[@]}" copy --no-check-sigs --from "file://$W/rel-$comp" --to "$W/chroot-$comp-$r" "$TOP" 2>/dev/null
  t1=$(now)
  # cagectl's apply ends with syncfs (durable); Nix does not sync file
  # data, so also report Nix plus the flush that makes it as durable.
  sync -f "$W/chroot-$comp-$r"
  tn+=("$(secs "$t0" "$t1")") tns+=("$(secs "$t0" "$(now)")")
}
for comp in $COMPS; do
  ta=() tn=() tns=()
  for r in $(seq "$ROUNDS"); do
    sync -f "$W"
    cat "$W"/rel-$comp/nar/* >/dev/null # same page-cache state for both
    if ((r % 2)); then run_cagectl; sync -f "$W"; run_nix; else run_nix; sync -f "$W"; run_cagectl; fi
  done
  a=$(median "${ta[@]}") n=$(median "${tn[@]}") ns=$(median "${tns[@]}")
  printf 'apply %-4s  cagectl %6.2f s   nix copy %6.2f s (%.2fx)   nix copy + sync %6.2f s (%.2fx)   [cagectl: %s] [nix: %s]\n' \
    "$comp" "$a" "$n" "$(echo "$n / $a" | bc -l)" "$ns" "$(echo "$ns / $a" | bc -l)" "${ta[*]}" "${tn[*]}"
  "$W/cagectl" store verify --store "$W/root-$comp-1" >/dev/null
done
echo "(ratios are nix time / cagectl time: above 1 means cagectl is faster)"

echo "== NAR hashing vs sha256sum"
big=$(du -s "${deps[@]}" | sort -n | tail -1 | cut -f2)
nix-store --dump "$big" > "$W/big.nar"
cat "$W/big.nar" >/dev/null
t0=$(now); sha256sum "$W/big.nar" >/dev/null; ts=$(secs "$t0" "$(now)")
t0=$(now); "$W/narhash" "$W/big.nar" >/dev/null; th=$(secs "$t0" "$(now)")
bytes=$(stat -c %s "$W/big.nar")
printf 'hash %d MiB  sha256sum %.3f s (%.0f MiB/s)   nixcage %.3f s (%.0f MiB/s)   nixcage/sha256sum throughput = %.2fx\n' \
  $((bytes >> 20)) "$ts" "$(echo "$bytes/1048576/$ts" | bc -l)" "$th" "$(echo "$bytes/1048576/$th" | bc -l)" "$(echo "$ts / $th" | bc -l)"

[ -n "${KEEP:-}" ] || { clean "$W"; nix-store --delete "$TOP" "${deps[@]}" >/dev/null 2>&1 || true; }
