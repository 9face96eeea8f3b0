"""The compiled decode step against the Python one, in one process, alternating
(docs/performance.md, change 28).

    python scripts/bench_decode_layer.py MODEL.colibri [MODEL ...] [--threads 1,2]
                                         [--steps 32] [--rounds 5] [--prompt 16]
                                         [--activations int16]

Per model and thread count, one model loaded and a cache prefilled with `prompt` tokens
(untimed). Then `rounds` rounds, each `steps` decode steps on the compiled layers
(colibri.decode_layer) and `steps` on the Python layers (Model._step_layers: the model's
compiled layers set aside for the round), the cache cut back to the prompt before each, so
load from other work on the machine falls on both alike. The two give the same logits
(checked on every step). Prints per (model, threads): the median milliseconds per token of
each, the ratio compiled / Python and the time per token saved (what the Python between the
kernels cost); the time per token by stage (Model.timings: attention = norms, projections,
RoPE, cache write and attention; router; experts; shared; dense; head) of each path; the
pool's work items run by worker threads per token; the 1-minute load average before and
after.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import colibri
from colibri import _kernels, runtime
from colibri.model import DEFAULT_ACTIVATIONS


def run_steps(model, cache, tokens: np.ndarray) -> tuple[float, np.ndarray, dict]:
    """Decode tokens one by one from the cache's length; (seconds per token, last logits,
    seconds per stage per token)."""
    before = model.timings.copy()
    t0 = time.perf_counter()
    for t in tokens:
        logits = colibri.forward(model, np.array([t]), cache=cache)
    dt = (time.perf_counter() - t0) / len(tokens)
    after = model.timings.copy()
    return dt, logits, {k: (after[k] - before[k]) / len(tokens) for k in after}


def bench(path: str, threads: int, args) -> None:
    model = colibri.load(path, threads=threads, activations=args.activations)
    compiled = model._compiled
    if compiled is None:
        from colibri.decode_layer import uncovered
        print(f"{os.path.basename(path)}: no compiled layers ({uncovered(model)})")
        return
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, model.vocab_size, size=args.prompt)
    tokens = rng.integers(3, model.vocab_size, size=args.steps)
    cache = model.new_cache(ctx=args.prompt + args.steps + 1)
    colibri.forward(model, prompt, cache=cache)
    run_steps(model, cache, tokens[:4])                     # warm up both paths
    cache.truncate(args.prompt)
    model._compiled = None
    run_steps(model, cache, tokens[:4])
    model._compiled = compiled
    times = {"compiled": [], "python": []}
    stages = {"compiled": [], "python": []}
    items = {"compiled": 0, "python": 0}
    for _ in range(args.rounds):
        last = {}
        for name in ("compiled", "python"):
            cache.truncate(args.prompt)
            model._compiled = compiled if name == "compiled" else None
            w0 = _kernels.pool_worker_items()
            dt, last[name], st = run_steps(model, cache, tokens)
            items[name] += _kernels.pool_worker_items() - w0
            times[name].append(dt)
            stages[name].append(st)
        model._compiled = compiled
        if not np.array_equal(last["compiled"], last["python"]):
            diff = float(np.abs(last["compiled"] - last["python"]).max())
            print(f"  logits differ between the paths (max |diff| {diff:.3g})")
    c, p = statistics.median(times["compiled"]), statistics.median(times["python"])
    name = os.path.basename(path)
    print(f"{name} threads={threads} activations={args.activations}: compiled {c * 1e3:.3f} "
          f"ms/token, python {p * 1e3:.3f} ms/token, ratio {c / p:.3f}, saved "
          f"{(p - c) * 1e6:.0f} us/token ({100 * (p - c) / p:.1f} %)")
    for path_name in ("compiled", "python"):
        st = {k: statistics.median(s[k] for s in stages[path_name]) * 1e3
              for k in stages[path_name][0]}
        parts = ", ".join(f"{k} {v:.3f}" for k, v in st.items() if v > 0)
        per_token = items[path_name] / (args.rounds * args.steps)
        print(f"  {path_name:8s} ms/token by stage: {parts}; worker items/token "
              f"{per_token:.0f}")
    model.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--activations", default=DEFAULT_ACTIVATIONS)
    args = ap.parse_args()
    print(f"load before: {os.getloadavg()[0]:.2f}, isa {runtime.get_isa()}")
    for path in args.models:
        for th in (int(t) for t in args.threads.split(",")):
            bench(path, th, args)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
