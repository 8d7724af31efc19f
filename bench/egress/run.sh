#!/usr/bin/env bash
# Egress gateway benchmarks: cage-egress against a direct connection and
# peers (Debian's squid, a default github.com/elazarl/goproxy, stripe's
# smokescreen if it builds, mitmproxy's mitmdump), all on loopback against the
# same HTTPS upstream. Rounds are interleaved, every proxy is started fresh in
# every round, and each figure is a ratio to the direct connection measured
# in the same round (median over rounds), so a load change on this shared
# machine moves the direct figure with the others.
#
#   bench/egress/run.sh            # full: 3 rounds, 2000 new tunnels, 512 MiB
#                                  # bulk, 8 keep-alive tunnels for 5 s, 1000
#                                  # held tunnels, 8 intercepted clients
#   QUICK=1 bench/egress/run.sh    # 1 round, smaller counts (~2 minutes)
#   PROFILE=latency bench/egress/run.sh   # or bulk, keepalive, icpt: strace
#                                  # and perf of cage-egress under one
#                                  # workload instead of the table
#   PROFILE=keepalive PROFILE_OF=relay bench/egress/run.sh  # the same of a
#                                  # floor relay (relay: splice, relay-rw)
#   BASE_EGRESS=/path/cage-egress bench/egress/run.sh
#                                  # also measures that build (rows
#                                  # "cage-egress-base") in the same rounds:
#                                  # a before/after comparison on one load
#   GOMAXPROCS1=1 bench/egress/run.sh
#                                  # also measures this tree's cage-egress with
#                                  # GOMAXPROCS=1 in its environment (rows
#                                  # "cage-egress-gomaxprocs1"), every figure,
#                                  # interception included, same rounds
#   ICPT_C=1 ONLY=icpt bench/egress/run.sh  # interception with one client
#                                  # (an agent's one model request at a time;
#                                  # the default is 8 clients)
#   ONLY=icpt bench/egress/run.sh  # interception rows only (direct, cage-
#                                  # egress, the base build, mitmdump),
#                                  # ROUNDS interleaved rounds (~1 minute each)
#   ONLY=rss bench/egress/run.sh   # memory only: RSS idle and with HOLD open
#                                  # tunnels of cage-egress, the base build and
#                                  # the GOMAXPROCS=1 one, ROUNDS rounds
#                                  # (~15 s a row)
#   ONLY=tunnel bench/egress/run.sh  # plain tunnels only: direct, cage-egress
#                                  # (name), the base build, both relay
#                                  # floors, squid (name); new tunnels, bulk
#                                  # and keep-alive, no RSS, no interception;
#                                  # 1000 GETs, 256 MiB, 3 s (~1 minute a
#                                  # round), ROUNDS interleaved rounds
#   PAIRED_N=1000                  # the default: after each row's figures,
#                                  # PAIRED_N new tunnels through it paired
#                                  # one by one with PAIRED_N direct ones in
#                                  # the same run (the "paired" table; its
#                                  # ratios do not depend on the load moving
#                                  # between two runs); PAIRED_N=0 skips them
#   PAIRED_BULK=268435456          # the default (QUICK: 64 MiB): then
#                                  # PAIRED_BULK bytes on each side in 32 MiB
#                                  # GETs, alternately on one direct keep-alive
#                                  # connection and on one through the row's
#                                  # proxy (both opened before the clock);
#                                  # PAIRED_BULK=0 skips it
#   PAIRED_KA=3s                   # the default (QUICK: 1s): then 8 keep-
#                                  # alive clients in 250 ms slices,
#                                  # alternately direct and through the proxy,
#                                  # PAIRED_KA of each side; PAIRED_KA=0 skips
#                                  # it. The paired table shows all three
#                                  # paired figures; every direct side is the
#                                  # upstream itself, the floor rows' too
#
# Destinations: the "name" round gives every proxy up.bench.test, resolved
# through the same loopback resolver (cage-egress --resolver, squid
# dns_nameservers, goproxy -resolver, smokescreen --resolver-address); the
# "ip" round gives 127.0.0.1 to every proxy that accepts an IP literal.
# cage-egress refuses IP literals by design (policy is by name); its ip row
# runs it with --unsafe-bench-ip-literals, a flag the rendered units never
# pass and that refuses to run under systemd, which decides such a tunnel
# on its TLS SNI instead (docs/egress.md). mitmdump only resolves through
# the system resolver: ip only. The "tcp relay" rows are the floor of every
# proxy here: `loadgen relay`, one extra hop that only copies bytes (no
# CONNECT, no policy, no log), which the clients reach as the upstream;
# "splice" is io.Copy between TCP connections (splice(2)), "rw" plain
# read/write through a 64 KiB buffer. The floor is the better of the two.
# The "connect relay splice" row is the floor under every CONNECT proxy:
# `loadgen relay -connect`, the splice relay that first reads the client's
# CONNECT head and answers 200 (no policy, no resolution, no log; it dials
# the upstream whatever was named), asked for the name as cage-egress is.
# The "kernel sockmap relay" row is bench/egress/sockmap, its own module: the
# same hop with the bytes forwarded in the kernel (two BPF sockmaps and an
# SK_SKB verdict program), user space woken per connection only. Its proxy
# CPU is near 0: softirq and kernel workers (sk_psock_backlog) do its work,
# which no /proc/PID/stat here counts (bench/egress/sockmap/run.sh reads the
# machine's /proc/stat for it). Skipped, with the reason, where BPF
# sockmaps cannot be made (not root, an old kernel).
#
# The third table is the CPU accounting of the tunnel workloads: the CPU
# the client and the upstream used per operation over the measured window
# (loadgen -upstream-pid; the direct run shows how many of the machine's
# cores its two endpoints kept busy), the proxy's own, and the cap that
# puts on the ratio when the direct run already keeps the cores busy.
#
# Needs: go, python3, squid (installed with apt-get if missing and apt-get is
# there; its init script is never started), mitmdump (optional). goproxy is
# built from bench/egress/goproxy, its own module, so it is no dependency of
# nixcage. smokescreen is fetched with `go install` into a temp GOBIN; set
# SMOKESCREEN=/path/to/binary to reuse one, or SMOKESCREEN=none to skip.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=bench/egress/common.sh
. "$ROOT/bench/egress/common.sh"   # bench_init, background, wait_port, cpu_ticks, egress_prepare, squid_conf
bench_init egress-bench

