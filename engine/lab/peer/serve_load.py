#!/usr/bin/env python3
"""The serving load of `vllm bench serve --backend openai-chat`, with its rules, stdlib only.

    python3 serve_load.py BASE_URL MODEL --concurrency 1,4,16 [--prompts-per-level 4]
        [--input-len 256] [--output-len 128] [--min-prompts 8] [--seed 0] [--pid PID]

Per concurrency C: N = max(min_prompts, prompts_per_level x C) random prompts of about
`input-len` tokens (random words, their count fitted once against the server's own
`usage.prompt_tokens`), each a streamed chat completion of `output-len` tokens with
`ignore_eos`, temperature 0, at most C in flight (a new one starts when one ends, as
`--max-concurrency` does). Prints one JSON line per level: output tokens/s over the level's
wall time, TTFT p50/p99, TPOT (time per output token after the first) p50/p99, failed requests
and their statuses, and, with `--pid`, the CPU seconds the server process used during the level.
"""

import argparse
import http.client
import json
import random
import statistics
import threading
import time
import urllib.parse

WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force"
).split()


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def cpu_seconds(pid):
    """User + system CPU seconds of a process and its threads (Linux /proc)."""
    if not pid:
        return None
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    tick = 100.0
    return (int(parts[11]) + int(parts[12])) / tick


class Client:
    def __init__(self, base, model, output_len):
        u = urllib.parse.urlparse(base)
        self.host, self.port, self.path = u.hostname, u.port, u.path.rstrip("/")
        self.model, self.output_len = model, output_len

    def body(self, text, max_tokens, stream):
        b = {
            "model": self.model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
        if stream:
            b["stream_options"] = {"include_usage": True}
        return json.dumps(b)

    def prompt_tokens(self, text):
        c = http.client.HTTPConnection(self.host, self.port, timeout=600)
        c.request("POST", self.path + "/chat/completions", self.body(text, 1, False),
                  {"content-type": "application/json"})
        r = c.getresponse()
        data = r.read()
        if r.status != 200:
            raise SystemExit(f"calibration request failed: {r.status} {data[:300]!r}")
        return json.loads(data)["usage"]["prompt_tokens"]

    def one(self, text):
        """One streamed request: (ok, status, ttft_s, latency_s, output_tokens)."""
        t0 = time.perf_counter()
        try:
            c = http.client.HTTPConnection(self.host, self.port, timeout=900)
            c.request("POST", self.path + "/chat/completions",
                      self.body(text, self.output_len, True),
                      {"content-type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                r.read()
                return (False, r.status, None, time.perf_counter() - t0, 0)
            first, chunks, usage = None, 0, None
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for ch in chunk.get("choices") or []:
                    if (ch.get("delta") or {}).get("content") or ch.get("tokens"):
                        chunks += 1
                        if first is None:
                            first = time.perf_counter()
            end = time.perf_counter()
            out = usage["completion_tokens"] if usage else chunks
            ok = first is not None and out > 0
            return (ok, 200, (first - t0) if first else None, end - t0, out)
        except Exception as e:  # a broken stream counts as a failure, named
            return (False, type(e).__name__, None, time.perf_counter() - t0, 0)


def level(client, prompts, conc, pid):
    results = []
    lock = threading.Lock()
    it = iter(prompts)

    def worker():
        while True:
            with lock:
                p = next(it, None)
            if p is None:
                return
            r = client.one(p)
            with lock:
                results.append(r)

    cpu0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu1 = cpu_seconds(pid)
    ok = [r for r in results if r[0]]
    failed = [r for r in results if not r[0]]
    ttft = [r[2] for r in ok]
    tpot = [(r[3] - r[2]) / (r[4] - 1) for r in ok if r[4] > 1]
    out_tokens = sum(r[4] for r in ok)
    ms = lambda x: None if x is None else round(x * 1000, 1)  # noqa: E731
    return {
        "concurrency": conc,
        "requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "failed_statuses": sorted({str(r[1]) for r in failed}),
        "wall_s": round(wall, 2),
        "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / wall, 2),
        "ttft_ms": {"p50": ms(pct(ttft, 0.5)), "p99": ms(pct(ttft, 0.99)),
                    "mean": ms(statistics.mean(ttft) if ttft else None)},
        "tpot_ms": {"p50": ms(pct(tpot, 0.5)), "p99": ms(pct(tpot, 0.99))},
        "server_cpu_s": None if cpu0 is None else round(cpu1 - cpu0, 2),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("model")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--prompts-per-level", type=int, default=4)
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pid", type=int, default=0)
    a = ap.parse_args()
    client = Client(a.base, a.model, a.output_len)
    rng = random.Random(a.seed)
    # Fit the word count once: the server's own count of a 200-word prompt (template included).
    probe = " ".join(rng.choice(WORDS) for _ in range(200))
    per_word = client.prompt_tokens(probe) / 200.0
    words = max(1, round(a.input_len / per_word))
    print(json.dumps({"calibration": {"tokens_per_word": round(per_word, 3), "words": words}}),
          flush=True)
    # One warm-up request, not counted.
    client.one(" ".join(rng.choice(WORDS) for _ in range(words)))
    for conc in [int(c) for c in a.concurrency.split(",")]:
        n = max(a.min_prompts, a.prompts_per_level * conc)
        prompts = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]
        print(json.dumps(level(client, prompts, conc, a.pid)), flush=True)


if __name__ == "__main__":
    main()
