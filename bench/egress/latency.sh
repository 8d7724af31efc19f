#!/usr/bin/env bash
# New-tunnel latency of cage-egress builds against the relay floor and
# squid, with what the wall-clock ratios hide: the proxy's CPU time, its
# threads' context switches and run-queue wait per tunnel, the tail of the
# latency distribution, and whether the slowest requests met a Go GC
# cycle. Rounds are interleaved, every process is fresh in every round
# (the relay too), and every ratio is to a direct run just before it.
#
#   bench/egress/latency.sh                       # this tree's cage-egress, relay, squid
#   BASE_EGRESS=/path/cage-egress bench/egress/latency.sh
#                                                 # adds the row cage-egress-base
#   SYSMON=1 bench/egress/latency.sh              # adds rows "+no-sysmon-sleep": the
#                                                 # relay and cage-egress with
#                                                 # GODEBUG=schedtrace=2147483647 (see below)
#   ROUNDS=3 N=2000                               # the defaults (~1 minute a round)
#   SYSMON=1 ROUNDS=0                             # only the idle cost of the rows
#                                                 # "+no-sysmon-sleep" (2 x IDLE_SECS=10)
#
# Each new-tunnel GET is TCP connect + CONNECT + 200 + TLS handshake + GET +
# response (loadgen latency), sequential, as in run.sh's first column.
# The workload, the upstream, the resolver and cage-egress's config are
# run.sh's (its full job: policy, resolution through the bench resolver,
# address classes, an open and a close audit record per tunnel).
#
# GODEBUG=schedtrace=2147483647 asks the Go runtime for a scheduler trace
# every 24.8 days; its effect here is that sysmon, the runtime's monitor
# thread, never parks: without it sysmon parks whenever every P is idle,
# is woken by the next system call after that and then polls every 20 µs
# until the process is idle again, which a proxy serving one request at a
# time does several times per tunnel. The rows with it show what that
# costs; it is a measurement, not a setting cage-egress uses
# (docs/performance.md, "New-tunnel latency (issue 20), fourth pass").
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# run.sh's setup and helpers, one copy: bench_init, background, wait_port,
# cpu_ticks, egress_prepare (its cage-egress config), squid_conf.
# shellcheck source=bench/egress/common.sh
. "$ROOT/bench/egress/common.sh"
bench_init egress-latency
N=${N:-2000}; ROUNDS=${ROUNDS:-3}; PORT=${PORT:-24140}
DNS=${DNS_ADDR:-127.78.$((RANDOM % 250 + 1)).53:53}

echo "== building ($(date +%T))" >&2
(cd "$ROOT" && go build -tags netgo -o "$W/cage-egress" ./cmd/cage-egress && go build -o "$W/loadgen" ./bench/egress/loadgen)
[ -n "${BASE_EGRESS:-}" ] && cp "$BASE_EGRESS" "$W/cage-egress-base"
SQUID=$(command -v squid || true)
[ -n "$SQUID" ] || echo "squid not found (apt-get install squid); skipping it" >&2

