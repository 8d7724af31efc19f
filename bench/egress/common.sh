# Sourced by bench/egress/run.sh and bench/egress/latency.sh (after their
# `set -euo pipefail` and ROOT): the one copy of their setup and of the
# helpers both use. Not a script of its own.
#
#   bench_init NAME   makes the work dir $W (/tmp/NAME.XXXXXX, readable by
#                     squid's user), the PIDS list that cleanup kills on exit
#                     with the work dir, raises the descriptor limit and drops
#                     the proxy variables, so no client or peer chains to a
#                     proxy of the environment.

bench_init() {
  W=$(mktemp -d "/tmp/$1.XXXXXX")
  chmod 755 "$W"
  PIDS=()
  trap bench_cleanup EXIT
  ulimit -n 65536 2>/dev/null || ulimit -n 8192
  unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY all_proxy ALL_PROXY
}
bench_cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$W"; }

# background VAR PROG... : start PROG, remember its pid (not in a subshell, so
# cleanup sees it), set VAR to its first line of output.
background() {
  local var=$1; shift; local out="$W/bg.$var"
  "$@" >"$out" 2>>"$W/bg.err" & PIDS+=($!)
  for _ in $(seq 100); do [ -s "$out" ] && break; sleep 0.05; done
  printf -v "$var" '%s' "$(head -1 "$out")"
}
wait_port() { for _ in $(seq 200); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 did not open" >&2; return 1; }
# CPU time (user+system, clock ticks) a process has used: the gateway's own
# cost per tunnel and per request, which the load on this machine moves
# far less than it moves wall-clock figures.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# Context switches (voluntary and not) of a process, summed over its
# threads: every thread put to sleep and woken is one, the steadier count
# when the CPU time moves with the machine's load.
ctx_switches() { cat /proc/"$1"/task/*/status | awk '/ctxt_switches/ {s += $2} END {print s}'; }

# egress_prepare: cage-egress's bench config in $W/egress.json, for the
# upstream on $UP_PORT: its full job (policy by name, resolution through
# the bench resolver, address classes, audit records to $W/audit.jsonl,
# every inspector and a credential on the intercepted host, whose real
# value is a fresh random key in $W/creds); then `cage-egress prepare`
# (CA, placeholders, $W/run/agent.env) as the prep unit would.
egress_prepare() {
  mkdir -p "$W/creds"
  printf 'sk-ant-api03-%s\n' "$(head -c 60 /dev/urandom | base64 | tr -dc A-Za-z0-9 | head -c 64)" >"$W/creds/anthropic"
  export CREDENTIALS_DIRECTORY="$W/creds"
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
  "$W/cage-egress" prepare --config "$W/egress.json" >&2
}

# squid_conf PORT: squid on loopback only, no cache, no logs but its
# cache.log, no hosts file (names go to the bench resolver on $DNS), one
# process (-N), CONNECT to $UP_PORT only; written to $W/squid.conf, its
# state in $W/squid (owned by squid's user when run as root).
squid_conf() {
  mkdir -p "$W/squid"
  [ "$(id -u)" = 0 ] && chown proxy: "$W/squid" 2>/dev/null || true
  cat >"$W/squid.conf" <<CONF
http_port 127.0.0.1:$1
acl SSL_ports port $UP_PORT
acl CONNECT method CONNECT
http_access deny CONNECT !SSL_ports
http_access allow localhost
http_access deny all
cache deny all
cache_mem 0 MB
access_log none
cache_store_log none
cache_log $W/squid/cache.log
pid_filename none
coredump_dir $W/squid
netdb_filename none
hosts_file none
dns_nameservers ${DNS%:53}
max_filedescriptors 65536
shutdown_lifetime 0 seconds
CONF
}
