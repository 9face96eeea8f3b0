"""Continuous batching against one request at a time, in one process.

    python scripts/bench_batching.py                          # the shipped model
    python scripts/bench_batching.py MODEL.colibri --concurrency 1,2,4,8 --prompt 32 --gen 64

For each concurrency N: N distinct requests (random prompt ids, greedy, no stop, `--gen`
new tokens each) are run
  - sequentially: one model.generate call after another (the path without batching);
  - concurrently: submitted together to a Scheduler(parallel=N) whose background thread
    shares each forward pass between them;
and the script prints generated tokens per second of each (prefill included: wall time from
the first request to the last token), their ratio, the mean step time of the batched run,
and whether every request got the same tokens both ways. Then the ragged decode step alone
(Model.forward_ragged with one token of each of N sequences, 48 tokens in their caches):
milliseconds per step and per token, and the seconds per stage (runtime.Timings), which say
where the batching gain stops, and its bandwidth ceiling: the read bandwidth over the bytes
of a step that reads the dense part once and each distinct expert its tokens picked once. `uptime` before and after says how loaded the machine was. Bounded: N * gen tokens per run, --reps runs of each, alternated
(the best of each is kept).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import time

import numpy as np

import colibri
from colibri.generation.batching import Scheduler
from colibri.generation.sampling import SamplingParams


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())


def sequential(model, prompts: list[list[int]], gen: int) -> tuple[float, list[list[int]]]:
    """(seconds, tokens per request) of the requests one after another."""
    t0 = time.perf_counter()
    out = [model.generate(p, max_new_tokens=gen, stop=[]).tolist() for p in prompts]
    return time.perf_counter() - t0, out


def batched(model, prompts: list[list[int]], gen: int, chunk: int
            ) -> tuple[float, list[list[int]], int]:
    """(seconds, tokens per request, steps) of the requests together through a Scheduler."""
    sched = Scheduler(model, parallel=len(prompts), ctx=max(map(len, prompts)) + gen,
                      prefill_chunk=chunk)
    sched.start()
    t0 = time.perf_counter()
    handles = [sched.submit(p, SamplingParams(max_tokens=gen, stop_ids=[])) for p in prompts]
    out = [[ev.token for ev in h if ev.token >= 0] for h in handles]
    seconds = time.perf_counter() - t0
    sched.stop()
    return seconds, out, sched.stats()["steps"]


def step_bytes(per_token: dict[str, int], routing: list[np.ndarray], one_expert: int) -> int:
    """Weight bytes one ragged step reads at best: everything but the experts once, and each
    distinct expert a layer's tokens picked once (routing: per segment int32 (M, S_i, K))."""
    ids = np.concatenate([r.reshape(r.shape[0], -1) for r in routing], axis=1)   # (M, N K)
    distinct = sum(len(np.unique(layer)) for layer in ids)
    return per_token["total"] - per_token["experts"] + distinct * one_expert


def step_table(model, ns: list[int], reps: int = 20, path=None) -> None:
    """ms per ragged decode step of N sequences, and per stage; with `path` (the .colibri
    file) also the bandwidth ceiling of the step: read bandwidth / step_bytes (measured
    now, at the model's thread count), as tokens/s and the fraction reached."""
    from colibri.format import ColibriFile
    from colibri.tools.bench import DEFAULT_BANDWIDTH_BYTES, bytes_per_token
    rng = np.random.default_rng(1)
    per_token, one = None, 0
    if path is not None:
        with ColibriFile(path) as cf:
            per_token = bytes_per_token(cf)
            names = [n for n in cf.tensors if ".moe.experts.0." in n]
            layers = {n.split(".")[1] for n in names}
            one = sum(cf.tensors[n].nbytes for n in names) // max(1, len(layers))
        bw = colibri.kernels.read_bandwidth(DEFAULT_BANDWIDTH_BYTES, threads=model.threads) * 1e9
        print(f"read bandwidth {bw / 1e9:.1f} GB/s ({model.threads} threads)")
    print(f"{'N':>3} {'ms/step':>8} {'ms/token':>9} {'tok/s':>8} {'ceiling':>8} {'of ceil':>7}"
          f"  per stage (ms/step)")
    for n in ns:
        caches = [model.new_cache(ctx=48 + reps + 2) for _ in range(n)]
        model.forward_ragged([(c, rng.integers(3, model.vocab_size, 48)) for c in caches])
        _, routing = model.forward_ragged([(c, [5]) for c in caches], return_routing=True)
        model.timings.reset()
        t0 = time.perf_counter()
        for _ in range(reps):
            model.forward_ragged([(c, [5]) for c in caches])
        ms = (time.perf_counter() - t0) / reps * 1e3
        stages = ", ".join(f"{k} {v / reps * 1e3:.2f}" for k, v in model.timings.seconds.items()
                           if v > 0)
        ceiling = (n * bw / step_bytes(per_token, routing, one) if per_token else float("nan"))
        tps = n / ms * 1e3
        print(f"{n:>3} {ms:>8.2f} {ms / n:>9.3f} {tps:>8.1f} {ceiling:>8.1f} "
              f"{tps / ceiling:>7.2f}  {stages}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="a .colibri file (default: shipped)")
    ap.add_argument("--concurrency", default="1,2,4,8", help="comma-separated N (default 1,2,4,8)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--gen", type=int, default=64, help="new tokens per request")
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk of the Scheduler")
    ap.add_argument("--reps", type=int, default=2, help="runs per setting (the best is kept)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--activations", default=colibri.engine.model.DEFAULT_ACTIVATIONS)
    ap.add_argument("--steps-only", action="store_true",
                    help="only the ragged step table (no generate / Scheduler runs)")
    args = ap.parse_args(argv)
    path = args.model or colibri.default_model_path()
    model = colibri.load(path, threads=args.threads, activations=args.activations)
    ns = [int(v) for v in args.concurrency.split(",") if v.strip()]
    rng = np.random.default_rng(0)
    print(f"model {os.path.basename(str(path))}: {model.config.family}, "
          f"{model.n_layers} layers, D {model.hidden_size}, E {model.config.num_experts} "
          f"top-{model.config.num_experts_per_tok}; threads {model.threads}, "
          f"activations {model.activations}; prompt {args.prompt}, gen {args.gen}")
    print(f"uptime before: {_uptime()}")
    if args.steps_only:
        step_table(model, ns, path=path)
        print(f"uptime after: {_uptime()}")
        return
    batched(model, [list(rng.integers(3, model.vocab_size, args.prompt))], 4, args.chunk)  # warm
    print(f"{'N':>3} {'sequential tok/s':>17} {'batched tok/s':>14} {'ratio':>6} "
          f"{'step ms':>8} {'same tokens':>11}")
    for n in ns:
        prompts = [list(map(int, rng.integers(3, model.vocab_size, args.prompt)))
                   for _ in range(n)]
        seq, bat = [], []
        for _ in range(args.reps):            # alternated: a load that drifts hits both
            seq.append(sequential(model, prompts, args.gen))
            bat.append(batched(model, prompts, args.gen, args.chunk))
        seq_s, seq_out = min(seq, key=lambda r: r[0])
        bat_s, bat_out, steps = min(bat, key=lambda r: r[0])
        tokens = n * args.gen
        print(f"{n:>3} {tokens / seq_s:>17.1f} {tokens / bat_s:>14.1f} "
              f"{seq_s / bat_s:>6.2f} {bat_s / steps * 1e3:>8.2f} "
              f"{str(seq_out == bat_out):>11}")
    step_table(model, ns, path=path)
    print(f"uptime after: {_uptime()}")


if __name__ == "__main__":
    main()
