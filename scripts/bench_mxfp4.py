"""Bounded speed check of the MXFP4 kernels against q4 / q8 / bf16, per ISA path and
activations, 1 thread: one token (the decode step's shape: the row kernel, weight bytes /
second) and 16 / 64 tokens (an expert's share of a prefill: the GEMM path on f32
activations, on int8 / int16 the path the crossover picks; multiply-adds / second).
--igemm-both times int8 / int16 on both the integer row kernel ("row") and the integer GEMM
("igemm") at every token count (igemm_min_tokens 10^9, then 1).

    python scripts/bench_mxfp4.py [--rows 2880] [--cols 2880] [--tokens 1,16,64]
                                  [--isas avx2,avx512vnni] [--formats mxfp4,q4] [--seconds 0.2]
                                  [--igemm-both]

Each figure is the best of 5 timings of a loop of about `seconds`; print `uptime` beside it
(the machine may be shared).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from colibri import kernels
from colibri.format import mxfp4
from colibri.kernels import runtime
from colibri.kernels.weights import WeightRef

FORMATS = ("mxfp4", "q4", "q8", "bf16")
ACTIVATIONS = ("f32", "int16", "int8")


def weight(fmt: str, R: int, C: int, rng) -> WeightRef:
    if fmt == "mxfp4":
        codes = rng.integers(0, 256, size=(R, C // 2), dtype=np.uint8)
        scales = rng.integers(120, 130, size=(R, C // 32), dtype=np.uint8)
        return WeightRef(buf=mxfp4.rows(codes, scales).reshape(-1).copy(), offset=0,
                         dtype="mxfp4", rows=R, cols=C, group_size=32)
    w = rng.standard_normal((R, C)).astype(np.float32)
    return WeightRef.from_array(w, fmt, 32 if fmt in ("q4", "q8") else 0)


def best_time(p, x, out, seconds: float) -> float:
    p(x, out)
    t0 = time.perf_counter()
    p(x, out)
    n = max(1, int(seconds / max(time.perf_counter() - t0, 1e-6)))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            p(x, out)
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2880)
    ap.add_argument("--cols", type=int, default=2880)
    ap.add_argument("--tokens", default="1,16,64")
    ap.add_argument("--isas", default=",".join(runtime.available_isas()))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--activations", default=",".join(ACTIVATIONS))
    ap.add_argument("--seconds", type=float, default=0.2)
    ap.add_argument("--igemm-both", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    R, C = args.rows, args.cols
    refs = {f: weight(f, R, C, rng) for f in args.formats.split(",")}
    previous, igemm_before = runtime.get_isa(), runtime.igemm_min_tokens()
    print(f"{R} x {C}, 1 thread; ms per call, GB/s of weights (1 token) or GMAC/s")
    try:
        for isa in args.isas.split(","):
            runtime.set_isa(isa)
            for T in (int(t) for t in args.tokens.split(",")):
                x = rng.standard_normal((T, C)).astype(np.float32)
                out = np.empty((T, R), np.float32)
                for fmt, w in refs.items():
                    for act in args.activations.split(","):
                        if act != "f32" and fmt == "bf16":
                            continue                       # plain formats: f32 only
                        paths = ([("row", 10 ** 9), ("igemm", 1)]
                                 if args.igemm_both and act != "f32" else [("", None)])
                        for path, n_min in paths:
                            if n_min is not None:
                                runtime.set_igemm_min_tokens(n_min)
                            p = kernels.prepare_linear(w, threads=1, activations=act)
                            dt = best_time(p, x, out, args.seconds)
                            rate = (f"{w.rows * w.row_stride / dt / 1e9:6.1f} GB/s" if T == 1
                                    else f"{R * C * T / dt / 1e9:6.1f} GMAC/s")
                            print(f"{isa:10s} T={T:<3d} {fmt:6s} {act:5s} {path:5s} "
                                  f"{dt * 1e3:8.3f} ms  {rate}", flush=True)
    finally:
        runtime.set_isa(previous)
        runtime.set_igemm_min_tokens(igemm_before)


if __name__ == "__main__":
    main()
