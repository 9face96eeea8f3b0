"""The A/B of the decode step: the compiled layers (colibri.engine.decode_layer's CompiledLayers,
one nogil call per step) against the Python ones (layer_loop.run_layers over a TokenStep, their
specification), in one process, token by token, on any model file whose layers the compiled
step covers: per-head attention, DeepSeek's latent attention (MLA), GPT-OSS's sinks and
biased experts, LayerNorm families (docs/performance.md, changes 28 and 32).

    python scripts/bench_decode_layer.py MODEL.colibri [MODEL ...] [--threads 1,2]
                                         [--steps 32] [--rounds 5] [--prompt 16]
                                         [--activations int16] [--mlock] [--budget 60]
    python scripts/bench_decode_layer.py --tiny [--threads 1,2] ...
    python scripts/bench_decode_layer.py MODEL --one-path python|compiled [--steps N]
    python scripts/bench_decode_layer.py MODEL --job-cost

The two paths must give the same logits, bit for bit, on every step: the exit status is 1
if they differ anywhere (the largest difference is printed), 0 otherwise.

MODEL: any .colibri file (one whose layers the compiled step does not cover prints its
reason, colibri.engine.decode_layer.uncovered); --mlock locks its mapping in RAM first (a file close
to the page cache's size otherwise reads part of its weights from disk on either path);
--prompt: the cached tokens each step attends to (e.g. 4096 for MLA's absorbed attention
over a long cache).

--tiny: instead of files, random models with the layer structure of the benchmark models
but hidden size 64 (made with transformers in a temporary folder, q4): mixtral-mini's (8
layers, 8 experts top-2), olmoe-16L's (16 layers, 64 experts top-8, full q/k norms),
gpt-oss-20b-8L's (8 layers, 32 experts top-4, sinks, alternating windows, biased swigluoai
experts), deepseek-v2-lite-8L's (8 layers, MLA, a dense first layer, 64 experts top-6,
2 shared) and an 8-layer PhiMoE (LayerNorm with biases, 16 experts top-2, sparsemixer).
Their kernels take next to no time, so the time saved per step is what the Python between
the kernels costs when the interpreter's code and data are in cache (a real model's weight
streaming evicts them, so there it costs more).

--job-cost: what one pool job costs at 2 threads: layer 0's q|k|v and wo linears (the
model's activations, one token) called 100 times in a row on the same x, so the weights stay
in cache, at 1 and 2 threads alternating (3 rounds of 40 batches, the fastest batch of each
round, the median round): the 2-thread time over half the 1-thread time is the job's
overhead; with the pool's work items taken by the worker per call.

--one-path: only a prefill of 8 tokens and `steps` decode steps on that path, 1 thread
(--threads' first), nothing timed: the run to count instructions of, e.g.
`PYTHONHASHSEED=0 COLIBRI_ISA=avx2 valgrind --tool=callgrind python
scripts/bench_decode_layer.py MODEL --one-path python --steps 10` (and --steps 2: the
difference over 8 steps is the per-token count, the load and the checks cancel).

Per model and thread count, one model loaded and two caches prefilled with the same
`prompt` tokens (untimed). Then `rounds` rounds (and one warm-up round) of `steps` tokens,
each token decoded on the compiled layers through one cache and then on the Python layers
(the model's compiled layers set aside) through the other, so load from other work on the
machine falls on both alike, token by token; the caches are cut back to the prompt before
each round; no round starts once `budget` seconds have passed for this (model, threads)
(the figures then cover the rounds run). Prints per (model, threads): the median
milliseconds per token of each, the ratio compiled / Python and the time per token saved
(what the Python between the kernels cost), whether the logits were bit-identical; the mean
time per token by stage (Model.timings: attention = norms, projections, RoPE, cache write
and attention; router; experts; shared; dense; head) of each path; the pool's work items run
by worker threads per token; the 1-minute load average (os.getloadavg) before and after.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import colibri
from colibri import _kernels, kernels
from colibri.kernels import runtime
from colibri.engine.decode_layer import uncovered
from colibri.engine.model import DEFAULT_ACTIVATIONS

PATHS = ("compiled", "python")


def bench(path: str, threads: int, args) -> bool:
    """One (model, threads) A/B as the module docstring says; False if the logits of the
    two paths differed on some step."""
    model = colibri.load(path, threads=threads, activations=args.activations,
                         mlock=args.mlock)
    compiled = model.compiled_step
    name = os.path.basename(path)
    if compiled is None:
        print(f"{name}: no compiled layers ({uncovered(model)})")
        model.close()
        return True
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
    differ, identical = 0.0, True
    start, rounds = time.perf_counter(), 0
    for r in range(args.rounds + 1):                       # round 0: warm-up, not counted
        if r > 1 and time.perf_counter() - start > args.budget:
            break
        rounds = r
        for c in caches.values():
            c.truncate(args.prompt)
        for t in tokens:
            out = {}
            for path_name in PATHS:
                model.compiled_step = compiled if path_name == "compiled" else None
                before, w0 = model.timings.copy(), _kernels.pool_worker_items()
                t0 = time.perf_counter()
                out[path_name] = colibri.forward(model, np.array([t]), cache=caches[path_name])
                dt = time.perf_counter() - t0
                if r:
                    times[path_name].append(dt)
                    items[path_name] += _kernels.pool_worker_items() - w0
                    for k, v in model.timings.copy().items():
                        stages[path_name][k] += v - before[k]
            model.compiled_step = compiled
            identical &= np.array_equal(out["compiled"], out["python"])
            differ = max(differ, float(np.abs(out["compiled"] - out["python"]).max()))
    c, p = statistics.median(times["compiled"]), statistics.median(times["python"])
    n = rounds * args.steps
    print(f"{name} threads={threads} activations={args.activations}: compiled {c * 1e3:.3f} "
          f"ms/token, python {p * 1e3:.3f} ms/token (medians of {n} steps each), ratio "
          f"compiled / python {c / p:.3f}, saved {(p - c) * 1e6:.0f} us/token "
          f"({100 * (p - c) / p:.1f} %); "
          + ("logits bit-identical on every step" if identical
             else f"LOGITS DIFFER by up to {differ:.3g}"))
    for path_name in PATHS:
        parts = ", ".join(f"{k} {v / n * 1e3:.3f}" for k, v in stages[path_name].items() if v)
        print(f"  {path_name:8s} mean ms/token by stage: {parts}; worker items/token "
              f"{items[path_name] / n:.0f}")
    model.close()
    return identical


def one_path(path: str, path_name: str, threads: int, steps: int) -> None:
    """--one-path: a prefill of 8 tokens, then `steps` decode steps on one path."""
    model = colibri.load(path, threads=threads)
    if path_name == "python":
        model.compiled_step = None
    rng = np.random.default_rng(0)
    cache = model.new_cache(ctx=8 + steps)
    colibri.forward(model, rng.integers(3, model.vocab_size, size=8), cache=cache)
    for t in rng.integers(3, model.vocab_size, size=steps):
        colibri.forward(model, np.array([t]), cache=cache)


def job_cost(path: str, activations: str) -> None:
    """--job-cost (see the module docstring)."""
    model = colibri.load(path, threads=1, activations=activations)
    rng = np.random.default_rng(0)
    attn = model.layers[0].attn
    for name, lin in (("q|k|v", getattr(attn, "wqkv", None)), ("q", getattr(attn, "wq", None)),
                      ("kv_a", getattr(attn, "wkv_a", None)), ("wo", attn.wo)):
        if lin is None:
            continue
        x = rng.standard_normal((1, lin.w.cols)).astype(np.float32)
        out = np.empty((1, lin.w.rows), dtype=np.float32)
        best = {1: [], 2: []}
        items = 0
        for _ in range(3):
            for th in (1, 2):
                p = kernels.prepare_linear(lin.w, lin.b, threads=th, activations=activations)
                w0 = _kernels.pool_worker_items()
                batches = []
                for _ in range(40):
                    t0 = time.perf_counter()
                    for _ in range(100):
                        p(x, out)
                    batches.append((time.perf_counter() - t0) / 100)
                best[th].append(min(batches))
                if th == 2:
                    items += _kernels.pool_worker_items() - w0
        one, two = statistics.median(best[1]) * 1e6, statistics.median(best[2]) * 1e6
        print(f"{os.path.basename(path)} {name} ({lin.w.rows} x {lin.w.cols} {lin.w.dtype}, "
              f"{activations}): 1 thread {one:.2f} us, 2 threads {two:.2f} us, overhead "
              f"{two - one / 2:.2f} us per job; worker items per 2-thread call "
              f"{items / (3 * 40 * 100):.2f}")
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
        "tiny-gpt-oss-8L": transformers.GptOssConfig(
            **common, num_hidden_layers=8, head_dim=16, intermediate_size=64,
            num_local_experts=32, num_experts_per_tok=4, sliding_window=128),
        "tiny-deepseek-v2-8L": transformers.DeepseekV2Config(
            **dict(common, num_key_value_heads=4), num_hidden_layers=8, intermediate_size=128,
            moe_intermediate_size=32, n_routed_experts=64, num_experts_per_tok=6,
            n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None,
            qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16),
        "tiny-phimoe-8L": transformers.PhimoeConfig(
            **common, num_hidden_layers=8, intermediate_size=64, num_local_experts=16,
            num_experts_per_tok=2),
    }
    paths = []
    for name, config in configs.items():
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder / name)
        paths.append(str(folder / f"{name}.colibri"))
        convert(folder / name, paths[-1], progress=False, quant="q4")
    return paths


def main(argv: list[str] | None = None) -> int:
    """The command line; the exit status (1: the two paths' logits differed)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--tiny", action="store_true", help="the tiny models described above")
    ap.add_argument("--one-path", choices=PATHS, help="decode on this path only, untimed")
    ap.add_argument("--job-cost", action="store_true", help="one pool job's cost (above)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--activations", default=DEFAULT_ACTIVATIONS)
    ap.add_argument("--mlock", action="store_true", help="lock each file's mapping in RAM")
    ap.add_argument("--budget", type=float, default=60.0,
                    help="seconds per (model, threads) after which no round starts")
    args = ap.parse_args(argv)
    if not args.models and not args.tiny:
        ap.error("give model files or --tiny")
    if args.job_cost:
        for path in args.models:
            job_cost(path, args.activations)
        return 0
    if args.one_path:
        one_path(args.models[0], args.one_path, int(args.threads.split(",")[0]), args.steps)
        return 0
    print(f"load before: {os.getloadavg()[0]:.2f}, isa {runtime.get_isa()}")
    identical = True
    with tempfile.TemporaryDirectory() as tmp:
        paths = args.models + (tiny_models(Path(tmp)) if args.tiny else [])
        for path in paths:
            for th in (int(t) for t in args.threads.split(",")):
                identical &= bench(path, th, args)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
