"""Bounded speed check of the kernel paths against each other in one process: the one-token
row kernels (decode GEMV) and the prefill GEMMs, per ISA path, rounds interleaved so that the
machine's drift hits every path alike. Prints GB/s of weight bytes (GEMV) or GFLOP/s (GEMM)
per path, median and best of the rounds, and each path's ratio to the first one (avx2 by
default: the bodies every wider path is checked against bit for bit).

    python scripts/bench_paths.py                           # q4/q8 x int16/int8 GEMV, q4/bf16 GEMM
    python scripts/bench_paths.py --only gemv --formats q4 --acts int16 --rounds 30
    python scripts/bench_paths.py --paths avx2,avx512 --only gemm --tokens 128

GEMV: --matrices matrices of --shape (default 3584 x 1024, mixtral-mini's expert gate) are
cycled, 40 of them (73 MB at q4: past the last-level cache, the decode regime) or 1 (--in-cache:
the weights stay in L2/L3, the compute regime). GEMM: one matrix against --tokens tokens with
f32 activations (the f32 GEMM) or int8/int16 (the integer GEMM). Check `uptime` before and
after: a second busy process halves these figures.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from colibri import kernels as K
from colibri.kernels import runtime
from colibri.kernels.weights import WeightRef

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "asv_bench"))
from benchmarks.common import weight  # noqa: E402  (random weights at real shapes, tiled)


def timed_rounds(paths: list[str], rounds: int, run) -> dict[str, list[float]]:
    """Seconds of run() per path per round, the paths in turn within each round (one untimed
    call per path first)."""
    for p in paths:
        runtime.set_isa(p)
        run()
    out: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(rounds):
        for p in paths:
            runtime.set_isa(p)
            t0 = time.perf_counter()
            run()
            out[p].append(time.perf_counter() - t0)
    return out


def report(what: str, unit: str, work: float, secs: dict[str, list[float]]) -> None:
    """One line per path: work / median and work / best, and the ratio of medians to the
    first path."""
    first = None
    for p, s in secs.items():
        med, best = float(np.median(s)), min(s)
        first = med if first is None else first
        print(f"{what:44s} {p:11s} median {work / med:8.1f} best {work / best:8.1f} {unit}"
              f"   x{first / med:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default=None,
                    help="comma-separated ISA paths (default: avx2 and every wider one this "
                         "CPU runs)")
    ap.add_argument("--only", choices=("gemv", "gemm"), default=None)
    ap.add_argument("--formats", default="q4,q8")
    ap.add_argument("--acts", default="int16,int8")
    ap.add_argument("--shape", default="3584x1024", help="ROWSxCOLS of the matrices")
    ap.add_argument("--in-cache", action="store_true",
                    help="GEMV over one matrix (weights in cache) instead of 40")
    ap.add_argument("--tokens", type=int, default=128, help="tokens of the GEMM")
    ap.add_argument("--gemm-formats", default="q4,bf16")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    avail = runtime.available_isas()
    paths = (args.paths.split(",") if args.paths else
             [p for p in ("avx2", "avx512", "avxvnni", "avx512vnni") if p in avail])
    missing = [p for p in paths if p not in avail]
    if missing:
        ap.error(f"this CPU/OS does not run {', '.join(missing)} (it runs {', '.join(avail)})")
    rows, cols = (int(v) for v in args.shape.lower().split("x"))
    previous = runtime.get_isa()
    try:
        if args.only in (None, "gemv"):
            x = np.random.default_rng(1).standard_normal((1, cols)).astype(np.float32)
            out = np.empty((1, rows), np.float32)
            for fmt in args.formats.split(","):
                base = weight((rows, cols), fmt)
                mats = [base] if args.in_cache else [
                    WeightRef(np.asarray(base.buf).copy(), 0, fmt, rows, cols, base.group_size,
                              base.row_stride, 1) for _ in range(40)]
                calls = mats * (40 if args.in_cache else 1)
                for act in args.acts.split(","):
                    def run():
                        for m in calls:
                            K.linear(x, m, threads=1, out=out, activations=act)
                    secs = timed_rounds(paths, args.rounds, run)
                    nbytes = len(calls) * rows * base.row_stride
                    where = "in cache" if args.in_cache else "streamed"
                    report(f"GEMV {fmt} {act} {rows}x{cols} 1 token, {where}", "GB/s",
                           nbytes / 1e9, secs)
        if args.only in (None, "gemm"):
            x = np.random.default_rng(2).standard_normal((args.tokens, cols)).astype(np.float32)
            for fmt in args.gemm_formats.split(","):
                w = weight((rows, cols), fmt)
                acts = ["f32"] + (args.acts.split(",") if fmt in ("q4", "q8") else [])
                for act in acts:
                    secs = timed_rounds(paths, max(3, args.rounds // 3),
                                        lambda: K.linear(x, w, threads=1, activations=act))
                    report(f"GEMM {fmt} {act} {rows}x{cols} x {args.tokens} tokens", "GFLOP/s",
                           2 * rows * cols * args.tokens / 1e9, secs)
    finally:
        runtime.set_isa(previous)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