N_LAT=${N_LAT:-2000}; BULK=${BULK:-$((512 << 20))}; ROUNDS=${ROUNDS:-3}; KA_SECS=${KA_SECS:-5s}; HOLD=${HOLD:-1000}; ICPT_SECS=${ICPT_SECS:-5s}; ICPT_C=${ICPT_C:-8}
if [ -n "${QUICK:-}" ]; then N_LAT=300; BULK=$((128 << 20)); ROUNDS=1; KA_SECS=2s; HOLD=300; ICPT_SECS=2s; fi
PAIRED_N=${PAIRED_N:-1000}; [ -n "${QUICK:-}" ] && PAIRED_N=${PAIRED_N_Q:-300}
PAIRED_BULK=${PAIRED_BULK:-$((256 << 20))}; [ -n "${QUICK:-}" ] && PAIRED_BULK=${PAIRED_BULK_Q:-$((64 << 20))}
PAIRED_KA=${PAIRED_KA:-3s}; [ -n "${QUICK:-}" ] && PAIRED_KA=${PAIRED_KA_Q:-1s}
# Plain seconds are seconds (loadgen -d wants a unit).
[[ $PAIRED_KA =~ ^[0-9.]+$ ]] && [ "$PAIRED_KA" != 0 ] && PAIRED_KA=${PAIRED_KA}s
if [ "${ONLY:-}" = tunnel ]; then N_LAT=${N_LAT_T:-1000}; BULK=${BULK_T:-$((256 << 20))}; KA_SECS=${KA_SECS_T:-3s}; fi
PORT=${PORT:-23140}
# squid takes nameservers without a port: the bench resolver listens on
# port 53 of a loopback address no one else uses.
DNS=${DNS_ADDR:-127.77.$((RANDOM % 250 + 1)).53:53}

echo "== building" >&2
# -tags netgo as nix/package.nix builds it: a static cage-egress, no libc.
(cd "$ROOT" && go build -tags netgo -o "$W/cage-egress" ./cmd/cage-egress && go build -o "$W/loadgen" ./bench/egress/loadgen)
(cd "$ROOT/bench/egress/goproxy" && go build -o "$W/goproxy" .)
KRELAY_OK=
if (cd "$ROOT/bench/egress/sockmap" && go build -o "$W/sockmap" .) 2>"$W/sockmap.err" && "$W/sockmap" -check 2>>"$W/sockmap.err"; then
  KRELAY_OK=1
else
  echo "kernel sockmap relay cannot run here; skipping its row: $(tail -1 "$W/sockmap.err")" >&2
fi
if [ -n "${BASE_EGRESS:-}" ]; then cp "$BASE_EGRESS" "$W/cage-egress-base"; fi
[ -n "${PROFILE:-}" ] && SMOKESCREEN=${SMOKESCREEN:-none}
if [ -z "${PROFILE:-}" ] && ! command -v squid >/dev/null && command -v apt-get >/dev/null; then
  echo "== installing squid" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends squid >"$W/apt.log" 2>&1 || { cat "$W/apt.log" >&2; exit 1; }
fi
SQUID=$(command -v squid || true)
[ -n "$SQUID" ] || echo "squid not found; skipping it" >&2
MITM=$(command -v mitmdump || true)
SMOKE_BIN=${SMOKESCREEN:-}
if [ -z "$SMOKE_BIN" ]; then
  if (cd "$W" && GOBIN="$W/bin" GOFLAGS=-mod=mod go install github.com/stripe/smokescreen@latest) >"$W/smoke-build.log" 2>&1; then
    SMOKE_BIN="$W/bin/smokescreen"
  else
    echo "smokescreen did not build; skipping it (see log)" >&2; SMOKE_BIN=none
  fi
fi

rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
TCK=$(getconf CLK_TCK)
# measure LABEL PID ARGS...: the three tunnel workloads with ARGS (-proxy
# and -target), and PID's CPU time over each.
measure() {
  local label=$1 pid=$2 c0 c1 c2 c3 s0 s1; shift 2
  c0=$(cpu_ticks "$pid"); s0=$(ctx_switches "$pid"); lg latency -label "$label" "$@" -n "$N_LAT"
  c1=$(cpu_ticks "$pid"); s1=$(ctx_switches "$pid"); lg throughput -label "$label" "$@" -bytes "$BULK" -upstream-pid "$UP_PID" -proxy-pid "$pid"
  c2=$(cpu_ticks "$pid"); lg rps -label "$label" "$@" -c 8 -d "$KA_SECS" -upstream-pid "$UP_PID" -proxy-pid "$pid"
  c3=$(cpu_ticks "$pid")
  echo "{\"mode\":\"cpu\",\"label\":\"$label\",\"tck\":$TCK,\"latency\":$((c1 - c0)),\"throughput\":$((c2 - c1)),\"rps\":$((c3 - c2)),\"csw_latency\":$((s1 - s0))}" >>"$R"
  # Paired new tunnels: every other one direct, in the same run, so both
  # halves meet the same moments of the machine's load (the table after
  # the first; PAIRED_N=0 skips it).
  [ "$PAIRED_N" = 0 ] || lg latency -label "$label" "$@" -n "$PAIRED_N" -paired "127.0.0.1:$UP_PORT"
  # The same for bulk (chunks alternating on a direct and a proxied
  # keep-alive connection) and keep-alive requests (time slices
  # alternating between a direct and a proxied pool).
  [ "$PAIRED_BULK" = 0 ] || lg throughput -label "$label" "$@" -bytes "$PAIRED_BULK" -paired "127.0.0.1:$UP_PORT"
  [ "$PAIRED_KA" = 0 ] || lg rps -label "$label" "$@" -c 8 -d "$PAIRED_KA" -paired "127.0.0.1:$UP_PORT"
}

background UP "$W/loadgen" upstream -dir "$W/upca"
UP_PORT=${UP##*:}
UP_PID=${PIDS[-1]}
background RELAY "$W/loadgen" relay -to "127.0.0.1:$UP_PORT" -copy splice
RELAY_PID=${PIDS[-1]}
background RELAYRW "$W/loadgen" relay -to "127.0.0.1:$UP_PORT" -copy rw -buf $((64 << 10))
RELAYRW_PID=${PIDS[-1]}
background CRELAY "$W/loadgen" relay -to "127.0.0.1:$UP_PORT" -copy splice -connect
CRELAY_PID=${PIDS[-1]}
if [ -n "$KRELAY_OK" ]; then
  background KRELAY "$W/sockmap" -to "127.0.0.1:$UP_PORT"
  KRELAY_PID=${PIDS[-1]}
fi
background DNSUP "$W/loadgen" dns -addr "$DNS"
[ "$DNSUP" = "$DNS" ] || { echo "bench resolver did not start on $DNS: $(cat "$W/bg.err")" >&2; exit 1; }

egress_prepare
PH=$(sed -n 's/^ANTHROPIC_API_KEY=//p' "$W/run/agent.env")


# start_proxy NAME PORT [KIND]: starts a fresh NAME on PORT, sets PROXY_PID.
start_proxy() {
  local port=$2 lit=() envs=()
  [ "${3:-}" = ip ] && lit=(--unsafe-bench-ip-literals)
  # cage-egress-gomaxprocs1[-icpt]: this tree's binary with GOMAXPROCS=1.
  case $1 in cage-egress-gomaxprocs1*) envs=(GOMAXPROCS=1) ;; esac
  set -- "${1/-gomaxprocs1/}" "${@:2}"
  case $1 in
    # Tunnels only: no --upstream-ca, so the system roots are not loaded
    # (they load at the first intercepted request, ~4.7 MiB; see
    # docs/performance.md).
    cage-egress|cage-egress-base) env "${envs[@]}" "$W/$1" --config "$W/egress.json" --listen-proxy 127.0.0.1:$port --resolver "$DNS" --log-level warn "${lit[@]}" 2>>"$W/egress.log" & ;;
    cage-egress-icpt|cage-egress-base-icpt) env "${envs[@]}" "$W/${1%-icpt}" --config "$W/egress.json" --listen-proxy 127.0.0.1:$port --resolver "$DNS" --upstream-ca "$W/upca/ca.crt" --log-level warn 2>>"$W/egress.log" & ;;
    squid) squid_conf "$port"; "$SQUID" -N -f "$W/squid.conf" >/dev/null 2>>"$W/squid/stderr" & ;;
    goproxy) "$W/goproxy" -listen 127.0.0.1:$port -resolver "$DNS" >/dev/null 2>&1 & ;;
    smokescreen) "$SMOKE_BIN" --listen-ip 127.0.0.1 --listen-port $port --allow-range 127.0.0.0/8 --resolver-address "$DNS" --statsd-address 127.0.0.1:9 >/dev/null 2>&1 & ;;
    mitmdump) "$MITM" --listen-host 127.0.0.1 --listen-port $port --set ssl_insecure=true --set confdir="$W/mitm" --set flow_detail=0 --set stream_large_bodies=1m -q >/dev/null 2>&1 & ;;
  esac
  PROXY_PID=$!; PIDS+=($PROXY_PID)
  wait_port "$port"
}
stop_proxy() { kill "$PROXY_PID" 2>/dev/null || true; wait "$PROXY_PID" 2>/dev/null || true; }

# proxy|destination kinds it is measured with
peers=("cage-egress|name ip")
[ -n "${BASE_EGRESS:-}" ] && peers+=("cage-egress-base|name")
[ -n "${GOMAXPROCS1:-}" ] && peers+=("cage-egress-gomaxprocs1|name")
peers+=("tcp relay splice|floor" "tcp relay rw|floor" "connect relay splice|floor")
[ -n "$KRELAY_OK" ] && peers+=("kernel sockmap relay|floor")
[ -n "$SQUID" ] && peers+=("squid|name ip")
peers+=("goproxy|name ip")
[ "$SMOKE_BIN" != none ] && peers+=("smokescreen|name ip")
[ -n "$MITM" ] && peers+=("mitmdump|ip")
if [ "${ONLY:-}" = tunnel ]; then
  peers=("cage-egress|name")
  [ -n "${BASE_EGRESS:-}" ] && peers+=("cage-egress-base|name")
  [ -n "${GOMAXPROCS1:-}" ] && peers+=("cage-egress-gomaxprocs1|name")
  peers+=("tcp relay splice|floor" "tcp relay rw|floor" "connect relay splice|floor")
  [ -n "$KRELAY_OK" ] && peers+=("kernel sockmap relay|floor")
  [ -n "$SQUID" ] && peers+=("squid|name")
