#!/usr/bin/env python3
"""An independent reference of the Llama architecture, for the engine's parity test.

Written from the published architecture (RMSNorm, rotary embeddings in the half-split layout,
grouped-query attention, SwiGLU, tied or untied output), in plain Python with float64 so that
`cargo test` needs nothing installed. It reads a checkpoint directory the way a published one
is laid out (config.json, model.safetensors or shards with model.safetensors.index.json, bf16,
f16 or f32) and, like the engine's pool, rounds every K (after RoPE) and V to binary16 before
attention reads it.

    python3 parity/llama_ref.py DIR --prompts '[[1,2,3],[4,5]]' --steps 32

prints one JSON object: for each prompt, the logits at every prompt position, and the greedy
continuation of `--steps` tokens.
"""

import argparse
import json
import math
import os
import struct


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = data[base + start : base + end]
        dtype = info["dtype"]
        if dtype == "F32":
            vals = list(struct.unpack("<%df" % (len(raw) // 4), raw))
        elif dtype == "F16":
            vals = list(struct.unpack("<%de" % (len(raw) // 2), raw))
        elif dtype == "BF16":
            halves = struct.unpack("<%dH" % (len(raw) // 2), raw)
            vals = [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in halves]
        else:
            raise SystemExit("unsupported dtype %s for %s" % (dtype, name))
        out[name] = (info["shape"], vals)
    return out


def load(dir_):
    with open(os.path.join(dir_, "config.json")) as f:
        cfg = json.load(f)
    index = os.path.join(dir_, "model.safetensors.index.json")
    tensors = {}
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    for name in files:
        tensors.update(read_safetensors(os.path.join(dir_, name)))
    return cfg, tensors


def matrix(tensors, name):
    shape, vals = tensors[name]
    rows, cols = shape
    return [vals[r * cols : (r + 1) * cols] for r in range(rows)]


def vector(tensors, name):
    return tensors[name][1]


def f16(x):
    return struct.unpack("<e", struct.pack("<e", x))[0]


def matvec(m, x, bias=None):
    out = [sum(a * b for a, b in zip(row, x)) for row in m]
    if bias is not None:
        out = [o + b for o, b in zip(out, bias)]
    return out


def rms_norm(x, w, eps):
    ms = sum(v * v for v in x) / len(x)
    inv = 1.0 / math.sqrt(ms + eps)
    return [v * inv * g for v, g in zip(x, w)]


def inv_freq(cfg, d):
    theta = cfg.get("rope_theta", 10000.0)
    freqs = [theta ** (-(2.0 * i) / d) for i in range(d // 2)]
    rs = cfg.get("rope_scaling")
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        orig = rs["original_max_position_embeddings"]
        out = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < orig / high:
                out.append(f)
            elif wavelen > orig / low:
                out.append(f / factor)
            else:
                s = (orig / wavelen - low) / (high - low)
                out.append((1 - s) * f / factor + s * f)
        freqs = out
    return freqs


def rotate(head, pos, freqs):
    half = len(head) // 2
    out = list(head)
    for i in range(half):
        # The engine rounds each angle's cosine and sine to float32, as Hugging Face does.
        a = pos * freqs[i]
        c = struct.unpack("<f", struct.pack("<f", math.cos(a)))[0]
        s = struct.unpack("<f", struct.pack("<f", math.sin(a)))[0]
        x, y = head[i], head[i + half]
        out[i] = x * c - y * s
        out[i + half] = y * c + x * s
    return out


class Model:
    def __init__(self, dir_):
        cfg, t = load(dir_)
        self.cfg = cfg
        self.h = cfg["hidden_size"]
        self.nq = cfg["num_attention_heads"]
        self.nkv = cfg.get("num_key_value_heads", self.nq)
        self.d = cfg.get("head_dim") or self.h // self.nq
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.freqs = inv_freq(cfg, self.d)
        self.embed = matrix(t, "model.embed_tokens.weight")
        tied = cfg.get("tie_word_embeddings", False)
        self.lm_head = self.embed if tied else matrix(t, "lm_head.weight")
        self.norm = vector(t, "model.norm.weight")
        self.layers = []
        for l in range(cfg["num_hidden_layers"]):
            p = "model.layers.%d." % l
            bias = lambda n: vector(t, p + n) if (p + n) in t else None
            self.layers.append(
                {
                    "in": vector(t, p + "input_layernorm.weight"),
                    "post": vector(t, p + "post_attention_layernorm.weight"),
                    "q": matrix(t, p + "self_attn.q_proj.weight"),
                    "k": matrix(t, p + "self_attn.k_proj.weight"),
                    "v": matrix(t, p + "self_attn.v_proj.weight"),
                    "o": matrix(t, p + "self_attn.o_proj.weight"),
                    "qb": bias("self_attn.q_proj.bias"),
                    "kb": bias("self_attn.k_proj.bias"),
                    "vb": bias("self_attn.v_proj.bias"),
                    "gate": matrix(t, p + "mlp.gate_proj.weight"),
                    "up": matrix(t, p + "mlp.up_proj.weight"),
                    "down": matrix(t, p + "mlp.down_proj.weight"),
                }
            )

    def step(self, token, pos, cache):
        """One position through every layer, appending its f16-rounded K and V to `cache`;
        returns its logits."""
        d, nq, nkv = self.d, self.nq, self.nkv
        x = list(self.embed[token])
        for l, L in enumerate(self.layers):
            hn = rms_norm(x, L["in"], self.eps)
            q = matvec(L["q"], hn, L["qb"])
            k = matvec(L["k"], hn, L["kb"])
            v = matvec(L["v"], hn, L["vb"])
            q = sum((rotate(q[i * d : (i + 1) * d], pos, self.freqs) for i in range(nq)), [])
            k = sum((rotate(k[i * d : (i + 1) * d], pos, self.freqs) for i in range(nkv)), [])
            cache[l].append(([f16(a) for a in k], [f16(a) for a in v]))
            att = []
            group = nq // nkv
            for hq in range(nq):
                kv = hq // group
                qh = q[hq * d : (hq + 1) * d]
                scores = [
                    sum(a * b for a, b in zip(qh, kk[kv * d : (kv + 1) * d])) / math.sqrt(d)
                    for kk, _ in cache[l]
                ]
                m = max(scores)
                e = [math.exp(s - m) for s in scores]
                z = sum(e)
                out = [0.0] * d
                for w, (_, vv) in zip(e, cache[l]):
                    for i in range(d):
                        out[i] += w / z * vv[kv * d + i]
                att.extend(out)
            o = matvec(L["o"], att)
            x = [a + b for a, b in zip(x, o)]
            hn = rms_norm(x, L["post"], self.eps)
            g = matvec(L["gate"], hn)
            u = matvec(L["up"], hn)
            a = [gi / (1.0 + math.exp(-gi)) * ui for gi, ui in zip(g, u)]
            dn = matvec(L["down"], a)
            x = [p + q_ for p, q_ in zip(x, dn)]
        x = rms_norm(x, self.norm, self.eps)
        return matvec(self.lm_head, x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--steps", type=int, default=0)
    args = ap.parse_args()
    model = Model(args.dir)
    results = []
    for prompt in json.loads(args.prompts):
        cache = [[] for _ in model.layers]
        logits = [model.step(t, p, cache) for p, t in enumerate(prompt)]
        greedy = []
        last = logits[-1]
        for s in range(args.steps):
            tok = max(range(len(last)), key=lambda i: last[i])
            greedy.append(tok)
            if s + 1 < args.steps:
                last = model.step(tok, len(prompt) + s, cache)
        results.append({"logits": logits, "greedy": greedy})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
