#!/usr/bin/env bash
# Egress gateway benchmarks: cage-egress against direct connections and peers
# (tinyproxy, stripe/smokescreen if it builds, mitmproxy's mitmdump), all on
# loopback against the same upstream, in one run so ratios are comparable.
#
#   bench/egress/run.sh            # full run (~7 minutes: tinyproxy takes ~90 ms
#                                  # per new tunnel here, 2000 of them)
#   QUICK=1 bench/egress/run.sh    # smaller counts
#
# Needs: go, tinyproxy, mitmdump (Debian: apt-get install tinyproxy mitmproxy),
# python3. smokescreen is fetched with `go install` into a temp GOBIN; set
# SMOKESCREEN=/path/to/binary to reuse one, or SMOKESCREEN=none to skip.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
W=$(mktemp -d /tmp/egress-bench.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$W"; }
trap cleanup EXIT
ulimit -n 65536 2>/dev/null || ulimit -n 8192

N_LAT=${N_LAT:-2000}; BULK=${BULK:-$((512 << 20))}; ROUNDS=${ROUNDS:-5}; RPS_SECS=${RPS_SECS:-10s}; HOLD=${HOLD:-1000}
if [ -n "${QUICK:-}" ]; then N_LAT=300; BULK=$((256 << 20)); ROUNDS=3; RPS_SECS=3s; fi
P_CAGE=${P_CAGE:-23128}; P_TINY=${P_TINY:-23129}; P_SMOKE=${P_SMOKE:-23130}; P_MITM=${P_MITM:-23131}; P_RSS=${P_RSS:-23132}

echo "== building" >&2
(cd "$ROOT" && go build -o "$W/cage-egress" ./cmd/cage-egress && go build -o "$W/loadgen" ./bench/egress/loadgen)
SMOKE_BIN=${SMOKESCREEN:-}
if [ -z "$SMOKE_BIN" ]; then
  if (cd "$W" && GOBIN="$W/bin" GOFLAGS=-mod=mod go install github.com/stripe/smokescreen@latest) >"$W/smoke-build.log" 2>&1; then
    SMOKE_BIN="$W/bin/smokescreen"
  else
    echo "smokescreen did not build; skipping it (see log)" >&2; SMOKE_BIN=none
  fi
fi

# background VAR PROG... : start PROG, remember its pid (not in a subshell, so
# cleanup sees it), set VAR to its first line of output.
background() {
  local var=$1; shift; local out="$W/bg.$var"
  "$@" >"$out" 2>>"$W/bg.err" & PIDS+=($!)
  for _ in $(seq 100); do [ -s "$out" ] && break; sleep 0.05; done
  printf -v "$var" '%s' "$(head -1 "$out")"
}
wait_port() { for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 did not open" >&2; return 1; }
rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }

background UP "$W/loadgen" upstream -dir "$W/upca"
UP_PORT=${UP##*:}
background DNS "$W/loadgen" dns

mkdir -p "$W/creds"
printf 'sk-ant-api03-%s\n' "$(head -c 60 /dev/urandom | base64 | tr -dc A-Za-z0-9 | head -c 64)" >"$W/creds/anthropic"
cat >"$W/egress.json" <<JSON
{
  "schema": 1, "agent": "bench",
  "policy": {
    "name": "bench", "allow": ["*.bench.test"], "deny": [], "ports": [$UP_PORT],
    "inspect": ["api.bench.test"],
    "rate_limit": {"per_second": 0, "burst": 0},
    "inspectors": [
      {"name": "real_values", "action": "block"},
      {"name": "secret_patterns", "action": "block"},
      {"name": "body_size", "action": "flag", "max_bytes": 1048576},
      {"name": "entropy", "action": "flag"},
      {"name": "encoded_blobs", "action": "flag", "min_length": 512}
    ],
    "limits": {"max_tunnels": 4096, "max_header_bytes": 65536, "max_body_bytes": 33554432, "idle_timeout_seconds": 300},
    "dns": {"enabled": true, "deny_types": ["ANY"], "max_label_length": 63},
    "unsafe_allow_loopback_upstreams": true, "unsafe_allow_private_upstreams": false
  },
  "secrets": [{"name": "anthropic", "env": "ANTHROPIC_API_KEY", "hosts": ["api.bench.test"], "header": "x-api-key"}],
  "audit_file": "$W/audit.jsonl", "placeholder_file": "$W/run/placeholders.json",
  "agent_env_file": "$W/run/agent.env", "resolv_conf": "$W/run/resolv.conf", "ca_dir": "$W/ca"
}
JSON
export CREDENTIALS_DIRECTORY="$W/creds"
"$W/cage-egress" prepare --config "$W/egress.json" >&2
PH=$(sed -n 's/^ANTHROPIC_API_KEY=//p' "$W/run/agent.env")

"$W/cage-egress" --config "$W/egress.json" --listen-proxy 127.0.0.1:$P_CAGE --resolver "$DNS" --upstream-ca "$W/upca/ca.crt" --log-level warn 2>>"$W/egress.log" & PIDS+=($!)
cat >"$W/tinyproxy.conf" <<CONF
Port $P_TINY
Listen 127.0.0.1
Timeout 600
MaxClients 4096
LogLevel Critical
CONF
tinyproxy -d -c "$W/tinyproxy.conf" >/dev/null 2>&1 & PIDS+=($!)
mitmdump --listen-host 127.0.0.1 --listen-port $P_MITM --set ssl_insecure=true --set confdir="$W/mitm" --set flow_detail=0 -q >/dev/null 2>&1 & PIDS+=($!)
if [ "$SMOKE_BIN" != none ]; then
  "$SMOKE_BIN" --listen-ip 127.0.0.1 --listen-port $P_SMOKE --allow-range 127.0.0.0/8 --resolver-address "$DNS" --statsd-address 127.0.0.1:9 >/dev/null 2>&1 & PIDS+=($!)
fi
for p in $P_CAGE $P_TINY $P_MITM; do wait_port $p; done
[ "$SMOKE_BIN" != none ] && wait_port $P_SMOKE

R="$W/results.jsonl"
lg() { "$W/loadgen" "$@" >>"$R"; }
# Tinyproxy and mitmdump resolve with the system resolver, so they get the
# upstream as 127.0.0.1 (no DNS lookup: slightly favours them); cage-egress
# and smokescreen resolve up.bench.test through the fake resolver.
peers=("direct||127.0.0.1:$UP_PORT" "cage-egress|127.0.0.1:$P_CAGE|up.bench.test:$UP_PORT" "tinyproxy|127.0.0.1:$P_TINY|127.0.0.1:$UP_PORT")
[ "$SMOKE_BIN" != none ] && peers+=("smokescreen|127.0.0.1:$P_SMOKE|up.bench.test:$UP_PORT")

echo "== tunnel latency: $N_LAT requests, each on a new tunnel (TCP+CONNECT+TLS+GET)" >&2
for p in "${peers[@]}"; do IFS='|' read -r name proxy target <<<"$p"; lg latency -label "$name" -proxy "$proxy" -target "$target" -n "$N_LAT"; done
echo "== tunnel throughput: $BULK bytes, $ROUNDS interleaved rounds, median" >&2
for _ in $(seq "$ROUNDS"); do
  for p in "${peers[@]}"; do IFS='|' read -r name proxy target <<<"$p"; lg throughput -label "$name" -proxy "$proxy" -target "$target" -bytes "$BULK"; done
done
echo "== intercepted requests: keep-alive HTTP/1.1, 1 and 32 clients, $RPS_SECS each" >&2
for c in 1 32; do
  lg rps -label "direct c=$c" -target "127.0.0.1:$UP_PORT" -c $c -d "$RPS_SECS"
  lg rps -label "cage-egress c=$c" -proxy 127.0.0.1:$P_CAGE -target "api.bench.test:$UP_PORT" -sni api.bench.test -header "x-api-key:$PH" -c $c -d "$RPS_SECS"
  lg rps -label "mitmdump c=$c" -proxy 127.0.0.1:$P_MITM -target "127.0.0.1:$UP_PORT" -sni api.bench.test -c $c -d "$RPS_SECS"
done
injected=$(grep -c '"secrets_injected":\["anthropic"\]' "$W/audit.jsonl" || true)

echo "== memory: fresh gateway idle, then holding $HOLD tunnels" >&2
"$W/cage-egress" --config "$W/egress.json" --listen-proxy 127.0.0.1:$P_RSS --resolver "$DNS" --log-level warn 2>>"$W/egress.log" & RSS_PID=$!; PIDS+=($RSS_PID)
wait_port $P_RSS; sleep 1
IDLE=$(rss_kib $RSS_PID)
"$W/loadgen" hold -proxy 127.0.0.1:$P_RSS -target "up.bench.test:$UP_PORT" -n "$HOLD" >"$W/hold.out" 2>>"$W/bg.err" & HOLD_PID=$!; PIDS+=($HOLD_PID)
for _ in $(seq 600); do grep -q ready "$W/hold.out" 2>/dev/null && break; sleep 0.1; done
grep -q ready "$W/hold.out" || { echo "hold did not open $HOLD tunnels" >&2; cat "$W/bg.err" >&2; exit 1; }
sleep 1
HELD=$(rss_kib $RSS_PID)
echo "{\"mode\":\"rss\",\"idle_kib\":$IDLE,\"held_kib\":$HELD,\"tunnels\":$HOLD,\"injected_requests\":$injected}" >>"$R"

python3 - "$R" <<'PY'
import json, sys, statistics
rs = [json.loads(l) for l in open(sys.argv[1])]
by = lambda mode: [r for r in rs if r["mode"] == mode]
lat = {r["label"]: r for r in by("latency")}
d = lat["direct"]
print("\nTunnel request latency (new tunnel per request; lower is better)")
print(f"{'':14}{'p50 us':>10}{'p99 us':>10}{'p50 x direct':>14}{'errors':>8}")
for k, r in lat.items():
    print(f"{k:14}{r['p50_us']:>10.0f}{r['p99_us']:>10.0f}{r['p50_us']/d['p50_us']:>14.2f}{r['errors']:>8}")
tp = {}
for r in by("throughput"): tp.setdefault(r["label"], []).append(r["mb_per_s"])
print(f"\nTunnel bulk throughput (one tunnel, median of {len(tp['direct'])} interleaved rounds)")
print(f"{'':14}{'MiB/s':>10}{'x direct':>10}")
dm = statistics.median(tp["direct"])
for k, v in tp.items():
    m = statistics.median(v); print(f"{k:14}{m:>10.0f}{m/dm:>10.2f}")
print("\nTLS-intercepted requests (keep-alive; cage-egress runs all inspectors and injects a credential)")
print(f"{'':20}{'req/s':>10}{'p50 us':>10}{'p99 us':>10}{'errors':>8}")
rps = {r["label"]: r for r in by("rps")}
for k, r in rps.items():
    print(f"{k:20}{r['req_per_s']:>10.0f}{r['p50_us']:>10.0f}{r['p99_us']:>10.0f}{r['errors']:>8}")
for c in (1, 32):
    a, b = rps.get(f"cage-egress c={c}"), rps.get(f"mitmdump c={c}")
    if a and b and b["req_per_s"]:
        print(f"cage-egress / mitmdump req/s at c={c}: {a['req_per_s']/b['req_per_s']:.1f}x")
m = by("rss")[0]
print(f"\nRSS: idle {m['idle_kib']/1024:.1f} MiB; with {m['tunnels']} open tunnels {m['held_kib']/1024:.1f} MiB")
print(f"(requests with an injected credential in the audit log: {m['injected_requests']})")
PY
