"""Bounded speed check of the MXFP4 row kernel against q4 / q8 / bf16: one token (the decode
step's shape) times a 4096 x 4096 matrix, per ISA path, 1 thread; weight bytes / second.

    python scripts/bench_mxfp4.py [--repeat 50]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from colibri import kernels, mxfp4, runtime
from colibri.weights import WeightRef

R = C = 4096


def weight(fmt: str, rng) -> WeightRef:
    if fmt == "mxfp4":
        codes = rng.integers(0, 256, size=(R, C // 2), dtype=np.uint8)
        scales = rng.integers(120, 130, size=(R, C // 32), dtype=np.uint8)
        return WeightRef(buf=mxfp4.rows(codes, scales).reshape(-1).copy(), offset=0,
                         dtype="mxfp4", rows=R, cols=C, group_size=32)
    w = rng.standard_normal((R, C)).astype(np.float32)
    return WeightRef.from_array(w, fmt, 32 if fmt in ("q4", "q8") else 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, C)).astype(np.float32)
    out = np.empty((1, R), np.float32)
    refs = {f: weight(f, rng) for f in ("mxfp4", "q4", "q8", "bf16")}
    previous = runtime.get_isa()
    try:
        for isa in runtime.available_isas():
            runtime.set_isa(isa)
            for fmt, w in refs.items():
                p = kernels.prepare_linear(w, threads=1, activations="f32")
                p(x, out)
                t0 = time.perf_counter()
                for _ in range(args.repeat):
                    p(x, out)
                dt = (time.perf_counter() - t0) / args.repeat
                nbytes = w.rows * w.row_stride
                print(f"{isa:10s} {fmt:6s} {dt * 1e3:7.3f} ms  {nbytes / dt / 1e9:6.1f} GB/s")
    finally:
        runtime.set_isa(previous)


if __name__ == "__main__":
    main()
