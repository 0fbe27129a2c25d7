#!/usr/bin/env bash
# The gateway's CPU per streamed token (and the two decode engines'): `tl gateway` and 1 prefill + 2 decode `tl engine`s as
# processes on loopback (the fake model, no simulated cost, so the engines are never the
# bound), loaded by `tl bench serve --target`; the gateway's user+system time from /proc over
# the tokens the clients received.
#   engine/lab/scripts/gateway_cpu.sh [TL] [REQUESTS] [MAX_TOKENS] [CLIENTS]
set -euo pipefail
TL=${1:-target/release/tl}
REQUESTS=${2:-400}
MAX_TOKENS=${3:-128}
CLIENTS=${4:-8}
dir=$(mktemp -d)
cleanup() { for f in "$dir"/*.pid; do kill "$(cat "$f")" 2>/dev/null || true; done; rm -rf "$dir"; }
trap cleanup EXIT

# Starts "$@" in the background (its pid in $dir/NAME.pid); waits for its one `listening` line, printed to stdout.
start() {
  local name=$1; shift
  "$@" >"$dir/$name.out" 2>"$dir/$name.log" &
  echo $! >"$dir/$name.pid"
  for _ in $(seq 200); do
    [ -s "$dir/$name.out" ] && break
    sleep 0.05
  done
  head -1 "$dir/$name.out"
}
field() { python3 -c "import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$1" "$2"; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

printf '[gateway]\npublic_unauthenticated = true\nunauthenticated_admin = true\n' >"$dir/gw.toml"
gw_line=$(start gateway "$TL" gateway --config "$dir/gw.toml" \
  --http-listen 127.0.0.1:0 --registry-listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0)
gw_pid=$(cat "$dir/gateway.pid")
http=$(field "$gw_line" http)
registry=$(field "$gw_line" registry)
for e in P:prefill D1:decode D2:decode; do
  id=${e%%:*}; role=${e##*:}
  printf '[engine]\nid = "%s"\nrole = "%s"\ngateway_registry = "%s"\nheartbeat_ms = 200\ngrpc_listen = "127.0.0.1:0"\nkv_listen = "127.0.0.1:0"\nhttp_listen = "127.0.0.1:0"\nmetrics_listen = "127.0.0.1:0"\n\n[model]\ndecode_us_per_seq = 0\nprefill_us_per_token = 0\n' \
    "$id" "$role" "$registry" >"$dir/$id.toml"
  start "$id" "$TL" engine --config "$dir/$id.toml" >/dev/null
done
sleep 1.5 # two heartbeats: every engine listed
# A warm-up, then the measured load.
"$TL" bench serve --json --target "$http" --requests 32 --clients "$CLIENTS" \
  --max-tokens "$MAX_TOKENS" --short-tokens 16 --long-fraction 0 >/dev/null
decoders() { echo $(( $(cpu_ticks "$(cat "$dir/D1.pid")") + $(cpu_ticks "$(cat "$dir/D2.pid")") )); }
before=$(cpu_ticks "$gw_pid")
d_before=$(decoders)
t0=$(date +%s.%N)
out=$("$TL" bench serve --json --target "$http" --requests "$REQUESTS" --clients "$CLIENTS" \
  --max-tokens "$MAX_TOKENS" --short-tokens 16 --long-fraction 0)
t1=$(date +%s.%N)
after=$(cpu_ticks "$gw_pid")
d_after=$(decoders)
hz=$(getconf CLK_TCK)
python3 - "$out" "$before" "$after" "$hz" "$t0" "$t1" "$REQUESTS" "$MAX_TOKENS" "$d_before" "$d_after" <<'PY'
import json, sys
out = json.loads(sys.argv[1]); before, after, hz = map(float, sys.argv[2:5]); t0, t1 = map(float, sys.argv[5:7])
requests, max_tokens = int(sys.argv[7]), int(sys.argv[8])
d_cpu = (float(sys.argv[10]) - float(sys.argv[9])) / hz
tokens = requests * max_tokens
cpu = (after - before) / hz
print(json.dumps({"gateway_cpu_s": round(cpu, 3), "tokens": tokens, "wall_s": round(t1 - t0, 3),
                  "gateway_cpu_us_per_token": round(cpu / tokens * 1e6, 2),
                  "gateway_cores": round(cpu / (t1 - t0), 3),
                  "decode_engines_cpu_us_per_token": round(d_cpu / tokens * 1e6, 2), "load": out}))
PY
