"""Where the integer GEMM should take over from the small-M row kernels, in a whole model: one
forward pass of T tokens after a 64-token prompt (a batched decode step, a speculative
verification, a short prefill chunk), for several igemm_min_tokens settings alternated rep
by rep in one process, the best of --reps each.

    python scripts/bench_crossover.py MODEL.colibri [--tokens 2,4,8,16,32,64,128]
        [--crossovers 0,8,16,off] [--activations int16] [--threads 2] [--reps 6]

Crossover 0 is the ISA path's default (runtime.igemm_crossover, printed), "off" keeps the
row kernels at every token count. Prints ms per pass and the default's time over each
setting's (below 1: the default is faster), beside `uptime` before and after (rerun
when the load was not ~0).
"""
from __future__ import annotations

import argparse
import subprocess
import time

import numpy as np

import colibri
from colibri.kernels import runtime

OFF = 10 ** 9


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--tokens", default="2,4,8,16,32,64,128")
    p.add_argument("--crossovers", default="0,8,16,off")
    p.add_argument("--activations", default="int16", choices=("int16", "int8"))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--reps", type=int, default=6)
    args = p.parse_args(argv)
    settings = [OFF if c == "off" else int(c) for c in args.crossovers.split(",")]
    if 0 not in settings:
        settings.insert(0, 0)
    m = colibri.load(args.model, threads=args.threads, activations=args.activations)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, m.vocab_size, 64)

    def one(T: int) -> float:
        cache = m.new_cache(ctx=64 + T)
        m.forward(prompt, cache=cache, last_only=True)
        ids = rng.integers(0, m.vocab_size, T)
        t0 = time.perf_counter()
        m.forward(ids, cache=cache, last_only=True)
        return time.perf_counter() - t0

    print(f"# before: {uptime()}")
    print(f"# {args.model}: {runtime.get_isa()}, {args.activations}, {m.threads} threads, "
          f"default crossover {runtime.igemm_crossover(None, args.activations)}; "
          f"best of {args.reps}")
    names = ["default" if c == 0 else "off" if c == OFF else str(c) for c in settings]
    print("| T | " + " | ".join(f"{n} ms" for n in names) + " | "
          + " | ".join(f"time default / {n}" for n in names[1:]) + " |")
    print("|---:|" + "---:|" * (2 * len(names) - 1))
    try:
        for T in [int(t) for t in args.tokens.split(",")]:
            best = {c: float("inf") for c in settings}
            for _ in range(args.reps):
                for c in settings:
                    runtime.set_igemm_min_tokens(c)
                    best[c] = min(best[c], one(T))
            print(f"| {T} | " + " | ".join(f"{1e3 * best[c]:.1f}" for c in settings) + " | "
                  + " | ".join(f"{best[0] / best[c]:.2f}" for c in settings[1:]) + " |",
                  flush=True)
    finally:
        runtime.set_igemm_min_tokens(None)
        m.close()
    print(f"# after: {uptime()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
