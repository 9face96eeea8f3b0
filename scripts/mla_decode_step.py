"""Time one MLA decode step (the absorbed form, MLA.decode) against the general path's step
(MLA.__call__, which expands every cached latent through kv_b), for one attention layer of
the DeepSeek-V2-Lite geometry over L cached tokens, f32 NumPy projections.

    python scripts/mla_decode_step.py [L ...]      # default 256 1024 4096

Prints the median of 20 steps of each (after 5 warm-up steps) and the machine's load.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from colibri.kv_cache import KVCache
from colibri.mla import MLA
from colibri.rope import Rope
from colibri.run_state import RunState

D, H, Dn, Dr, Dv, R = 2048, 16, 128, 64, 128, 512       # DeepSeek-V2-Lite, no q LoRA


def linear(rows: int, cols: int, rng):
    w = (rng.standard_normal((rows, cols)) * cols ** -0.5).astype(np.float32)

    def proj(x, out=None):
        y = x @ w.T
        if out is None:
            return y
        out[...] = y
        return out
    return proj, w


def main(lengths: list[int]) -> None:
    rng = np.random.default_rng(0)
    wkv_b, kv_b = linear(H * (Dn + Dv), R, rng)
    mla = MLA(wq=linear(H * (Dn + Dr), D, rng)[0], wq_a=None, q_a_norm=None, wq_b=None,
              wkv_a=linear(R + Dr, D, rng)[0], kv_a_norm=np.ones(R, np.float32),
              wkv_b=wkv_b, wo=linear(D, H * Dv, rng)[0], kv_b=kv_b, n_heads=H, nope_dim=Dn,
              rope_dim=Dr, v_dim=Dv, kv_rank=R, scale=(Dn + Dr) ** -0.5)
    rope, state = Rope(Dr, 10000.0), RunState(D, H, H, Dr, 1e-6)
    print(f"load: {os.getloadavg()[0]:.2f} (1-min), threads: numpy default")
    for L in lengths:
        cache = KVCache(1, 1, 1, L + 1, R, value_dim=Dr)
        cache.k[0][0, 0, :L] = rng.standard_normal((L, R)).astype(np.float32)
        cache.v[0][0, 0, :L] = rng.standard_normal((L, Dr)).astype(np.float32)
        cache.valid[0, :L], cache.length = True, L
        x = rng.standard_normal((1, D)).astype(np.float32)
        cos, sin = rope.cos_sin_one(L)
        c3, s3 = rope.cos_sin(np.array([[L]]))
        mask = np.ones((1, 1, L + 1), bool)
        times = {"absorbed decode": [], "expanded (general path)": []}
        for _ in range(5):                                  # warm-up: BLAS threads, pages
            mla.decode(x, cos, sin, cache, 0, state)
            mla(x[None], c3, s3, mask, cache, 0)
        for _ in range(20):
            t0 = time.perf_counter()
            a = mla.decode(x, cos, sin, cache, 0, state).copy()
            times["absorbed decode"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            b = mla(x[None], c3, s3, mask, cache, 0)[0]
            times["expanded (general path)"].append(time.perf_counter() - t0)
        err = float(np.abs(a - b).max() / np.abs(b).max())
        cells = ", ".join(f"{k} {np.median(v) * 1e3:.2f} ms" for k, v in times.items())
        print(f"L {L}: {cells} (relative difference {err:.1e})")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [256, 1024, 4096])
