"""Time to first token with and without a cached 512-token system prompt, through the real
server on loopback and the official openai client.

    python scripts/bench_prefix_cache.py                       # the shipped model
    python scripts/bench_prefix_cache.py A.colibri B.colibri --rounds 3 --threads 2

For each model a `colibri serve` subprocess on a free loopback port; one warm-up request;
then per round a new system prompt of --system-tokens tokens (words drawn at random, so no
round hits another's blocks; 32 tokens less than a context under 544, as the shipped
model's 512): request 1 (system + question A, cold: the whole prompt is prefilled) and request 2 (system + question B: the system prompt's blocks come from the
prefix cache), each streamed, the time to its first content chunk taken by the client. The
two alternate within each round, so a change of machine load hits both; the ratio printed is
the median of the rounds' TTFT2 / TTFT1 (target <= 0.2), beside the cache's hits from
/metrics and `uptime`'s load. --no-cache runs the same with --prefix-cache off (the ratio
should then be ~1).
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import numpy as np
import openai

import colibri
from colibri.format import ColibriFile
from colibri.format.tokenizer import tokenizer_from_files


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def start_server(model: str, threads: int, cache: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "colibri", "serve", model, "--port", str(port),
           "--threads", str(threads), "--parallel", "2", "--log-level", "warning"]
    if not cache:
        cmd += ["--prefix-cache", "off"]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"colibri serve {model} exited {proc.returncode}")
        try:
            get(url + "/health")
            return proc, url
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"colibri serve {model} did not answer /health in 600 s")
            time.sleep(0.2)


def system_prompt(tokenizer, n_tokens: int, rng: np.random.Generator) -> str:
    """Random words until the text is n_tokens tokens (cut at a token boundary)."""
    words = ["bread", "flour", "oven", "price", "euro", "rye", "butter", "sugar", "morning",
             "order", "delivery", "cake", "crust", "yeast", "salt", "water", "shop", "table"]
    text = ""
    while len(tokenizer.encode(text)) < n_tokens + 8:
        text += " ".join(rng.choice(words, 32)) + ". "
    return tokenizer.decode(tokenizer.encode(text)[:n_tokens])


def ttft(client: openai.OpenAI, name: str, prompt: str) -> float:
    """Seconds from sending a streamed completion to its first chunk with text."""
    t0 = time.perf_counter()
    stream = client.completions.create(model=name, prompt=prompt, max_tokens=4,
                                       temperature=0, stream=True)
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


def metric(url: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", get(url + "/metrics"), re.M)
    return float(m.group(1)) if m else float("nan")


def bench(model: str, args) -> float:
    with ColibriFile(model) as f:
        tokenizer = tokenizer_from_files(f.tokenizer_files, model)
        context = min(f.model_config.max_position_embeddings, 4096)
    n_system = min(args.system_tokens, context - 32)     # the shipped model's context is 512
    if n_system < args.system_tokens:
        print(f"{os.path.basename(model)}: context {context}: a {n_system}-token system prompt")
    proc, url = start_server(model, args.threads, not args.no_cache)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                               timeout=3600)
        name = client.models.list().data[0].id
        rng = np.random.default_rng(0)
        ttft(client, name, system_prompt(tokenizer, 64, rng))          # warm-up
        ratios = []
        for i in range(args.rounds):
            system = system_prompt(tokenizer, n_system, rng)
            t1 = ttft(client, name, system + "\nQuestion: what does a croissant cost?\n")
            t2 = ttft(client, name, system + "\nQuestion: is the rye bread baked daily?\n")
            ratios.append(t2 / t1)
            print(f"  round {i}: TTFT cold {t1 * 1e3:8.1f} ms, cached {t2 * 1e3:8.1f} ms, "
                  f"ratio {t2 / t1:.3f}", flush=True)
        hits = metric(url, "colibri_prefix_cache_hits_total")
        misses = metric(url, "colibri_prefix_cache_misses_total")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    ratio = statistics.median(ratios)
    print(f"{os.path.basename(model)}: TTFT(second) / TTFT(first) = {ratio:.3f} (median of "
          f"{args.rounds}; target <= 0.2); prefix-cache hits {hits:.0f} tokens, misses "
          f"{misses:.0f}; load {os.getloadavg()[0]:.2f}", flush=True)
    return ratio


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", help="the .colibri files (default: the shipped model)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-cache", action="store_true", help="serve with --prefix-cache off")
    args = p.parse_args()
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    for model in args.models or [str(colibri.default_model_path())]:
        bench(model, args)
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