fi
if [ "${ONLY:-}" = rss ]; then
  peers=("cage-egress|name")
  [ -n "${BASE_EGRESS:-}" ] && peers+=("cage-egress-base|name")
  [ -n "${GOMAXPROCS1:-}" ] && peers+=("cage-egress-gomaxprocs1|name")
fi

R="$W/results.jsonl"
lg() { "$W/loadgen" "$@" >>"$R"; }

# PROFILE=latency|bulk|keepalive|icpt: no table. One fresh cage-egress
# under that workload (the same as the table's), warmed once, then counted
# by `strace -c -f` (syscalls per tunnel or request) and sampled by `perf
# record -g` (where its CPU goes, cumulative per frame). The figures of
# docs/performance.md's "where the time goes" come from this.
if [ -n "${PROFILE:-}" ]; then
  for t in strace perf; do command -v $t >/dev/null || { echo "PROFILE needs $t (apt-get install strace linux-perf)" >&2; exit 1; }; done
  work() {
    case $PROFILE in
      latency) lg latency -label p -proxy 127.0.0.1:$PORT -target "up.bench.test:$UP_PORT" -n "$N_LAT" ;;
      bulk) lg throughput -label p -proxy 127.0.0.1:$PORT -target "up.bench.test:$UP_PORT" -bytes "$BULK" ;;
      keepalive) lg rps -label p -proxy 127.0.0.1:$PORT -target "up.bench.test:$UP_PORT" -c 8 -d "$KA_SECS" ;;
      icpt) lg rps -label p -proxy 127.0.0.1:$PORT -target "api.bench.test:$UP_PORT" -sni api.bench.test -header "x-api-key:$PH" -c "$ICPT_C" -d "$ICPT_SECS" ;;
      *) echo "PROFILE=$PROFILE: want latency, bulk, keepalive or icpt" >&2; exit 2 ;;
    esac
  }
  PORT=$((PORT + 1)); name=cage-egress; [ "$PROFILE" = icpt ] && name=cage-egress-icpt
  case ${PROFILE_OF:-cage-egress} in
    cage-egress) start_proxy "$name" "$PORT" ;;
    relay|relay-rw)
      case $PROFILE in bulk|keepalive) ;; *) echo "PROFILE_OF=$PROFILE_OF: bulk or keepalive only" >&2; exit 2 ;; esac
      PROXY_PID=$RELAY_PID; RELAY_TO=$RELAY
      [ "$PROFILE_OF" = relay-rw ] && PROXY_PID=$RELAYRW_PID RELAY_TO=$RELAYRW
      # A floor relay is the upstream as far as the client knows.
      work() {
        if [ "$PROFILE" = bulk ]; then lg throughput -label p -target "$RELAY_TO" -bytes "$BULK"
        else lg rps -label p -target "$RELAY_TO" -c 8 -d "$KA_SECS"; fi
      } ;;
    *) echo "PROFILE_OF=$PROFILE_OF: want cage-egress, relay or relay-rw" >&2; exit 2 ;;
  esac
  work
  strace -c -f -p "$PROXY_PID" -o "$W/strace.txt" 2>/dev/null & SP=$!; sleep 1; work; sleep 0.5; kill -INT $SP; wait $SP || true
  perf record -F "${PERF_FREQ:-999}" -g -p "$PROXY_PID" -o "$W/perf.data" 2>/dev/null & PP=$!; sleep 1; work; kill -INT $PP; wait $PP || true
  # PERF_DATA=/path keeps the samples (and the binary, beside them) for
  # a deeper `perf report -i /path` than the summary below.
  if [ -n "${PERF_DATA:-}" ]; then cp "$W/perf.data" "$PERF_DATA"; cp "/proc/$PROXY_PID/exe" "$PERF_DATA.bin" 2>/dev/null || true; fi
  ops=$(sed -n 2p "$R" | python3 -c 'import json, sys; print(json.load(sys.stdin).get("n") or 1)')
  echo "PROFILE=$PROFILE, load $(cut -d' ' -f1-3 /proc/loadavg); strace run: $ops operations (tunnels, requests, or 1 bulk GET)"
  echo; echo "syscalls per operation (strace -c -f; its own overhead slows the gateway, the counts are what matters):"
  awk -v ops="$ops" '$NF ~ /^[a-z_0-9]+$/ && $4 ~ /^[0-9]+$/ && $NF != "total" {printf "  %-14s %8.2f\n", $NF, $4 / ops}' "$W/strace.txt" | sort -k2 -nr | head -16
  echo; echo "perf: cumulative share of the gateway's samples per frame (user space; kernel time is inside the syscall frames):"
  perf report -i "$W/perf.data" --children --sort sym --stdio -g none 2>/dev/null | grep -E '\[\.\]' | head -45 || true  # head closes the pipe early
  echo; echo "perf: self share per symbol, kernel included (time in the kernel's context switch is a thread the gateway put to sleep and woke):"
  perf report -i "$W/perf.data" --no-children --sort sym --stdio -g none 2>/dev/null | grep -E '\[[.k]\]' | head -12 || true
  # Where the kernel time goes, cumulative (a frame's share includes what
  # it called): sending into loopback TCP (tcp_sendmsg, splice_to_socket),
  # the receive side run inline by the sender (__netif_receive_skb,
  # tcp_v4_rcv), copies, and the scheduler. In a VM without a PMU perf
  # samples on a timer, so time with interrupts off lands on the frame
  # that turns them back on (finish_task_switch, _raw_spin_unlock_irqrestore).
  echo; echo "perf: cumulative share per kernel frame:"
  perf report -i "$W/perf.data" --children --sort sym --stdio -g none 2>/dev/null | grep -E '\[k\]' | head -40 || true
  exit 0