# Per process, summed over its threads: time spent runnable but waiting
# for a CPU (µs, schedstat's second field); cpu_ticks is its CPU time,
# ctx_switches its context switches (common.sh).
runq_wait_us() { cat /proc/"$1"/task/*/schedstat | awk '{s += $2} END {printf "%d", s / 1000}'; }
# stamp: prefixes each line with the wall clock, so a GC trace line can be
# lined up with loadgen's request timestamps.
stamp() { python3 -u -c 'import sys, time
for l in iter(sys.stdin.readline, ""): print("%.6f %s" % (time.time(), l), end="", flush=True)'; }

background UP "$W/loadgen" upstream -dir "$W/upca"
UP_PORT=${UP##*:}
background DNSUP "$W/loadgen" dns -addr "$DNS"
[ "$DNSUP" = "$DNS" ] || { echo "bench resolver did not start on $DNS: $(cat "$W/bg.err")" >&2; exit 1; }
egress_prepare

NOSLEEP=GODEBUG=schedtrace=2147483647
# label|kind|environment
variants=("tcp relay (floor)|relay|")
[ -n "${SYSMON:-}" ] && variants+=("tcp relay +no-sysmon-sleep|relay|$NOSLEEP")
[ -n "$SQUID" ] && variants+=("squid|squid|")
variants+=("cage-egress|cage-egress|")
[ -n "${BASE_EGRESS:-}" ] && variants+=("cage-egress-base|cage-egress-base|")
[ -n "${SYSMON:-}" ] && variants+=("cage-egress +no-sysmon-sleep|cage-egress|$NOSLEEP")

R="$W/results.jsonl"
# measure LABEL SLOT PID ARGS...: one latency run against PID's proxy.
measure() {
  local label=$1 slot=$2 pid=$3 c0 s0 q0; shift 3
  c0=$(cpu_ticks "$pid"); s0=$(ctx_switches "$pid"); q0=$(runq_wait_us "$pid")
  "$W/loadgen" latency -label "$label|$slot" -n "$N" -trace "$W/trace.$slot" "$@" >>"$R"
  echo "{\"mode\":\"cost\",\"label\":\"$label|$slot\",\"tck\":$(getconf CLK_TCK),\"cpu\":$(($(cpu_ticks "$pid") - c0)),\"csw\":$(($(ctx_switches "$pid") - s0)),\"runq_us\":$(($(runq_wait_us "$pid") - q0))}" >>"$R"
}
for rnd in $(seq "$ROUNDS"); do
  echo "== round $rnd/$ROUNDS (load: $(cut -d' ' -f1-3 /proc/loadavg))" >&2
  echo "{\"mode\":\"load\",\"loadavg\":\"$(cut -d' ' -f1-3 /proc/loadavg)\"}" >>"$R"
  i=0
  for v in "${variants[@]}"; do
    IFS='|' read -r label kind envs <<<"$v"
    i=$((i + 1)); slot="$rnd.$i"; PORT=$((PORT + 1))
    echo "   $label ($(date +%T))" >&2
    "$W/loadgen" latency -label "direct|$slot" -n "$N" -trace "$W/trace.direct.$slot" -target "127.0.0.1:$UP_PORT" >>"$R"
    case $kind in
      relay)
        env $envs "$W/loadgen" relay -addr "127.0.0.1:$PORT" -to "127.0.0.1:$UP_PORT" >"$W/relay.out" 2>>"$W/bg.err" & P=$!
        args=(-target "127.0.0.1:$PORT") ;;
      squid)
        squid_conf "$PORT"; "$SQUID" -N -f "$W/squid.conf" >/dev/null 2>>"$W/squid.err" & P=$!
        args=(-proxy "127.0.0.1:$PORT" -target "up.bench.test:$UP_PORT") ;;
      *)
        # gctrace=1 prints one line per GC cycle, stamped on arrival.
        env $envs GODEBUG="${envs#GODEBUG=}${envs:+,}gctrace=1" "$W/$kind" --config "$W/egress.json" --listen-proxy "127.0.0.1:$PORT" --resolver "$DNS" --log-level warn 2> >(stamp >"$W/gc.$slot") & P=$!
        args=(-proxy "127.0.0.1:$PORT" -target "up.bench.test:$UP_PORT") ;;
    esac
    PIDS+=($P)
    wait_port "$PORT"
    "$W/loadgen" latency -label warm -n 50 "${args[@]}" >/dev/null
    measure "$label" "$slot" "$P" "${args[@]}"
    kill "$P" 2>/dev/null || true; wait "$P" 2>/dev/null || true
  done
done
echo "{\"mode\":\"load\",\"loadavg\":\"$(cut -d' ' -f1-3 /proc/loadavg)\",\"end\":true}" >>"$R"
# SYSMON=1: what sysmon's deep sleep saves an idle gateway, the other side
# of the trade: a fresh cage-egress left idle for IDLE_SECS, with and
# without it.
if [ -n "${SYSMON:-}" ]; then
  echo "== idle cage-egress, ${IDLE_SECS:=10} s each" >&2
  for envs in "" "$NOSLEEP"; do
    PORT=$((PORT + 1))
    env $envs "$W/cage-egress" --config "$W/egress.json" --listen-proxy "127.0.0.1:$PORT" --resolver "$DNS" --log-level warn 2>>"$W/bg.err" & P=$!; PIDS+=($P)
    wait_port "$PORT"; sleep 1
    c0=$(cpu_ticks "$P"); s0=$(ctx_switches "$P"); sleep "$IDLE_SECS"
    echo "{\"mode\":\"idle\",\"label\":\"cage-egress${envs:+ +no-sysmon-sleep}\",\"tck\":$(getconf CLK_TCK),\"cpu\":$(($(cpu_ticks "$P") - c0)),\"csw\":$(($(ctx_switches "$P") - s0)),\"secs\":$IDLE_SECS}" >>"$R"
    kill "$P" 2>/dev/null || true; wait "$P" 2>/dev/null || true
  done
fi

python3 - "$W" "$N" <<'PY'
import glob, json, os, re, sys, statistics as st
W, n = sys.argv[1], sys.argv[2]
rs = [json.loads(l) for l in open(W + "/results.jsonl")]
lat, cost, order = {}, {}, []
for r in rs:
    if r["mode"] not in ("latency", "cost"): continue
    name, slot = r["label"].split("|")
    (lat if r["mode"] == "latency" else cost).setdefault(name, {})[slot] = r
    if name not in order: order.append(name)
def trace(slot, direct=False):
    return sorted(int(l.split()[1]) for l in open(f"{W}/trace.{'direct.' if direct else ''}{slot}"))
def q(v, p): return v[min(len(v) - 1, int(len(v) * p))]
loads = [r["loadavg"] for r in rs if r["mode"] == "load"]
for r in rs:
    if r["mode"] == "idle":
        print(f"idle {r['label']}: {r['cpu'] / r['tck'] * 1e3 / r['secs']:.1f} ms CPU and {r['csw'] / r['secs']:.0f} context switches per second")
if "direct" not in lat: sys.exit(0)
print(f"\nNew-tunnel latency, {len(loads) - 1} interleaved round(s), {n} sequential new-tunnel GETs per run, each process fresh per round; ratios to a direct run just before (median over rounds)")
print(f"load average at the start of each round: {'; '.join(loads[:-1])}; at the end: {loads[-1]}\n")
print("| proxy | p50 | p90 | p99 | p99.9 | p50 per round | p99 per round | CPU per tunnel | context switches per tunnel | run-queue wait per tunnel |")
print("|---|---|---|---|---|---|---|---|---|---|")
d = lat["direct"]
print(f"| direct | {st.median(r['p50_us'] for r in d.values()):.0f} µs | – | {st.median(r['p99_us'] for r in d.values()):.0f} µs | – | | | | | |")
for name in order:
    if name == "direct": continue
    slots = lat[name]
    ratio = {p: [q(trace(s), p) / q(trace(s, True), p) for s in slots] for p in (0.5, 0.9, 0.99, 0.999)}
    c = cost[name]
    cpu = st.median(c[s]["cpu"] / c[s]["tck"] / slots[s]["n"] * 1e6 for s in slots)
    csw = st.median(c[s]["csw"] / slots[s]["n"] for s in slots)
    rq = st.median(c[s]["runq_us"] / slots[s]["n"] for s in slots)
    errs = sum(r["errors"] for r in slots.values())
    print(f"| {name} | " + " | ".join(f"{st.median(ratio[p]):.2f}×" for p in (0.5, 0.9, 0.99, 0.999)) +
          f" | {' '.join(f'{x:.2f}' for x in ratio[0.5])} | {' '.join(f'{x:.2f}' for x in ratio[0.99])} | {cpu:.0f} µs | {csw:.1f} | {rq:.0f} µs |" + (f" ({errs} errors)" if errs else ""))
# GC cycles (gctrace=1, stamped on arrival: the end of the cycle) against
# the requests in flight: the share of all requests, and of the slowest
# 1%, that overlapped a cycle.
pat = re.compile(r"^([\d.]+) gc \d+ @[\d.]+s \d+%: ([\d.]+)\+([\d.]+)\+([\d.]+) ms clock")
print("\nGo GC cycles of cage-egress during each run (gctrace=1) and the requests they overlapped:\n")
print("| proxy | round | GC cycles | wall per cycle (median) | requests overlapping a cycle | of the slowest 1% |")
print("|---|---|---|---|---|---|")
for name in order:
    if name == "direct": continue
    for slot in lat.get(name, {}):
        f = f"{W}/gc.{slot}"
        if not os.path.exists(f): continue
        gcs = []
        for l in open(f):
            m = pat.match(l)
            if m:
                end, dur = float(m.group(1)) * 1e6, sum(float(m.group(i)) for i in (2, 3, 4)) * 1e3
                gcs.append((end - dur, end))
        reqs = [tuple(map(int, l.split())) for l in open(f"{W}/trace.{slot}")]
        hit = lambda s, du: any(a < s + du and s < b for a, b in gcs)
        thr = q(sorted(du for _, du in reqs), 0.99)
        slow = [r for r in reqs if r[1] >= thr]
        share = lambda rr: 100 * sum(hit(*r) for r in rr) / len(rr)
        wall = f"{st.median(b - a for a, b in gcs):.0f} µs" if gcs else "–"
        print(f"| {name} | {slot.split('.')[0]} | {len(gcs)} | {wall} | {share(reqs):.1f}% | {share(slow):.1f}% ({len(slow)} requests ≥ {thr} µs) |")
PY
