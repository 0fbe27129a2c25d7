#!/usr/bin/env python3
"""Time to first token and decode rate of one streamed chat completion through an OpenAI
endpoint (stdlib only): prints one JSON line.

    python3 serve_stream.py http://127.0.0.1:8000/v1 MODEL [--max-tokens 64] [--runs 5]
"""

import argparse
import http.client
import json
import statistics
import time
import urllib.parse


def one(base, model, max_tokens):
    u = urllib.parse.urlparse(base)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    body = json.dumps({
        "model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell me about the history of Paris."}],
    })
    t0 = time.perf_counter()
    c.request("POST", u.path + "/chat/completions", body, {"content-type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    first = None
    tokens = 0
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for ch in chunk["choices"]:
            n = len(ch.get("tokens") or [])
            if n and first is None:
                first = time.perf_counter()
            tokens += n
    end = time.perf_counter()
    return first - t0, (tokens - 1) / (end - first), tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("model")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    one(a.base, a.model, 4)  # warm-up
    runs = [one(a.base, a.model, a.max_tokens) for _ in range(a.runs)]
    print(json.dumps({
        "ttft_ms": [round(r[0] * 1e3, 1) for r in runs],
        "decode_tokens_per_s": [round(r[1], 1) for r in runs],
        "ttft_ms_median": round(statistics.median(r[0] for r in runs) * 1e3, 1),
        "decode_tokens_per_s_median": round(statistics.median(r[1] for r in runs), 1),
        "tokens": runs[0][2],
    }))


if __name__ == "__main__":
    main()
