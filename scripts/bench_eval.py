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
    (colibri.generation.scoring.score, share_contexts=False: what lm-eval's hf model runs);
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
With --gguf (one GGUF per model: the same weights, e.g. scripts/bench_llama_cpp.py's Q4_0
of the model's HF folder) and llama.cpp's llama-perplexity (--llama-perplexity, or
$LLAMA_PERPLEXITY, or on PATH), a second table times one multiple-choice workload on three
engines: --items questions per rep of text (random lowercase words, about --ctx tokens of
question and --cont of each of --choices answers; each rep its own), tokenized as
llama-perplexity tokenizes them (question + " " + answer with the special tokens; the tokens
all answers share are the context). colibri scores them in process (mc shared) and through
the server, llama.cpp with `llama-perplexity --multiple-choice` over a task file of the same
questions (scripts/llama_mc.py; its "total time": after loading the model, to the end).
Printed: tasks/s of each, the tokens each counted (equal when the two tokenizers agree),
and how often llama.cpp picks colibri's answer (the highest mean log-probability of an
answer's tokens, llama.cpp's rule: colibri's pick is written as the correct label, so
llama.cpp's accuracy is the agreement; random weights make near ties, where q4 and Q4_0
rounding may pick differently).

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
import tempfile
import time

import numpy as np

import colibri
import llama_mc
from colibri.api import default_model_path
from colibri.generation.scoring import DEFAULT_BATCH_TOKENS, score


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


def text_tasks(tok, items: int, ctx: int, choices: int, cont: int, seed: int
               ) -> list[tuple[str, list[str]]]:
    """[(question, [answer] * choices)] of random lowercase words, the question about ctx
    tokens long and each answer about cont (tok: the model's tokenizer)."""
    rng = np.random.default_rng([seed, 2])
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))

    def words(n_tokens: int) -> str:
        text = ""
        while len(tok.encode(text, add_special_tokens=False)) < n_tokens:
            text += "".join(" " + "".join(rng.choice(letters, rng.integers(2, 9)))
                            for _ in range(4))
        return text.strip()
    return [(words(ctx), [words(cont) for _ in range(choices)]) for _ in range(items)]


def tokenized(tok, tasks) -> list[tuple[list[int], list[list[int]]]]:
    """Each task as llama-perplexity tokenizes it: (the tokens all its answers share,
    [the rest of each])."""
    out = []
    for question, answers in tasks:
        seqs = [tok.encode(question + " " + a) for a in answers]
        n = 0
        while all(len(q) > n for q in seqs) and len({q[n] for q in seqs}) == 1:
            n += 1
        if n == 0 or any(len(q) == n for q in seqs):
            raise ValueError(f"task {question[:40]!r}...: no shared context or an answer "
                             "the others start with")
        out.append((seqs[0][:n], [q[n:] for q in seqs]))
    return out


def picks(items, lls: list[float]) -> list[int]:
    """The answer of each item with the highest mean log-probability per token (first on
    ties), from the pairs' summed log-likelihoods in pairs_of order."""
    out, at = [], 0
    for _, conts in items:
        means = [lls[at + j] / len(k) for j, k in enumerate(conts)]
        at += len(conts)
        out.append(int(np.argmax(means)))
    return out


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


