"""Prefill / batching speed of the AMX tile bodies (csrc/igemm_amx.h) against the avx512vnni
integer GEMM, in one process, interleaved: mixtral-mini's expert shapes (3584 x 1024, 1024 x
3584), q4 / q8 / mxfp4 weights, int16 (default) and int8 activations, n tokens per call
(8 sequences of a batched step ~ 2 tokens per expert; prefill 32 / 128 / 512).
Prints GMAC/s of each and the ratio amx / avx512vnni. Needs a CPU with AMX (the amx path);
without one it says so and stops (amx-emu is a test path, not a speed path).

    python scripts/bench_amx.py [--tokens 16,32,64,128,512] [--threads 1] [--repeat 7]

The model-level figures (pp128 / pp512, tg, batching) come from the same commands run once
per path: COLIBRI_ISA=amx and COLIBRI_ISA=avx512vnni python -m colibri bench MODEL.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from colibri import kernels
from colibri.kernels import runtime
from colibri.kernels.weights import WeightRef

SHAPES = {"gate": (3584, 1024), "down": (1024, 3584)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="16,32,64,128,512")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--formats", default="q4,q8,mxfp4")
    args = ap.parse_args()
    if "amx" not in runtime.available_isas():
        print(f"no AMX on this CPU/OS (available: {', '.join(runtime.available_isas())}); "
              "run this on a Sapphire Rapids or later Xeon", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    runtime.set_igemm_min_tokens(1)
    print(f"{'fmt':6} {'act':6} {'shape':5} {'n':>4} {'vnni GMAC/s':>12} {'amx GMAC/s':>11} {'ratio':>6}")
    for fmt in args.formats.split(","):
        for name, (R, C) in SHAPES.items():
            w = WeightRef.from_array((rng.standard_normal((R, C)) * 0.05).astype(np.float32), fmt, 32)
            for act in ("int16", "int8"):
                for n in map(int, args.tokens.split(",")):
                    x = rng.standard_normal((n, C)).astype(np.float32)
                    best = {"avx512vnni": np.inf, "amx": np.inf}
                    for _ in range(args.repeat):              # interleaved
                        for path in best:
                            runtime.set_isa(path)
                            t0 = time.perf_counter()
                            kernels.linear(x, w, threads=args.threads, activations=act)
                            best[path] = min(best[path], time.perf_counter() - t0)
                    g = {p: R * C * n / t / 1e9 for p, t in best.items()}
                    print(f"{fmt:6} {act:6} {name:5} {n:4d} {g['avx512vnni']:12.1f} "
                          f"{g['amx']:11.1f} {g['amx'] / g['avx512vnni']:6.2f}")
    runtime.set_isa(None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
