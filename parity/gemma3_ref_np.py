#!/usr/bin/env python3
"""An independent Gemma 3 reference in float64, from a GGUF file's weights as ggml's own Python
library (`gguf`) dequantizes them, written from the published architecture as llama.cpp runs a
`gemma3` file:

- the embedding row times sqrt(hidden) (rounded to float32, as llama.cpp's sqrtf);
- per layer: RMSNorm; Q, K, V; RMSNorm on each head of Q and of K; RoPE in the half-split
  (NeoX) layout, base 10,000 on local layers and the file's base on global ones, cosines and
  sines rounded to float32; K and V rounded to binary16 as the engine's pool stores them;
  attention scaled by 1/sqrt(query_pre_attn_scalar) over every position on a global layer
  (every 6th) and over the latest `sliding_window` positions on a local one; the output
  projection, RMSNorm, the residual; RMSNorm, GeGLU (GELU's tanh form), down, RMSNorm, the
  residual;
- the final RMSNorm and the tied embedding as the output.

The file's norm weights hold Gemma's +1 already (its converter folded it in).

    python3 parity/gemma3_ref_np.py FILE.gguf --prompts '[[2,818,5279]]' --steps 8

prints one JSON object a prompt: the greedy tokens after it, and at each step the margin
between the best and the second-best logit, and the best logit (to judge a near tie).
"""

import argparse
import json
import math

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def field(r, key):
    f = r.fields[key]
    return f.contents()


class Gemma3:
    def __init__(self, path):
        r = GGUFReader(path)
        if field(r, "general.architecture") != "gemma3":
            raise SystemExit("not a gemma3 file")
        self.h = int(field(r, "gemma3.embedding_length"))
        self.nl = int(field(r, "gemma3.block_count"))
        self.nq = int(field(r, "gemma3.attention.head_count"))
        self.nkv = int(field(r, "gemma3.attention.head_count_kv"))
        self.d = int(field(r, "gemma3.attention.key_length"))
        self.eps = float(field(r, "gemma3.attention.layer_norm_rms_epsilon"))
        self.window = int(field(r, "gemma3.attention.sliding_window"))
        theta = float(field(r, "gemma3.rope.freq_base"))
        half = self.d // 2
        self.freqs_global = np.array([theta ** (-(2.0 * i) / self.d) for i in range(half)])
        self.freqs_local = np.array([10000.0 ** (-(2.0 * i) / self.d) for i in range(half)])
        self.scale = 1.0 / math.sqrt(self.d)
        t = {}
        for ten in r.tensors:
            shape = [int(x) for x in reversed(ten.shape.tolist())]
            vals = dequantize(ten.data, ten.tensor_type).astype(np.float64)
            t[ten.name] = vals.reshape(shape)
        self.embed = t["token_embd.weight"]
        self.out_norm = t["output_norm.weight"]
        self.layers = []
        for l in range(self.nl):
            g = lambda n: t["blk.%d.%s.weight" % (l, n)]
            self.layers.append({n: g(n) for n in [
                "attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm",
                "attn_output", "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up",
                "ffn_down", "post_ffw_norm"]})

    def local(self, l):
        return (l + 1) % 6 != 0

    @staticmethod
    def rms(x, w, eps):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    def rotate(self, heads, pos, freqs):
        # heads: [n, h, d]; pos: [n]
        a = np.outer(pos, freqs)
        c = np.cos(a).astype(np.float32).astype(np.float64)[:, None, :]
        s = np.sin(a).astype(np.float32).astype(np.float64)[:, None, :]
        half = self.d // 2
        x, y = heads[..., :half], heads[..., half:]
        return np.concatenate([x * c - y * s, y * c + x * s], axis=-1)

    def forward(self, tokens, start, cache):
        """Rows for `tokens` at positions start.., appending their K and V to `cache`; returns
        the last row's logits."""
        n, d, nq, nkv = len(tokens), self.d, self.nq, self.nkv
        pos = np.arange(start, start + n)
        x = self.embed[tokens] * float(np.float32(math.sqrt(self.h)))
        for l, L in enumerate(self.layers):
            hn = self.rms(x, L["attn_norm"], self.eps)
            q = (hn @ L["attn_q"].T).reshape(n, nq, d)
            k = (hn @ L["attn_k"].T).reshape(n, nkv, d)
            v = (hn @ L["attn_v"].T).reshape(n, nkv, d)
            q = self.rms(q, L["attn_q_norm"], self.eps)
            k = self.rms(k, L["attn_k_norm"], self.eps)
            freqs = self.freqs_local if self.local(l) else self.freqs_global
            q = self.rotate(q, pos, freqs)
            k = self.rotate(k, pos, freqs)
            k16 = k.astype(np.float16).astype(np.float64)
            v16 = v.astype(np.float16).astype(np.float64)
            ks = np.concatenate([cache[l][0], k16]) if cache[l] else k16
            vs = np.concatenate([cache[l][1], v16]) if cache[l] else v16
            cache[l] = (ks, vs)
            total = ks.shape[0]
            kpos = np.arange(total)
            mask = kpos[None, :] <= pos[:, None]
            if self.local(l):
                mask &= kpos[None, :] > pos[:, None] - self.window
            group = nq // nkv
            att = np.empty((n, nq, d))
            for hq in range(nq):
                kv = hq // group
                scores = (q[:, hq, :] @ ks[:, kv, :].T) * self.scale
                scores = np.where(mask, scores, -np.inf)
                e = np.exp(scores - scores.max(axis=1, keepdims=True))
                att[:, hq, :] = (e / e.sum(axis=1, keepdims=True)) @ vs[:, kv, :]
            o = att.reshape(n, nq * d) @ L["attn_output"].T
            x = x + self.rms(o, L["post_attention_norm"], self.eps)
            hn = self.rms(x, L["ffn_norm"], self.eps)
            g = hn @ L["ffn_gate"].T
            u = hn @ L["ffn_up"].T
            gelu = 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))
            m = (gelu * u) @ L["ffn_down"].T
            x = x + self.rms(m, L["post_ffw_norm"], self.eps)
        last = self.rms(x[-1], self.out_norm, self.eps)
        return self.embed @ last


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    model = Gemma3(args.file)
    results = []
    for prompt in json.loads(args.prompts):
        cache = [None] * model.nl
        logits = model.forward(prompt, 0, cache)
        tokens, margins, tops = [], [], []
        at = len(prompt)
        for _ in range(args.steps):
            order = np.argsort(logits)[::-1]
            best = int(order[0])
            tokens.append(best)
            margins.append(float(logits[order[0]] - logits[order[1]]))
            tops.append(float(logits[order[0]]))
            logits = model.forward([best], at, cache)
            at += 1
        results.append({"tokens": tokens, "margins": margins, "top": tops})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
