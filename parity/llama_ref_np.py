#!/usr/bin/env python3
"""The numpy path of the independent Llama reference (`llama_ref.py`), for models too large for
pure Python: the same published architecture (RMSNorm, rotary embeddings in the half-split
layout with float32-rounded cosines and sines, grouped-query attention over K and V rounded to
binary16 as the engine's pool stores them, SwiGLU, tied or untied output), computed in float64.

    python3 parity/llama_ref_np.py DIR --prompts '[[1,2,3]]'

prints one JSON object: for each prompt, the logits at every prompt position.
"""

import argparse
import json
import math
import os
import struct

import numpy as np


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
        raw = np.frombuffer(data, dtype=np.uint8, count=end - start, offset=base + start)
        dtype = info["dtype"]
        if dtype == "F32":
            vals = raw.view("<f4").astype(np.float64)
        elif dtype == "F16":
            vals = raw.view("<f2").astype(np.float64)
        elif dtype == "BF16":
            vals = (raw.view("<u2").astype(np.uint32) << 16).view("<f4").astype(np.float64)
        else:
            raise SystemExit(f"{name}: dtype {dtype} is not read here")
        out[name] = vals.reshape(info["shape"])
    return out


def load(dir_):
    with open(os.path.join(dir_, "config.json")) as f:
        cfg = json.load(f)
    index = os.path.join(dir_, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    t = {}
    for name in files:
        t.update(read_safetensors(os.path.join(dir_, name)))
    return cfg, t


def rms_norm(x, w, eps):
    return x / math.sqrt(float(np.mean(x * x)) + eps) * w


class Model:
    def __init__(self, dir_):
        cfg, t = load(dir_)
        self.h = cfg["hidden_size"]
        self.nq = cfg["num_attention_heads"]
        self.nkv = cfg.get("num_key_value_heads", self.nq)
        self.d = cfg.get("head_dim") or self.h // self.nq
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        theta = cfg.get("rope_theta", 10000.0)
        self.freqs = np.array([theta ** (-(2.0 * i) / self.d) for i in range(self.d // 2)])
        if cfg.get("rope_scaling"):
            raise SystemExit("rope_scaling is not read by the numpy path")
        self.embed = t["model.embed_tokens.weight"]
        tied = cfg.get("tie_word_embeddings", False)
        self.lm_head = self.embed if tied else t["lm_head.weight"]
        self.norm = t["model.norm.weight"]
        self.layers = []
        for l in range(cfg["num_hidden_layers"]):
            p = "model.layers.%d." % l
            g = lambda n: t.get(p + n)
            self.layers.append({k: g(n) for k, n in [
                ("in", "input_layernorm.weight"), ("post", "post_attention_layernorm.weight"),
                ("q", "self_attn.q_proj.weight"), ("k", "self_attn.k_proj.weight"),
                ("v", "self_attn.v_proj.weight"), ("o", "self_attn.o_proj.weight"),
                ("qb", "self_attn.q_proj.bias"), ("kb", "self_attn.k_proj.bias"),
                ("vb", "self_attn.v_proj.bias"), ("gate", "mlp.gate_proj.weight"),
                ("up", "mlp.up_proj.weight"), ("down", "mlp.down_proj.weight")]})

    def rotate(self, heads, pos):
        a = pos * self.freqs
        c = np.cos(a).astype(np.float32).astype(np.float64)
        s = np.sin(a).astype(np.float32).astype(np.float64)
        half = self.d // 2
        x, y = heads[:, :half], heads[:, half:]
        return np.concatenate([x * c - y * s, y * c + x * s], axis=1)

    def step(self, token, pos, cache):
        d, nq, nkv = self.d, self.nq, self.nkv
        x = self.embed[token].copy()
        for l, L in enumerate(self.layers):
            hn = rms_norm(x, L["in"], self.eps)
            q = L["q"] @ hn + (L["qb"] if L["qb"] is not None else 0)
            k = L["k"] @ hn + (L["kb"] if L["kb"] is not None else 0)
            v = L["v"] @ hn + (L["vb"] if L["vb"] is not None else 0)
            q = self.rotate(q.reshape(nq, d), pos)
            k = self.rotate(k.reshape(nkv, d), pos)
            k16 = k.astype(np.float16).astype(np.float64)
            v16 = v.reshape(nkv, d).astype(np.float16).astype(np.float64)
            cache[l].append((k16, v16))
            ks = np.stack([kk for kk, _ in cache[l]])  # [t, nkv, d]
            vs = np.stack([vv for _, vv in cache[l]])
            group = nq // nkv
            att = np.empty((nq, d))
            for hq in range(nq):
                kv = hq // group
                scores = ks[:, kv, :] @ q[hq] / math.sqrt(d)
                e = np.exp(scores - scores.max())
                att[hq] = (e / e.sum()) @ vs[:, kv, :]
            x = x + L["o"] @ att.reshape(-1)
            hn = rms_norm(x, L["post"], self.eps)
            g = L["gate"] @ hn
            u = L["up"] @ hn
            x = x + L["down"] @ (g / (1.0 + np.exp(-g)) * u)
        return self.lm_head @ rms_norm(x, self.norm, self.eps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--prompts", required=True)
    args = ap.parse_args()
    model = Model(args.dir)
    results = []
    for prompt in json.loads(args.prompts):
        cache = [[] for _ in model.layers]
        logits = [model.step(t, p, cache).tolist() for p, t in enumerate(prompt)]
        results.append({"logits": logits})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
