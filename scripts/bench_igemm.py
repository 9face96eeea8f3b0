"""Bounded speed check of the integer GEMM path (csrc/igemm.h) against the idot row kernel, in
one process: q4 / q8 weights of mixtral-mini's expert shapes (gate / up 3584 x 1024, down
1024 x 3584), int16 and int8 activations, n tokens per call, GMAC/s (multiply-adds / second)
of each path on the current ISA (COLIBRI_ISA forces one), best of --repeat interleaved calls.

    python scripts/bench_igemm.py [--tokens 4,8,16,32,64,128] [--threads 1] [--repeat 7]

--one FMT,ACT,N,PATH runs one case (PATH gemm or row) --repeat times and prints nothing but
its GMAC/s: the shape to count instructions of with callgrind, e.g.
    COLIBRI_ISA=avx2 valgrind --tool=callgrind --toggle-collect='colibri_igemm*' \\
        python scripts/bench_igemm.py --one q4,int8,64,gemm --repeat 2
(valgrind 3.19 decodes neither EVEX nor AVX-VNNI: count the AVX2 bodies).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from colibri import kernels
from colibri.kernels import runtime
from colibri.kernels.weights import WeightRef

SHAPES = {"gate": (3584, 1024), "down": (1024, 3584)}      # (R, C) of one expert matrix
OFF = 10 ** 9                                             # igemm_min_tokens: row kernel only


def weight(fmt: str, shape: tuple[int, int], rng) -> WeightRef:
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    return WeightRef.from_array(w, fmt, 32)


def timed(fn, x, out, repeat: int) -> float:
    """Seconds of the best of `repeat` calls (after one warm-up)."""
    fn(x, out)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn(x, out)
        best = min(best, time.perf_counter() - t)
    return best


def rate(fmt: str, act: str, n: int, path: str, threads: int, repeat: int, rng,
         cache: dict) -> float:
    """GMAC/s of `path` (gemm / row) for n tokens, summed over the gate and down shapes."""
    macs = secs = 0.0
    for name, (R, C) in SHAPES.items():
        key = (fmt, name)
        if key not in cache:
            cache[key] = weight(fmt, (R, C), rng)
        w = cache[key]
        x = rng.standard_normal((n, C)).astype(np.float32)
        out = np.empty((n, R), np.float32)
        runtime.set_igemm_min_tokens(1 if path == "gemm" else OFF)
        fn = kernels.prepare_linear(w, threads=threads, activations=act)
        secs += timed(fn, x, out, repeat)
        macs += n * R * C
    runtime.set_igemm_min_tokens(None)
    return macs / secs / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4,8,16,32,64,128")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--one", default=None, help="FMT,ACT,N,PATH: one case only")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cache: dict = {}
    if args.one:
        fmt, act, n, path = args.one.split(",")
        print(f"{rate(fmt, act, int(n), path, args.threads, args.repeat, rng, cache):.1f}")
        return
    tokens = [int(t) for t in args.tokens.split(",")]
    print(f"isa {runtime.get_isa()}, {args.threads} thread(s), best of {args.repeat}; "
          f"GMAC/s row kernel / GEMM path (gate 3584 x 1024 + down 1024 x 3584)")
    print(f"{'format':8} {'act':6} " + " ".join(f"{'n=' + str(n):>15}" for n in tokens))
    for fmt in ("q4", "q8"):
        for act in ("int16", "int8"):
            cells = []
            for n in tokens:
                row = rate(fmt, act, n, "row", args.threads, args.repeat, rng, cache)
                gemm = rate(fmt, act, n, "gemm", args.threads, args.repeat, rng, cache)
                cells.append(f"{row:6.1f} / {gemm:6.1f}")
            print(f"{fmt:8} {act:6} " + " ".join(f"{c:>15}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