fi
# direct SLOT: the direct figures right before one proxy's, so each ratio
# compares two runs seconds apart (the load here moves by minutes).
direct() {
  lg latency -label "direct|$1" -target "127.0.0.1:$UP_PORT" -n "$N_LAT"
  lg throughput -label "direct|$1" -target "127.0.0.1:$UP_PORT" -bytes "$BULK" -upstream-pid "$UP_PID"
  lg rps -label "direct|$1" -target "127.0.0.1:$UP_PORT" -c 8 -d "$KA_SECS" -upstream-pid "$UP_PID"
}
# icpt LABEL ARGS...: intercepted keep-alive requests through the proxy on
# $PORT, and its CPU time over them.
icpt() {
  local label=$1 c0 c1; shift
  c0=$(cpu_ticks "$PROXY_PID")
  lg rps -label "$label" -proxy 127.0.0.1:$PORT -sni api.bench.test -c "$ICPT_C" -d "$ICPT_SECS" "$@"
  c1=$(cpu_ticks "$PROXY_PID")
  echo "{\"mode\":\"cpu\",\"label\":\"$label\",\"tck\":$TCK,\"icpt\":$((c1 - c0))}" >>"$R"
  # Paired as the keep-alive figure is: time slices alternating between
  # the direct upstream and the intercepted path (PAIRED_KA=0 skips it).
  [ "$PAIRED_KA" = 0 ] || lg rps -label "$label" -proxy 127.0.0.1:$PORT -sni api.bench.test -c "$ICPT_C" -d "$ICPT_SECS" "$@" -paired "127.0.0.1:$UP_PORT"
}
for rnd in $(seq "$ROUNDS"); do
  echo "== round $rnd/$ROUNDS (load: $(cut -d' ' -f1-3 /proc/loadavg))" >&2
  echo "{\"mode\":\"load\",\"round\":$rnd,\"loadavg\":\"$(cut -d' ' -f1-3 /proc/loadavg)\"}" >>"$R"
  [ "${ONLY:-}" = icpt ] && peers=()
  # The order rotates by one row each round, so that no row is always the
  # first after a round's start or always right after the same row (two
  # builds of one tree measured 670 and 770 µs per tunnel in fixed order).
  order=()
  if [ ${#peers[@]} -gt 0 ]; then
    k=$(((rnd - 1) % ${#peers[@]}))
    order=("${peers[@]:k}" "${peers[@]:0:k}")
  fi
  for p in "${order[@]}"; do
    IFS='|' read -r name kinds <<<"$p"
    for kind in $kinds; do
      PORT=$((PORT + 1))
      target="up.bench.test:$UP_PORT"; [ "$kind" = ip ] && target="127.0.0.1:$UP_PORT"
      slot="$rnd.$name.$kind"; label="$name ($kind)|$slot"
      echo "   $name ($kind)" >&2
      if [ "${ONLY:-}" != rss ]; then
      direct "$slot"
      if [ "$kind" = floor ]; then
        # The relay is the upstream as far as the clients know.
        case $name in
          # The bare CONNECT proxy is asked for the name, as cage-egress is.
          connect*) measure "$label" "$CRELAY_PID" -proxy "$CRELAY" -target "up.bench.test:$UP_PORT" ;;
          *splice) measure "$label" "$RELAY_PID" -target "$RELAY" ;;
          kernel*) measure "$label" "$KRELAY_PID" -target "$KRELAY" ;;
          *) measure "$label" "$RELAYRW_PID" -target "$RELAYRW" ;;
        esac
        continue
      fi
      start_proxy "$name" "$PORT" "$kind"
      measure "$label" "$PROXY_PID" -proxy 127.0.0.1:$PORT -target "$target"
      stop_proxy
      [ "${ONLY:-}" = tunnel ] && continue
      fi
      # Memory on a second fresh instance: the figures above would have
      # grown its heap; this is idle, then $HOLD open tunnels.
      PORT=$((PORT + 1))
      start_proxy "$name" "$PORT" "$kind"
      sleep 1
      idle=$(rss_kib "$PROXY_PID")
      "$W/loadgen" hold -proxy 127.0.0.1:$PORT -target "$target" -n "$HOLD" >"$W/hold.out" 2>>"$W/bg.err" & HOLD_PID=$!; PIDS+=($HOLD_PID)
      for _ in $(seq 1200); do grep -q ready "$W/hold.out" 2>/dev/null && break; kill -0 $HOLD_PID 2>/dev/null || break; sleep 0.1; done
      held=0
      if grep -q ready "$W/hold.out"; then sleep 1; held=$(rss_kib "$PROXY_PID"); else echo "   $name: hold did not open $HOLD tunnels" >&2; fi
      kill $HOLD_PID 2>/dev/null || true; wait $HOLD_PID 2>/dev/null || true
      echo "{\"mode\":\"rss\",\"label\":\"$label\",\"idle_kib\":$idle,\"held_kib\":$held,\"tunnels\":$HOLD}" >>"$R"
      stop_proxy
    done
  done
  [ "${ONLY:-}" = tunnel ] || [ "${ONLY:-}" = rss ] && continue
  # Interception: cage-egress runs every inspector and injects a credential;
  # mitmdump only re-encrypts. ICPT_C keep-alive clients (8).
  lg rps -label "direct|$rnd|icpt" -target "127.0.0.1:$UP_PORT" -c "$ICPT_C" -d "$ICPT_SECS"
  PORT=$((PORT + 1)); start_proxy cage-egress-icpt "$PORT"
  icpt "cage-egress (name)|$rnd|icpt" -target "api.bench.test:$UP_PORT" -header "x-api-key:$PH"
  stop_proxy
  if [ -n "${BASE_EGRESS:-}" ]; then
    lg rps -label "direct|$rnd.b|icpt" -target "127.0.0.1:$UP_PORT" -c "$ICPT_C" -d "$ICPT_SECS"
    PORT=$((PORT + 1)); start_proxy cage-egress-base-icpt "$PORT"
    icpt "cage-egress-base (name)|$rnd.b|icpt" -target "api.bench.test:$UP_PORT" -header "x-api-key:$PH"
    stop_proxy
  fi
  if [ -n "${GOMAXPROCS1:-}" ]; then
    lg rps -label "direct|$rnd.p|icpt" -target "127.0.0.1:$UP_PORT" -c "$ICPT_C" -d "$ICPT_SECS"
    PORT=$((PORT + 1)); start_proxy cage-egress-gomaxprocs1-icpt "$PORT"
    icpt "cage-egress-gomaxprocs1 (name)|$rnd.p|icpt" -target "api.bench.test:$UP_PORT" -header "x-api-key:$PH"
    stop_proxy
  fi
  if [ -n "$MITM" ]; then
    PORT=$((PORT + 1)); start_proxy mitmdump "$PORT"
    lg rps -label "direct|$rnd.m|icpt" -target "127.0.0.1:$UP_PORT" -c "$ICPT_C" -d "$ICPT_SECS"
    icpt "mitmdump (ip)|$rnd.m|icpt" -target "127.0.0.1:$UP_PORT"
    stop_proxy
  fi
done
echo "{\"mode\":\"load_end\",\"loadavg\":\"$(cut -d' ' -f1-3 /proc/loadavg)\"}" >>"$R"
injected=$(grep -c '"secrets_injected":\["anthropic"\]' "$W/audit.jsonl" || true)
opens=$(grep -c '"event":"open"' "$W/audit.jsonl" || true)

python3 - "$R" "$injected" "$opens" "$N_LAT" "$BULK" "$KA_SECS" "$HOLD" "$(nproc)" "$PAIRED_BULK" "$PAIRED_KA" "$ICPT_C" <<'PY'
import json, sys, statistics as st
rs = [json.loads(l) for l in open(sys.argv[1])]
injected, opens, n_lat, bulk, ka, hold = sys.argv[2:8]
ncpu = int(sys.argv[8])
icpt_c = sys.argv[11]
bulk_p, ka_p = sys.argv[9:11]
loads = [r["loadavg"] for r in rs if r["mode"] == "load"]
def rows(mode, icpt=False):
    out = {}
    for r in rs:
        if r["mode"] != mode: continue
        parts = r["label"].split("|")
        if (len(parts) == 3) != icpt: continue
        out.setdefault(parts[0], {})[parts[1]] = r
    return out
lat, tp, ka_r, rss, ic = rows("latency"), rows("throughput"), rows("rps"), rows("rss"), rows("rps", True)
def ratios(table, name, key):
    # Every round's ratio of name's figure to the direct run just before it.
    d = table.get("direct", {})
    return [table[name][k][key] / d[k][key] for k in table.get(name, {}) if k in d and d[k][key]]
def ratio(table, name, key):
    v = ratios(table, name, key)
    return st.median(v) if v else None
def med(table, name, key):
    v = [r[key] for r in table.get(name, {}).values()]
    return st.median(v) if v else None
f = lambda x, s="×": "–" if x is None else f"{x:.2f}{s}"
if not lat and rss:
    # ONLY=rss: the memory rows alone.
    print(f"\nRSS of fresh proxies, {len(loads)} round(s): idle 1 s after start, then with {hold} open tunnels (median over rounds)")
    print(f"load average at the start of each round: {'; '.join(loads)}\n")
    print(f"| proxy | RSS idle | RSS with {hold} tunnels | per round (idle / {hold} tunnels) |")
    print("|---|---|---|---|")
    for name in rss:
        per = "; ".join("%.1f / %.1f" % (r["idle_kib"] / 1024, r["held_kib"] / 1024) for r in rss[name].values())
        print(f"| {name} | {med(rss,name,'idle_kib')/1024:.1f} MiB | {med(rss,name,'held_kib')/1024:.1f} MiB | {per} |")
    sys.exit(0)
if not lat:
    # ONLY=icpt: the interception rows alone.
    cpu_ic = rows("cpu", True)
    print(f"\nIntercepted requests, {len(loads)} interleaved round(s), {icpt_c} keep-alive clients; ratios to a direct run just before each (median over rounds)")
    print(f"load average at the start of each round: {'; '.join(loads)}\n")
    pic = rows("paired-rps", True)
    print("| proxy | intercepted req/s | × direct | per round | paired × direct | per round | CPU per request | per round |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| direct | {med(ic,'direct','req_per_s'):.0f} | – | – | – | – | – | – |")
    d = ic["direct"]
    for name in ic:
        if name == "direct": continue
        v = [c["icpt"] / c["tck"] / ic[name][k]["n"] for k, c in cpu_ic.get(name, {}).items() if k in ic[name] and ic[name][k]["n"]]
        rr = [ic[name][k]["req_per_s"] / d[k]["req_per_s"] for k in ic[name] if k in d and d[k]["req_per_s"]]
        pr = [r["req_per_s"] / r["direct_req_per_s"] for r in pic.get(name, {}).values() if r.get("direct_req_per_s")]
        errs = sum(r["errors"] for r in ic[name].values())
        print(f"| {name} | {med(ic,name,'req_per_s'):.0f} | {f(ratio(ic,name,'req_per_s'))} | {' '.join(f'{x:.2f}' for x in rr)} | {f(st.median(pr) if pr else None)} | {' '.join(f'{x:.2f}' for x in pr) or '–'} | {st.median(v)*1e6:.0f} µs | {' '.join(f'{x*1e6:.0f}' for x in v)} |" + (f" ({errs} errors)" if errs else ""))
    print(f"cage-egress audit: {injected} requests with an injected credential")
    sys.exit(0)
print(f"\nEgress tunnel path, {len(loads)} interleaved round(s), every proxy fresh per round; each ratio to a direct run just before it (median over rounds)")
print(f"load average at the start of each round: {'; '.join(loads)}; at the end: {'; '.join(r['loadavg'] for r in rs if r['mode'] == 'load_end')}")
print(f"{n_lat} new-tunnel GETs, one {int(bulk)>>20} MiB GET, 8 keep-alive tunnels for {ka}" + ("" if not rss else f", {hold} idle tunnels") + (f", interception with {icpt_c} clients" if ic else "") + "\n")
print("| proxy | new tunnel p50 | p99 | bulk | keep-alive req/s | RSS idle / %s tunnels | intercepted req/s |" % hold)
print("|---|---|---|---|---|---|---|")
d = lat["direct"]
icd = "–" if not ic else "%.0f" % med(ic, "direct", "req_per_s")
print(f"| direct | {med(lat,'direct','p50_us'):.0f} µs | {med(lat,'direct','p99_us'):.0f} µs | {med(tp,'direct','mb_per_s'):.0f} MiB/s | {med(ka_r,'direct','req_per_s'):.0f} | – | {icd} |")
for name in lat:
    if name == "direct": continue
    idle, held = med(rss, name, "idle_kib"), med(rss, name, "held_kib")
    mem = "–" if idle is None else f"{idle/1024:.1f} / {held/1024:.1f} MiB"
    icr = ratio(ic, name, "req_per_s") if name in ic else None
    errs = sum(r["errors"] for t in (lat, tp, ka_r) for r in t.get(name, {}).values())
    print(f"| {name} | {f(ratio(lat,name,'p50_us'))} | {f(ratio(lat,name,'p99_us'))} | {f(ratio(tp,name,'mb_per_s'))} | {f(ratio(ka_r,name,'req_per_s'))} | {mem} | {f(icr)} |" + (f" ({errs} errors)" if errs else ""))
# The paired runs: each alternates direct and proxied work in one run (new
# tunnels one by one, bulk chunks, keep-alive time slices), so each ratio
# compares two sides that met the same moments of the machine's load.
pl, ptp, pka, pic = rows("paired"), rows("paired-throughput"), rows("paired-rps"), rows("paired-rps", True)
# (table, proxied key, direct key, the first table's table and key) per column
paired = [(pl, "p50_us", "direct_p50_us", lat, "p50_us"), (pl, "p99_us", "direct_p99_us", lat, "p99_us"),
          (ptp, "mb_per_s", "direct_mb_per_s", tp, "mb_per_s"), (pka, "req_per_s", "direct_req_per_s", ka_r, "req_per_s"),
          (pic, "req_per_s", "direct_req_per_s", ic, "req_per_s")]
def pratios(table, name, key, dkey):
    return [r[key] / r[dkey] for r in table.get(name, {}).values() if r.get(dkey)]
pnames = list(dict.fromkeys(n for t in (pl, ptp, pka, pic) for n in t))
if pnames:
    what = []
    if pl: what.append(f"new tunnels one by one, every other one direct ({next(iter(next(iter(pl.values())).values()))['n']} pairs)")
    if ptp: what.append(f"{int(bulk_p) >> 20} MiB downloaded on each side in chunks alternating between a direct and a proxied keep-alive connection")
    if pka: what.append(f"8 keep-alive clients for {ka_p} on each side in time slices alternating direct and proxied")
    if pic: what.append(f"{icpt_c} intercepted keep-alive clients likewise")
    print(f"\nPaired in one run, each ratio the proxied side's figure over the direct side's of the same run (median over rounds, then every round's): {'; '.join(what)}:\n")
    print("| proxy | new tunnel p50 | p99 | bulk | keep-alive req/s | intercepted req/s | p50 per round | p99 per round | bulk per round | keep-alive per round | intercepted per round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in pnames:
        rr = [pratios(t, name, k, dk) for t, k, dk, _, _ in paired]
        errs = sum(r["errors"] for t in (pl, ptp, pka, pic) for r in t.get(name, {}).values())
        print(f"| {name} | " + " | ".join(f(st.median(v) if v else None) for v in rr) + " | " + " | ".join(" ".join(f"{x:.2f}" for x in v) or "–" for v in rr) + " |" + (f" ({errs} errors)" if errs else ""))
    # How far apart the rounds' ratios are, paired and unpaired (the
    # first table's ratios to a direct run just before): the load noise
    # the pairing takes out.
    if len(loads) > 1:
        def spread(v): return "–" if len(v) < 2 else f"{max(v) - min(v):.2f}"
        print("\nSpread of the rounds' ratios (max - min), paired / unpaired (the first table's):\n")
        print("| proxy | new tunnel p50 | p99 | bulk | keep-alive req/s | intercepted req/s |")
        print("|---|---|---|---|---|---|")
        for name in pnames:
            cells = [f"{spread(pratios(t, name, k, dk))} / {spread(ratios(ut, name, uk))}" for t, k, dk, ut, uk in paired]
            print(f"| {name} | " + " | ".join(cells) + " |")
# CPU of the proxy process per operation: ticks over a workload divided by
# what it served (tunnels, requests, GiB), median over rounds.
cpu, cpu_ic = rows("cpu"), rows("cpu", True)
def per_op(ctable, table, name, key, count):
    v = []
    for k, c in ctable.get(name, {}).items():
        r = table.get(name, {}).get(k)
        if r is None or key not in c: continue
        n = count(r)
        if n: v.append(c[key] / c["tck"] / n)
    return st.median(v) if v else None
g = lambda x, scale, unit: "–" if x is None else f"{x * scale:.0f} {unit}"
# Context switches of the proxy's threads per new tunnel (every thread
# put to sleep and woken), the count that moves least with the load.
def csw_per_tunnel(name):
    v = [c["csw_latency"] / lat[name][k]["n"] for k, c in cpu.get(name, {}).items() if "csw_latency" in c and k in lat.get(name, {}) and lat[name][k]["n"]]
    return "–" if not v else f"{st.median(v):.1f}"
print("\nCPU time of the proxy process per operation (user+system, /proc/PID/stat; median over rounds), and its threads' context switches per new tunnel:\n")
print("| proxy | per new tunnel | context switches per new tunnel | per GiB bulk | per keep-alive request | per intercepted request |")
print("|---|---|---|---|---|---|")
for name in lat:
    if name == "direct": continue
    print(f"| {name} | {g(per_op(cpu, lat, name, 'latency', lambda r: r['n']), 1e6, 'µs')} | {csw_per_tunnel(name)} | {g(per_op(cpu, tp, name, 'throughput', lambda r: int(bulk) / (1 << 30)), 1e3, 'ms')} | {g(per_op(cpu, ka_r, name, 'rps', lambda r: r['n']), 1e6, 'µs')} | {g(per_op(cpu_ic, ic, name, 'icpt', lambda r: r['n']), 1e6, 'µs')} |")
# Where a tunnel operation's CPU goes, over the measured window only: the
# two endpoints (client + upstream) and the proxy. The direct run shows how
# busy the endpoints alone keep the machine; a hop whose cost per
# operation is X (the proxy's own CPU plus what it adds to the endpoints:
# more loopback traversals, more wake-ups) caps the ratio at
# direct/(direct + X) at the direct run's busy cores, and at
# ncpu/busy × that if the proxied run kept every core busy.
def acct(table, ops):
    out = {}
    for name, slots in table.items():
        v = []
        for k, r in slots.items():
            n = ops(r)
            if "window_s" not in r or not n: continue
            v.append((k, (r["cpu_s"] + r["up_cpu_s"]) / n, r.get("proxy_cpu_s", 0) / n, (r["cpu_s"] + r["up_cpu_s"] + r.get("proxy_cpu_s", 0)) / r["window_s"]))
        if v: out[name] = v
    return out
work = [("bulk", tp, lambda r: r["mb_per_s"] * r["window_s"] / 1024, 1e3, "ms/GiB", "mb_per_s"),
        ("keep-alive", ka_r, lambda r: r["n"], 1e6, "µs/req", "req_per_s")]
if any(acct(t, o) for _, t, o, *_ in work):
    print(f"\nCPU accounting of the tunnel workloads on {ncpu} cores, over each measured window (client + upstream = endpoints; median over rounds):\n")
    print("| workload | path | endpoints CPU/op | proxy CPU/op | hop cost X/op | cores busy | cap d/(d+X) | cap, all cores busy | measured × direct |")
    print("|---|---|---|---|---|---|---|---|---|")
    for wname, table, ops, scale, unit, key in work:
        a = acct(table, ops)
        d = {k: (e, busy) for k, e, _, busy in a.get("direct", [])}
        if not d: continue
        de, db = st.median(e for e, _ in d.values()), st.median(b for _, b in d.values())
        print(f"| {wname} | direct | {de*scale:.1f} {unit} | – | – | {db:.2f} of {ncpu} | – | – | – |")
        for name, v in a.items():
            if name == "direct": continue
            xs, caps, capf, busy, es, ps = [], [], [], [], [], []
            for k, e, p, b in v:
                if k not in d: continue
                de_k, db_k = d[k]
                x = e + p - de_k
                xs.append(x); es.append(e); ps.append(p); busy.append(b)
                caps.append(de_k / (de_k + x)); capf.append(min(1, ncpu / db_k * de_k / (de_k + x)))
            if not xs: continue
            print(f"| {wname} | {name} | {st.median(es)*scale:.1f} {unit} | {st.median(ps)*scale:.1f} {unit} | {st.median(xs)*scale:.1f} {unit} | {st.median(busy):.2f} of {ncpu} | {st.median(caps):.2f}× | {st.median(capf):.2f}× | {f(ratio(table, name, key))} |")
a, b = med(ic, "cage-egress (name)", "req_per_s"), med(ic, "mitmdump (ip)", "req_per_s")
if a and b: print(f"\ncage-egress / mitmdump intercepted req/s: {a/b:.1f}×")
print(f"cage-egress audit: {opens} tunnel open records, {injected} requests with an injected credential")
PY
