"""Evaluation speed: scoring in process and through the server against prefill, and the saving
of scoring a shared multiple-choice context once.

    python scripts/bench_eval.py                                   # the shipped model
    python scripts/bench_eval.py A.colibri B.colibri --threads 2 --reps 3

For each model, on random token ids (seeded), alternating the runs rep by rep and keeping
the fastest of each:
  - pp: one forward pass over --pp tokens into an empty cache, the last row's logits
    (`colibri bench`'s pp test);
  - mc whole: --items questions of a --ctx token context and --choices continuations of
    --cont tokens, every (context, continuation) scored as one sequence
    (colibri.scoring.score, share_contexts=False: what lm-eval's hf model runs);
  - mc shared: the same pairs, each context once and its continuations on copies of its
    KV cache (ColibriLM's path);
  - rolling: --windows sequences of --pp tokens, every row scored (loglikelihood_rolling);
  - server: the mc pairs sent to `colibri serve` as lm-eval's local-completions sends them
    (token ids, {"echo": true, "logprobs": 1, "max_tokens": 1}, one request per question
    with its --choices prompts), one request at a time. Each rep sends questions of its own
    (the same shapes, other ids): the server's prefix cache keeps the scored contexts of a
    question, and a question sent twice would be served from it the second time. The
    log-likelihoods it returns for the in-process questions, sent once more untimed, are
    checked against mc whole's (--tol).
Tokens/s counts the tokens of the pairs (context + continuation), whatever a path runs, so a
path that runs fewer tokens (shared) shows as faster. Printed ratios: mc whole / pp and
rolling / pp (target >= 0.9), server / mc whole (target >= 0.7), server / mc shared (the
server against ColibriLM's own path), mc shared / mc whole (the saving), each next to
`uptime`. The server runs in a subprocess with the same threads,
activations and KV dtype (--no-server skips it).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

import colibri
from colibri.api import default_model_path
from colibri.scoring import DEFAULT_BATCH_TOKENS, score


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load " + " ".join(f"{v:.2f}" for v in os.getloadavg())


def mc_items(model, items: int, ctx: int, choices: int, cont: int, seed: int):
    """[(context ids, [continuation ids] * choices)] of random ids (seed < 0: the warm-up's)."""
    rng = np.random.default_rng([abs(seed), int(seed < 0)])
    V = model.vocab_size
    return [(rng.integers(0, V, ctx).tolist(),
             [rng.integers(0, V, cont).tolist() for _ in range(choices)]) for _ in range(items)]


def pairs_of(items) -> list[tuple[list[int], list[int]]]:
    return [(c, k) for c, conts in items for k in conts]


def time_pp(model, n: int, rng) -> float:
    cache = model.new_cache(ctx=n)
    ids = rng.integers(0, model.vocab_size, n)
    t0 = time.perf_counter()
    model.forward(ids, cache=cache, last_only=True)
    return time.perf_counter() - t0


def time_score(model, pairs, share: bool, batch_tokens: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    out = score(model, pairs, batch_tokens=batch_tokens, share_contexts=share)
    return time.perf_counter() - t0, [s.logprob for s in out]


class Server:
    """`python -m colibri serve MODEL` on a free loopback port, stopped by stop()."""

    def __init__(self, path: str, threads: int, activations: str, kv_dtype: str,
                 parallel: int, prefill_chunk: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "colibri", "serve", path, "--port", str(self.port),
             "--threads", str(threads), "--activations", activations, "--kv-dtype", kv_dtype,
             "--parallel", str(parallel), "--prefill-chunk", str(prefill_chunk),
             "--model-name", "m", "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"colibri serve exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if self.post("GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("colibri serve did not answer /health in 300 s")
            time.sleep(0.2)

    def post(self, method: str, path: str, body=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read() or b"null")
        finally:
            conn.close()

    def time_items(self, items) -> tuple[float, list[float]]:
        """Seconds and the continuations' log-likelihoods (as local-completions sums them)."""
        out = []
        t0 = time.perf_counter()
        for ctx, conts in items:
            status, body = self.post("POST", "/v1/completions", {
                "model": "m", "prompt": [ctx + k for k in conts], "echo": True,
                "logprobs": 1, "max_tokens": 1, "temperature": 0})
            if status != 200:
                raise RuntimeError(f"the server answered {status}: {body}")
            for choice, k in zip(sorted(body["choices"], key=lambda c: c["index"]), conts):
                out.append(sum(choice["logprobs"]["token_logprobs"][len(ctx):-1]))
        return time.perf_counter() - t0, out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def bench_model(path: str, args) -> dict:
    model = colibri.load(path, threads=args.threads, activations=args.activations,
                         kv_dtype=args.kv_dtype)
    rng = np.random.default_rng(args.seed)
    items = mc_items(model, args.items, args.ctx, args.choices, args.cont, args.seed)
    pairs = pairs_of(items)
    pair_tokens = sum(len(c) + len(k) for c, k in pairs)
    windows = [([int(w[0])], [int(t) for t in w[1:]]) for w in
               rng.integers(0, model.vocab_size, (args.windows, args.pp))]
    window_tokens = args.windows * args.pp
    server = None if args.no_server else Server(
        path, model.threads, args.activations, args.kv_dtype, args.choices, args.prefill_chunk)
    best = {k: float("inf") for k in ("pp", "whole", "shared", "rolling", "server")}
    try:
        time_pp(model, args.pp, rng)                                   # warm-up, untimed
        time_score(model, pairs[:2], True, args.batch_tokens)
        if server is not None:
            server.time_items(mc_items(model, 1, args.ctx, args.choices, args.cont, -1))
        for rep in range(args.reps):
            best["pp"] = min(best["pp"], time_pp(model, args.pp, rng))
            dt, whole = time_score(model, pairs, False, args.batch_tokens)
            best["whole"] = min(best["whole"], dt)
            dt, shared = time_score(model, pairs, True, args.batch_tokens)
            best["shared"] = min(best["shared"], dt)
            best["rolling"] = min(best["rolling"],
                                  time_score(model, windows, False, args.batch_tokens)[0])
            if server is not None:
                fresh = mc_items(model, args.items, args.ctx, args.choices, args.cont,
                                 args.seed + 1 + rep)
                best["server"] = min(best["server"], server.time_items(fresh)[0])
        if server is not None:
            served = server.time_items(items)[1]
    finally:
        if server is not None:
            server.stop()
        model.close()
    agree = float(np.max(np.abs(np.subtract(whole, shared))))
    row = {"model": os.path.basename(path), "threads": model.threads,
           "pp_tps": args.pp / best["pp"], "whole_tps": pair_tokens / best["whole"],
           "shared_tps": pair_tokens / best["shared"],
           "rolling_tps": window_tokens / best["rolling"], "shared_vs_whole_max_diff": agree}
    if server is not None:
        row["server_tps"] = pair_tokens / best["server"]
        row["server_vs_whole_max_diff"] = float(np.max(np.abs(np.subtract(served, whole))))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", help=".colibri files (default: the shipped model)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--activations", default="int16")
    p.add_argument("--kv-dtype", default="f16")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--items", type=int, default=8, help="multiple-choice questions")
    p.add_argument("--ctx", type=int, default=128, help="context tokens of a question")
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--cont", type=int, default=8, help="tokens of a continuation")
    p.add_argument("--pp", type=int, default=DEFAULT_BATCH_TOKENS,
                   help="pp tokens and rolling window length (default: %(default)s, the "
                        "scoring step's rows)")
    p.add_argument("--windows", type=int, default=2, help="rolling windows")
    p.add_argument("--batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS)
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_BATCH_TOKENS,
                   help="the server's --prefill-chunk (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-server", action="store_true")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    p.add_argument("--tol", type=float, default=5e-3,
                   help="largest |difference| of a log-likelihood from mc whole's, shared "
                        "and server (default: %(default)s: an f16 cache and other batches' "
                        "summation order)")
    args = p.parse_args(argv)
    paths = args.models or [str(default_model_path())]
    print(f"# before: {uptime()}")
    print(f"# mc: {args.items} questions x {args.choices} choices, context {args.ctx}, "
          f"continuation {args.cont} tokens; pp/rolling {args.pp} tokens; "
          f"activations {args.activations}, kv {args.kv_dtype}; best of {args.reps}")
    print("| model | threads | pp t/s | mc whole t/s | mc shared t/s | rolling t/s | "
          "server t/s | whole/pp | rolling/pp | server/whole | server/shared | shared/whole |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for path in paths:
        r = bench_model(path, args)
        rows.append(r)
        srv = r.get("server_tps")
        srv_tps = "-" if srv is None else f"{srv:.0f}"
        srv_ratio = "-" if srv is None else f"{srv / r['whole_tps']:.2f}"
        srv_shared = "-" if srv is None else f"{srv / r['shared_tps']:.2f}"
        print(f"| {r['model']} | {r['threads']} | {r['pp_tps']:.0f} | {r['whole_tps']:.0f} | "
              f"{r['shared_tps']:.0f} | {r['rolling_tps']:.0f} | {srv_tps} | "
              f"{r['whole_tps'] / r['pp_tps']:.2f} | {r['rolling_tps'] / r['pp_tps']:.2f} | "
              f"{srv_ratio} | {srv_shared} | {r['shared_tps'] / r['whole_tps']:.2f} |",
              flush=True)
    print(f"# after: {uptime()}")
    for r in rows:
        print(f"# {r['model']}: shared vs whole log-likelihoods max |diff| "
              f"{r['shared_vs_whole_max_diff']:.2e}"
              + (f", server vs whole {r['server_vs_whole_max_diff']:.2e}"
                 if "server_vs_whole_max_diff" in r else ""))
    if args.json:
        print(json.dumps(rows, indent=1))
    off = [(r["model"], name, r[key]) for r in rows
           for name, key in (("shared", "shared_vs_whole_max_diff"),
                             ("server", "server_vs_whole_max_diff"))
           if r.get(key, 0.0) > args.tol]
    for model, name, diff in off:
        print(f"error: {model}: {name} log-likelihoods differ from mc whole's by {diff:.2e} "
              f"(> --tol {args.tol:g})", file=sys.stderr)
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
