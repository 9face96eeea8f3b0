"""A/B of the decode step of a DeepSeek (MLA) or GPT-OSS model in one process: the compiled
paths of docs/performance.md change 29 (A) against the NumPy / Python forms they replaced
(B), alternating step by step (and which of the two goes first: the first to reach a page
of the mapping pays its fault) so both see the same machine load.

    python scripts/decode_ab.py MODEL.colibri [--threads 1,2] [--depth 0] [--steps 24] [--mlock]

(--mlock locks the mapping in memory first: no page faults when the page cache is under
pressure from other processes.)

B, reproduced here: DeepSeek's absorbed attention as two batched matmuls over kv_b widened
to float32 plus NumPy scores / softmax over the widened cache; GPT-OSS's experts as the loop
of prepared linears (BiasedExperts.reference) and its sinks as the compiled attention
followed by a NumPy rescale over the visible keys. Prints the median step time of each, the
ratio, the largest logit difference between A and B, and the machine's load.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

import colibri
from colibri import attention, kernels, mla, moe
from colibri.kv_cache import to_f32


def numpy_absorbed(self, q, q_rope, c, k_rope, cache, layer, out):
    """The absorbed attention as MLA ran it before change 29 (kv_b widened to f32)."""
    if not hasattr(self, "_ab_w"):
        H, Dn = self.n_heads, self.nope_dim
        w = kernels.dequantize(self.kv_b).reshape(H, Dn + self.v_dim, self.kv_rank)
        self._ab_w = np.ascontiguousarray(w[:, :Dn]), np.ascontiguousarray(w[:, Dn:])
    w_kt, w_v = self._ab_w
    lat, rot = cache.write_one(layer, c, k_rope)
    lat, rot = lat[0], rot[0]
    q_lat = np.matmul(q[:, None, :self.nope_dim], w_kt)[:, 0]
    scores = q_lat @ lat.T
    scores += q_rope @ rot.T
    scores *= self._scale
    scores -= scores.max(axis=1, keepdims=True)
    p = np.exp(scores, out=scores)
    p /= p.sum(axis=1, keepdims=True)
    out[0] = np.matmul(w_v, (p @ lat)[:, :, None]).reshape(-1)
    return out


def rescaled_sinks(self, q_heads, cache, layer, k_new, v_new, slot, start, out):
    """The sinks as Attention.decode applied them before change 29: the plain compiled
    attention, then out *= 1 / (1 + exp(z - logsumexp(scores))) from NumPy scores."""
    kernels.attend_cached_into(q_heads, cache.k[layer], cache.v[layer], k_new, v_new, slot,
                               start, self._scale32, out, self.threads)
    if self.sinks is None:
        return
    H, Hkv = self.n_heads, self.n_kv_heads
    keys = to_f32(cache.k[layer][0, :, start:slot + 1])
    q = q_heads.reshape(Hkv, H // Hkv, -1)
    a = np.matmul(q, keys.transpose(0, 2, 1)) * self._scale32
    top = a.max(axis=-1)
    lse = top + np.log(np.exp(a - top[..., None]).sum(axis=-1))
    out *= (np.float32(1.0) / (np.float32(1.0) + np.exp(self.sinks.reshape(Hkv, -1) - lse))
            ).reshape(H, 1)


PATCHES = [(mla.MLA, "_absorbed", numpy_absorbed),
           (attention.Attention, "_attend_one", rescaled_sinks),
           (moe.BiasedExperts, "__call__", moe.BiasedExperts.reference)]


def run(path: str, threads: int, depth: int, steps: int, mlock: bool) -> None:
    model = colibri.load(path, threads=threads, mlock=mlock)
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    originals = [(cls, name, getattr(cls, name)) for cls, name, _ in PATCHES]
    caches = {k: model.new_cache(depth + steps + 8) for k in "AB"}
    if depth:
        prompt = rng.integers(0, V, depth)
        for c in caches.values():
            colibri.forward(model, prompt, cache=c)
    times, diff = {"A": [], "B": []}, 0.0
    for i in range(steps + 3):                            # 3 warm-up steps
        token = np.array([int(rng.integers(0, V))])
        logits = {}
        for k in "AB" if i % 2 else "BA":          # alternate who touches new pages first
            for cls, name, new in PATCHES if k == "B" else []:
                setattr(cls, name, new)
            t0 = time.perf_counter()
            logits[k] = colibri.forward(model, token, cache=caches[k])
            dt = time.perf_counter() - t0
            for cls, name, old in originals:
                setattr(cls, name, old)
            if i >= 3:
                times[k].append(dt)
        diff = max(diff, float(np.abs(logits["A"] - logits["B"]).max()
                               / np.abs(logits["B"]).max()))
    a, b = (np.median(times[k]) * 1e3 for k in "AB")
    print(f"{os.path.basename(path)}, {threads} thread(s), depth {depth}: A (compiled) "
          f"{a:.2f} ms/token, B (before) {b:.2f} ms/token, B / A {b / a:.3f}; max relative "
          f"logit difference {diff:.1e}; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--depth", type=int, default=0)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--mlock", action="store_true")
    args = ap.parse_args()
    for t in (int(s) for s in args.threads.split(",")):
        run(args.model, t, args.depth, args.steps, args.mlock)
