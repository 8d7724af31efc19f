#!/usr/bin/env bash
# The in-kernel floor: bench/egress/run.sh's clients against a direct
# connection, the splice relay (`loadgen relay`, the "tcp relay (floor)"
# row there) and this module's sockmap relay, in interleaved rounds, a
# direct run just before each relay's. Besides the ratios it prints CPU
# time per operation of the relay process, of the upstream and the client
# (the endpoints), and of the whole machine (/proc/stat): the sockmap
# relay's work runs in softirq and in kernel workers (sk_psock_backlog),
# which no /proc/PID/stat of the relay counts.
#
#   bench/egress/sockmap/run.sh          # 3 rounds, 2000 new connections,
#                                        # 512 MiB bulk, 8 keep-alive for 5 s
#   ROUNDS=1 N_LAT=300 bench/egress/sockmap/run.sh
#   CHECK_PAUSE=1 bench/egress/sockmap/run.sh  # no table: 6 bulk GETs
#                                        # through the relay with
#                                        # -unsafe-pause-senders, each checked
#                                        # by TLS (relay.go, flow)
#   SNDBUF=$((32 << 20)) bench/egress/sockmap/run.sh  # the sockmap relay's
#                                        # sockets with a forced 32 MiB send
#                                        # buffer (any mode)
#   PROFILE=bulk bench/egress/sockmap/run.sh   # or keepalive: no table;
#                                        # `perf record -a` of the whole
#                                        # machine under that workload through
#                                        # the sockmap relay, then the splice
#                                        # relay: where every CPU's time goes
#
# Needs root (BPF sockmaps), go, python3. docs/performance.md, "In-kernel
# forwarding (sockmap)", has its figures.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
W=$(mktemp -d /tmp/sockmap-bench.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$W"; }
trap cleanup EXIT
ulimit -n 65536 2>/dev/null || true
N_LAT=${N_LAT:-2000}; BULK=${BULK:-$((512 << 20))}; ROUNDS=${ROUNDS:-3}; KA_SECS=${KA_SECS:-5s}

(cd "$ROOT" && go build -o "$W/loadgen" ./bench/egress/loadgen)
(cd "$ROOT/bench/egress/sockmap" && go build -o "$W/sockmap" .)
"$W/sockmap" -check || { echo "sockmap relay cannot run here (needs root and kernel >= 5.8 with BPF sockmap)" >&2; exit 1; }

background() {
  local var=$1; shift; local out="$W/bg.$var"
  "$@" >"$out" 2>>"$W/bg.err" & PIDS+=($!)
  for _ in $(seq 100); do [ -s "$out" ] && break; sleep 0.05; done
  printf -v "$var" '%s' "$(head -1 "$out")"
}
background UP "$W/loadgen" upstream -dir "$W/upca"; UP_PID=${PIDS[-1]}
background SPLICE "$W/loadgen" relay -to "$UP"; SPLICE_PID=${PIDS[-1]}
background SOCKMAP "$W/sockmap" -to "$UP" ${SNDBUF:+-sndbuf "$SNDBUF"}; SOCKMAP_PID=${PIDS[-1]}
if [ -n "${CHECK_PAUSE:-}" ]; then
  background PAUSING "$W/sockmap" -to "$UP" -unsafe-pause-senders; PAUSING_PID=${PIDS[-1]}
  bad=0
  for i in 1 2 3 4 5 6; do "$W/loadgen" throughput -target "$PAUSING" -bytes "$BULK" >>"$W/pause.out" 2>&1 || bad=$((bad + 1)); done
  kill "$PAUSING_PID"; wait "$PAUSING_PID" 2>/dev/null || true
  grep -h 'loadgen:' "$W/pause.out" || true
  echo "CHECK_PAUSE: $bad of 6 bulk GETs of $((BULK >> 20)) MiB failed through -unsafe-pause-senders, load $(cut -d' ' -f1-3 /proc/loadavg); the relay's counts: $(tail -1 "$W/bg.err")"
  exit 0
fi

if [ -n "${PROFILE:-}" ]; then
  command -v perf >/dev/null || { echo "PROFILE needs perf (apt-get install linux-perf)" >&2; exit 1; }
  for via in "sockmap relay|$SOCKMAP" "splice relay|$SPLICE"; do
    IFS='|' read -r name target <<<"$via"
    case $PROFILE in
      bulk) work=(throughput -target "$target" -bytes "$BULK") ;;
      keepalive) work=(rps -target "$target" -c 8 -d "$KA_SECS") ;;
      *) echo "PROFILE=$PROFILE: want bulk or keepalive" >&2; exit 2 ;;
    esac
    "$W/loadgen" "${work[@]}" >/dev/null # warm
    perf record -a -g -F 999 -o "$W/perf.data" -- "$W/loadgen" "${work[@]}" >"$W/res.json" 2>"$W/perf.err" || { cat "$W/perf.err" >&2; exit 1; }
    echo; echo "== $name, PROFILE=$PROFILE, load $(cut -d' ' -f1-3 /proc/loadavg): $(cat "$W/res.json")"
    echo "share of all samples per command (both CPUs; idle is swapper):"
    perf report -i "$W/perf.data" --sort comm --stdio -g none 2>/dev/null | grep -E '^ +[0-9]' | head -8 || true
    # Delayed-work timers armed: sk_psock_backlog re-queues itself one
    # jiffy later whenever the peer's send buffer is full (-EAGAIN), and a
    # write-space wake-up cannot shorten that delay. One more run, counted.
    fn=$(awk '$3 == "delayed_work_timer_fn" {print $1; exit}' /proc/kallsyms)
    perf stat -a -x, -e timer:timer_start --filter "function == 0x$fn" -o "$W/stat.txt" -- "$W/loadgen" "${work[@]}" >"$W/res2.json" 2>/dev/null || true
    echo "delayed-work timers armed on all CPUs in a second run ($(cat "$W/res2.json")): $(grep timer_start "$W/stat.txt" | cut -d, -f1)"
    echo "self share per kernel/user symbol, top 25:"
    perf report -i "$W/perf.data" --no-children --sort comm,sym --stdio -g none 2>/dev/null | grep -E '^ +[0-9]' | head -25 || true
  done
  exit 0
