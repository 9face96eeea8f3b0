"""Bounded speed check of one MoE layer's biased experts (GPT-OSS:
colibri.kernels.biased_experts.BiasedExperts) over T token rows, on a model file's own expert
stacks: the compiled grouped call (what BiasedExperts runs for T > 1) against its specification,
the Python loop (BiasedExperts.reference), routing ids drawn uniformly (top-K distinct experts
per token).

    python scripts/bench_biased_experts.py FILE [--tokens 128] [--layer 0] [--threads 1]
                                           [--activations int16,int8] [--repeat 3]

Each figure is the best of `repeat` calls (ms), the two alternating; print `uptime` beside it (the machine may be
shared). Run against an older checkout (PYTHONPATH) for a before / after pair: a build
without the grouped call reports the loop only.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import colibri


def best_ms(calls, repeat: int) -> list[float]:
    """The best time of each call in ms, the calls alternating (a load change hits all)."""
    for call in calls:
        call()
    best = [float("inf")] * len(calls)
    for _ in range(repeat):
        for i, call in enumerate(calls):
            t0 = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - t0)
    return [1e3 * b for b in best]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--activations", default="int16,int8")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for act in args.activations.split(","):
        model = colibri.load(args.file, threads=args.threads, activations=act)
        try:
            moe = model.layers[args.layer].ffn
            be = moe.biased_experts
            if be is None:
                raise SystemExit(f"{args.file}: layer {args.layer} has no biased experts")
            T, K, E, D = args.tokens, moe.top_k, be.w_gate.n_experts, be.w_down.rows
            x = rng.standard_normal((T, D)).astype(np.float32)
            ids = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)]
                           ).astype(np.int32)
            w = rng.random((T, K)).astype(np.float32)
            out = np.empty_like(x)
            calls = [lambda: be.reference(x, ids, w, out)]
            grouped = getattr(be, "_grouped", None)
            if grouped is not None:
                calls.append(lambda: grouped(x, ids, w, out))
            ms = best_ms(calls, args.repeat)
            line = (f"{act} T={T} K={K} E={E} threads={args.threads}: "
                    f"Python loop {ms[0]:.1f} ms")
            if grouped is not None:
                line += f", compiled grouped call {ms[1]:.1f} ms ({ms[0] / ms[1]:.2f}x)"
            print(line, flush=True)
        finally:
            model.close()


if __name__ == "__main__":
    main()