def bench_text(model, server: Server | None, gguf: str, binary: str, args) -> dict:
    """The three-engine table's row (module docstring): best tasks/s of each over the reps."""
    tok = model.tokenizer
    best = {k: float("inf") for k in ("shared", "server", "llama")}
    agree = n_tasks = 0
    tokens = {"colibri": 0, "llama": 0}
    text_tasks(tok, 1, args.ctx, args.choices, args.cont, 10_000)   # the tokenizer's warm-up
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            tasks = text_tasks(tok, args.items, args.ctx, args.choices, args.cont,
                               args.seed + 100 + rep)
            items = tokenized(tok, tasks)
            dt, lls = time_score(model, pairs_of(items), True, args.batch_tokens)
            best["shared"] = min(best["shared"], dt)
            if server is not None:
                best["server"] = min(best["server"], server.time_items(items)[0])
            mine = picks(items, lls)
            task_file = os.path.join(tmp, f"tasks-{rep}.bin")
            llama_mc.write_tasks(task_file, [(q, a, c) for (q, a), c in zip(tasks, mine)])
            r = llama_mc.run(binary, gguf, task_file, len(tasks), model.threads,
                             extra=args.llama_args.split())
            print(f"# llama-perplexity rep {rep}: {r['total_s']:.3f} s (its prompt eval "
                  f"time {r['eval_s']:.3f} s)", file=sys.stderr)
            best["llama"] = min(best["llama"], r["total_s"])
            agree += sum(r["correct"])
            n_tasks += len(tasks)
            tokens["llama"] = r["tokens"]
            tokens["colibri"] = sum(len(c) + sum(map(len, k)) for c, k in items)
    return {"gguf": os.path.basename(gguf), "tasks": args.items,
            "shared_tasks_s": args.items / best["shared"],
            "server_tasks_s": (args.items / best["server"] if server is not None else None),
            "llama_tasks_s": args.items / best["llama"], "tokens_colibri": tokens["colibri"],
            "tokens_llama": tokens["llama"], "agree": agree / n_tasks}


def bench_model(path: str, args, gguf: str | None = None, binary: str | None = None) -> dict:
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
        text = None if gguf is None else bench_text(model, server, gguf, binary, args)
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
    if text is not None:
        row["text"] = text
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
    p.add_argument("--gguf", default=None,
                   help="comma-separated GGUF files, one per model (the same weights): adds "
                        "the llama.cpp table")
    p.add_argument("--llama-perplexity", default=None,
                   help="llama.cpp's llama-perplexity (default: $LLAMA_PERPLEXITY, PATH)")
    p.add_argument("--llama-args", default="",
                   help="more llama-perplexity arguments, e.g. '-np 32' (default: none)")
    args = p.parse_args(argv)
    paths = args.models or [str(default_model_path())]
    ggufs = [None] * len(paths)
    binary = None
    if args.gguf:
        ggufs = args.gguf.split(",")
        binary = llama_mc.find_binary(args.llama_perplexity)
        if len(ggufs) != len(paths):
            p.error(f"--gguf names {len(ggufs)} files for {len(paths)} models")
        if binary is None:
            p.error("--gguf needs llama-perplexity: --llama-perplexity PATH, "
                    "$LLAMA_PERPLEXITY or on PATH")
        for g in ggufs:
            if not os.path.isfile(g):
                p.error(f"--gguf: no file {g}")
    print(f"# before: {uptime()}")
    print(f"# mc: {args.items} questions x {args.choices} choices, context {args.ctx}, "
          f"continuation {args.cont} tokens; pp/rolling {args.pp} tokens; "
          f"activations {args.activations}, kv {args.kv_dtype}; best of {args.reps}")
    print("| model | threads | pp t/s | mc whole t/s | mc shared t/s | rolling t/s | "
          "server t/s | whole/pp | rolling/pp | server/whole | server/shared | shared/whole |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for path, gguf in zip(paths, ggufs):
        r = bench_model(path, args, gguf, binary)
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
    texts = [r for r in rows if "text" in r]
    if texts:
        print(f"\n# the same text questions on three engines: tasks/s, best of {args.reps}; "
              f"llama-perplexity {' '.join(args.llama_args.split()) or 'defaults'}")
        print("| model | gguf | tokens colibri / llama.cpp | colibri in process | "
              "colibri server | llama.cpp | in process / llama.cpp | server / llama.cpp | "
              "same answer |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in texts:
            t = r["text"]
            srv, lcpp = t["server_tasks_s"], t["llama_tasks_s"]
            srv_s, srv_r = ("-", "-") if srv is None else (f"{srv:.1f}", f"{srv / lcpp:.2f}")
            print(f"| {r['model']} | {t['gguf']} | {t['tokens_colibri']} / {t['tokens_llama']} "
                  f"| {t['shared_tasks_s']:.1f} | {srv_s} | {lcpp:.1f} | "
                  f"{t['shared_tasks_s'] / lcpp:.2f} | {srv_r} | {100 * t['agree']:.0f}% |",
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
