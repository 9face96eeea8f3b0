"""The compiled decode step against the Python one, in one process, alternating
(docs/performance.md, change 28).

    python scripts/bench_decode_layer.py MODEL.colibri [MODEL ...] [--threads 1,2]
                                         [--steps 32] [--rounds 5] [--prompt 16]
                                         [--activations int16]
    python scripts/bench_decode_layer.py --tiny [--threads 1,2] ...

--tiny: instead of files, two random models with the layer structure of the benchmark models
but hidden size 64 (made with transformers in a temporary folder, q4): mixtral-mini's (8
layers, 8 experts top-2) and olmoe-16L's (16 layers, 64 experts top-8, full q/k norms).
Their kernels take next to no time, so the time saved per step is what the Python between
the kernels costs when the interpreter's code and data are in cache (a real model's weight
streaming evicts them, so there it costs more).

Per model and thread count, one model loaded and two caches prefilled with the same
`prompt` tokens (untimed). Then `rounds` rounds (and one warm-up round) of `steps` tokens,
each token decoded on the compiled layers (colibri.decode_layer) through one cache and then
on the Python layers (Model._step_layers: the model's compiled layers set aside) through the
other, so load from other work on the machine falls on both alike, token by token; the caches
are cut back to the prompt before each round. The two must give the same logits (checked on
every step). Prints per (model, threads): the median milliseconds per token of each, the
ratio compiled / Python and the time per token saved (what the Python between the kernels
cost); the mean time per token by stage (Model.timings: attention = norms, projections,
RoPE, cache write and attention; router; experts; shared; dense; head) of each path; the
pool's work items run by worker threads per token; the 1-minute load average before and
after.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import colibri
from colibri import _kernels, runtime
from colibri.decode_layer import uncovered
from colibri.model import DEFAULT_ACTIVATIONS

PATHS = ("compiled", "python")


def bench(path: str, threads: int, args) -> None:
    model = colibri.load(path, threads=threads, activations=args.activations)
    compiled = model._compiled
    name = os.path.basename(path)
    if compiled is None:
        print(f"{name}: no compiled layers ({uncovered(model)})")
        return
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, model.vocab_size, size=args.prompt)
    tokens = rng.integers(3, model.vocab_size, size=args.steps)
    caches = {}
    for path_name in PATHS:
        caches[path_name] = model.new_cache(ctx=args.prompt + args.steps + 1)
        colibri.forward(model, prompt, cache=caches[path_name])
    times = {p: [] for p in PATHS}
    stages = {p: dict.fromkeys(model.timings.seconds, 0.0) for p in PATHS}
    items = dict.fromkeys(PATHS, 0)
    differ = 0.0
    for r in range(args.rounds + 1):                       # round 0: warm-up, not counted
        for c in caches.values():
            c.truncate(args.prompt)
        for t in tokens:
            out = {}
            for path_name in PATHS:
                model._compiled = compiled if path_name == "compiled" else None
                before, w0 = model.timings.copy(), _kernels.pool_worker_items()
                t0 = time.perf_counter()
                out[path_name] = colibri.forward(model, np.array([t]), cache=caches[path_name])
                dt = time.perf_counter() - t0
                if r:
                    times[path_name].append(dt)
                    items[path_name] += _kernels.pool_worker_items() - w0
                    for k, v in model.timings.copy().items():
                        stages[path_name][k] += v - before[k]
            model._compiled = compiled
            differ = max(differ, float(np.abs(out["compiled"] - out["python"]).max()))
    c, p = statistics.median(times["compiled"]), statistics.median(times["python"])
    n = args.rounds * args.steps
    print(f"{name} threads={threads} activations={args.activations}: compiled {c * 1e3:.3f} "
          f"ms/token, python {p * 1e3:.3f} ms/token (medians of {n} steps each), ratio "
          f"{c / p:.3f}, saved {(p - c) * 1e6:.0f} us/token ({100 * (p - c) / p:.1f} %)"
          + ("" if differ == 0 else f"; LOGITS DIFFER by up to {differ:.3g}"))
    for path_name in PATHS:
        parts = ", ".join(f"{k} {v / n * 1e3:.3f}" for k, v in stages[path_name].items() if v)
        print(f"  {path_name:8s} mean ms/token by stage: {parts}; worker items/token "
              f"{items[path_name] / n:.0f}")
    model.close()


def tiny_models(folder: Path) -> list[str]:
    """The --tiny models (q4) in folder; their paths."""
    import transformers   # only for --tiny: an optional dependency of colibri

    from colibri.convert import convert
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    common = dict(vocab_size=320, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    configs = {
        "tiny-mixtral-8L": transformers.MixtralConfig(
            **common, num_hidden_layers=8, intermediate_size=96, num_local_experts=8,
            num_experts_per_tok=2),
        "tiny-olmoe-16L": transformers.OlmoeConfig(
            **common, num_hidden_layers=16, intermediate_size=64, num_experts=64,
            num_experts_per_tok=8),
    }
    paths = []
    for name, config in configs.items():
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder / name)
        paths.append(str(folder / f"{name}.colibri"))
        convert(folder / name, paths[-1], progress=False, quant="q4")
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--tiny", action="store_true", help="the tiny models described above")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--activations", default=DEFAULT_ACTIVATIONS)
    args = ap.parse_args()
    if not args.models and not args.tiny:
        ap.error("give model files or --tiny")
    print(f"load before: {os.getloadavg()[0]:.2f}, isa {runtime.get_isa()}")
    with tempfile.TemporaryDirectory() as tmp:
        paths = args.models + (tiny_models(Path(tmp)) if args.tiny else [])
        for path in paths:
            for th in (int(t) for t in args.threads.split(",")):
                bench(path, th, args)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