fi
TCK=$(getconf CLK_TCK)
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# All CPUs' busy time (user, nice, system, irq, softirq, steal).
busy() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }
# kids FILE: the CPU time of the shell's waited-for children that `times`
# wrote to FILE (run in this shell, not a subshell), in ticks.
kids() { tail -1 "$1" | awk -v t="$TCK" '{ s = 0; for (i = 1; i <= 2; i++) { split($i, a, "m"); s += a[1] * 60 + a[2] } print int(s * t + 0.5) }'; }
R="$W/results.jsonl"
# one LABEL RELAYPID WORKLOAD ARGS...: one client run with the CPU it cost.
one() {
  local label=$1 rpid=$2 mode=$3 r0 u0 k0 b0; shift 3
  r0=0; [ "$rpid" != - ] && r0=$(ticks "$rpid"); u0=$(ticks "$UP_PID"); times >"$W/t0"; b0=$(busy)
  "$W/loadgen" "$mode" -label "$label" "$@" >>"$R"
  times >"$W/t1"
  local r1=0; [ "$rpid" != - ] && r1=$(ticks "$rpid")
  echo "{\"mode\":\"cpu_$mode\",\"label\":\"$label\",\"tck\":$TCK,\"relay\":$((r1 - r0)),\"upstream\":$(($(ticks "$UP_PID") - u0)),\"client\":$(($(kids "$W/t1") - $(kids "$W/t0"))),\"machine\":$(($(busy) - b0))}" >>"$R"
}
measure() {
  local label=$1 rpid=$2 target=$3
  one "$label" "$rpid" latency -target "$target" -n "$N_LAT"
  one "$label" "$rpid" throughput -target "$target" -bytes "$BULK"
  one "$label" "$rpid" rps -target "$target" -c 8 -d "$KA_SECS"
}
for rnd in $(seq "$ROUNDS"); do
  echo "{\"mode\":\"load\",\"loadavg\":\"$(cut -d' ' -f1-3 /proc/loadavg)\"}" >>"$R"
  echo "== round $rnd/$ROUNDS (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
  measure "direct|$rnd.s" - "$UP"
  measure "tcp relay (splice)|$rnd.s" "$SPLICE_PID" "$SPLICE"
  measure "direct|$rnd.k" - "$UP"
  measure "kernel sockmap relay|$rnd.k" "$SOCKMAP_PID" "$SOCKMAP"
