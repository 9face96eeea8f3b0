"""Time one MLA decode step of one attention layer of the DeepSeek-V2-Lite geometry over L
cached tokens (f16 cache), three ways, in one process:

- the absorbed attention compiled (MLA._absorbed: csrc/mla.h on kv_b in the given format,
  read in place), the cache write included;
- the same absorbed attention in NumPy on kv_b widened to float32 (what MLA.decode ran
  before docs/performance.md change 29: two batched matmuls with the f32 copy, scores and
  softmax over the widened cache);
- the general path's step (MLA.__call__, which expands every cached latent through kv_b).

    python scripts/mla_decode_step.py [--kv-b q4] [--threads 1] [L ...]   # default 64 1024 4096

The projections are NumPy f32 over the decoded kv_b, so the general path and the absorbed
forms see the same weights. Prints the median of 30 steps of each (after 5 warm-up steps),
the relative differences, and the machine's load.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from colibri import kernels
from colibri.kv_cache import KVCache, to_f32
from colibri.mla import MLA
from colibri.rope import Rope
from colibri.run_state import RunState
from colibri.runtime import blas_on_one_thread
from colibri.weights import WeightRef

D, H, Dn, Dr, Dv, R = 2048, 16, 128, 64, 128, 512       # DeepSeek-V2-Lite, no q LoRA


def projection(w: np.ndarray):
    def proj(x, out=None):
        y = x @ w.T
        if out is None:
            return y
        out[...] = y
        return out
    return proj


def random_weight(rows: int, cols: int, rng) -> np.ndarray:
    return (rng.standard_normal((rows, cols)) * cols ** -0.5).astype(np.float32)


def numpy_absorbed(w_kt, w_v, q_nope, q_rope, cache, scale):
    """The f32 NumPy form over the widened cache (slots 0..length, the new one written)."""
    n = cache.length + 1
    lat, rot = to_f32(cache.k[0][0, 0, :n]), to_f32(cache.v[0][0, 0, :n])
    q_lat = np.matmul(q_nope[:, None], w_kt)[:, 0]                     # (H, Rkv)
    scores = q_lat @ lat.T
    scores += q_rope @ rot.T
    scores *= scale
    scores -= scores.max(axis=1, keepdims=True)
    p = np.exp(scores, out=scores)
    p /= p.sum(axis=1, keepdims=True)
    return np.matmul(w_v, (p @ lat)[:, :, None]).reshape(-1)


def main(kv_b_format: str, threads: int, lengths: list[int]) -> None:
    rng = np.random.default_rng(0)
    kv_b = WeightRef.from_array(random_weight(H * (Dn + Dv), R, rng), kv_b_format,
                                32 if kv_b_format in ("q4", "q8") else 0)
    dec = kernels.dequantize(kv_b)                                     # (H*(Dn+Dv), R)
    w = dec.reshape(H, Dn + Dv, R)
    w_kt, w_v = np.ascontiguousarray(w[:, :Dn]), np.ascontiguousarray(w[:, Dn:])
    mla = MLA(wq=projection(random_weight(H * (Dn + Dr), D, rng)), wq_a=None, q_a_norm=None,
              wq_b=None, wkv_a=projection(random_weight(R + Dr, D, rng)),
              kv_a_norm=np.ones(R, np.float32), wkv_b=projection(dec),
              wo=projection(random_weight(D, H * Dv, rng)), kv_b=kv_b, n_heads=H,
              nope_dim=Dn, rope_dim=Dr, v_dim=Dv, kv_rank=R, scale=(Dn + Dr) ** -0.5,
              threads=threads)
    rope, state = Rope(Dr, 10000.0), RunState(D, H, H, Dr, 1e-6)
    print(f"load: {os.getloadavg()[0]:.2f} (1-min); kv_b {kv_b_format}, f16 cache, "
          f"{threads} kernel thread(s), NumPy's BLAS on one thread (as the model runs it)")
    for L in lengths:
        cache = KVCache(1, 1, 1, L + 1, R, value_dim=Dr, dtype="f16")
        cache.k[0][0, 0, :L] = rng.standard_normal((L, R))
        cache.v[0][0, 0, :L] = rng.standard_normal((L, Dr))
        cache.valid[0, :L], cache.length = True, L
        x = rng.standard_normal((1, D)).astype(np.float32)
        cos, sin = rope.cos_sin_one(L)
        c3, s3 = rope.cos_sin(np.array([[L]]))
        mask = np.ones((1, 1, L + 1), bool)
        q = rng.standard_normal((H, Dn + Dr)).astype(np.float32)
        q_rope = np.ascontiguousarray(q[:, Dn:])
        c = rng.standard_normal((1, R)).astype(np.float32)
        kr = rng.standard_normal((1, Dr)).astype(np.float32)
        out = np.empty((1, H * Dv), np.float32)
        steps = {
            "absorbed, compiled": lambda: mla._absorbed(q, q_rope, c, kr, cache, 0, out).copy(),
            "absorbed, NumPy f32 kv_b": lambda: numpy_absorbed(w_kt, w_v, q[:, :Dn], q_rope,
                                                               cache, np.float32(mla.scale)),
            "decode step (compiled)": lambda: mla.decode(x, cos, sin, cache, 0, state).copy(),
            "general path step": lambda: mla(x[None], c3, s3, mask, cache, 0)[0],
        }
        times, results = {k: [] for k in steps}, {}
        for _ in range(5):                                  # warm-up: BLAS threads, pages
            for f in steps.values():
                f()
        for _ in range(30):
            for k, f in steps.items():
                t0 = time.perf_counter()
                results[k] = f()
                times[k].append(time.perf_counter() - t0)
        a, b = results["absorbed, compiled"][0], results["absorbed, NumPy f32 kv_b"]
        d, g = results["decode step (compiled)"], results["general path step"]
        cells = ", ".join(f"{k} {np.median(v) * 1e3:.3f} ms" for k, v in times.items())
        print(f"L {L}: {cells}; relative difference compiled / NumPy absorbed "
              f"{np.abs(a - b).max() / np.abs(b).max():.1e}, decode / general "
              f"{np.abs(d - g).max() / np.abs(g).max():.1e}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-b", default="q4", choices=("f32", "f16", "bf16", "q8", "q4"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("lengths", type=int, nargs="*", default=[64, 1024, 4096])
    args = ap.parse_args()
    with blas_on_one_thread():
        main(args.kv_b, args.threads, args.lengths)