done
echo "{\"mode\":\"load_end\",\"loadavg\":\"$(cut -d' ' -f1-3 /proc/loadavg)\"}" >>"$R"
kill "$SOCKMAP_PID"; wait "$SOCKMAP_PID" 2>/dev/null || true
echo "sockmap relay's own counts (tcp_info and the verdict program's): $(tail -1 "$W/bg.err")"

python3 - "$R" "$BULK" <<'PY'
import json, sys, statistics as st
rs = [json.loads(l) for l in open(sys.argv[1])]
bulk = int(sys.argv[2])
print(f"\nload average at the start of each round: {'; '.join(r['loadavg'] for r in rs if r['mode'] == 'load')}; at the end: {rs[-1]['loadavg']}\n")
t = {}
for r in rs:
    if "label" not in r: continue
    name, slot = r["label"].split("|")
    t.setdefault(r["mode"], {}).setdefault(name, {})[slot] = r
def ratio(mode, key, name):
    d = t[mode]["direct"]
    v = [r[key] / d[k][key] for k, r in t[mode][name].items() if k in d]
    return st.median(v), v
med = lambda mode, key, name: st.median(r[key] for r in t[mode][name].values())
print("| path | new conn p50 | p99 | bulk | keep-alive req/s |")
print("|---|---|---|---|---|")
print(f"| direct | {med('latency','p50_us','direct'):.0f} µs | {med('latency','p99_us','direct'):.0f} µs | {med('throughput','mb_per_s','direct'):.0f} MiB/s | {med('rps','req_per_s','direct'):.0f} |")
for name in t["latency"]:
    if name == "direct": continue
    cells = []
    for mode, key in (("latency", "p50_us"), ("latency", "p99_us"), ("throughput", "mb_per_s"), ("rps", "req_per_s")):
        m, v = ratio(mode, key, name)
        cells.append(f"{m:.2f}× ({' '.join(f'{x:.2f}' for x in v)})")
    print(f"| {name} | " + " | ".join(cells) + " |")
print("\nCPU time per operation (user+system ticks; median over rounds): the relay process, the two endpoints, and all CPUs of the machine (/proc/stat, softirq and kernel workers included)\n")
print("| path | per new connection: relay / upstream / client / machine | per GiB bulk | per keep-alive request |")
print("|---|---|---|---|")
ops = {"latency": lambda r: r["n"], "throughput": lambda r: bulk / (1 << 30), "rps": lambda r: r["n"]}
scale = {"latency": (1e6, "µs"), "throughput": (1e3, "ms"), "rps": (1e6, "µs")}
for name in t["latency"]:
    cells = []
    for mode in ("latency", "throughput", "rps"):
        cs = t["cpu_" + mode][name]
        parts = []
        for who in ("relay", "upstream", "client", "machine"):
            v = [c[who] / c["tck"] / ops[mode](t[mode][name][k]) for k, c in cs.items()]
            parts.append(f"{st.median(v) * scale[mode][0]:.0f}")
        cells.append(" / ".join(parts) + " " + scale[mode][1])
    print(f"| {name} | " + " | ".join(cells) + " |")
PY
