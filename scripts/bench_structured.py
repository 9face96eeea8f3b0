"""Per-token overhead of structured output: generate under a JSON schema vs plain, same model,
same process, runs interleaved; prints the ratio of seconds per generated token.

    python scripts/bench_structured.py [MODEL.colibri ...] [--tokens 64] [--rounds 5]

Two schemas, each keeping the grammar open for the whole token budget (stop=[]), so the
constrained run computes a mask at every step: "string" (an object with one long string:
the cheap lexer state) and "records" (an array of objects with integer, short string,
boolean and enum fields: the parser changes state every few tokens). Sampling at
temperature 0.8 with a fixed seed; the plain run uses the same settings. The first
constrained run of each model (llguidance's vocabulary table, ~0.1-1 s once per tokenizer)
is left out. No model given: the shipped one. Printed: medians of the wall and of the
process CPU time per token, and their ratios to plain (the CPU ratio is the steadier one on a
loaded machine), and the CPU time of the constraint's own work per token (replayed on fixed
logits) over a plain token's CPU time: the steadiest figure of the three.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import colibri
from colibri.generation.constraints import compile_spec

SCHEMAS = {
    "string": {"type": "object", "properties": {"text": {"type": "string",
                                                         "minLength": 100000}},
               "required": ["text"]},
    "records": {"type": "object", "required": ["rows"], "properties": {"rows": {
        "type": "array", "minItems": 100000, "items": {
            "type": "object", "required": ["id", "name", "ok", "kind"],
            "additionalProperties": False,
            "properties": {"id": {"type": "integer"},
                           "name": {"type": "string", "maxLength": 12},
                           "ok": {"type": "boolean"},
                           "kind": {"enum": ["cat", "dog", "bird"]}}}}}},
}


def per_token(model, schema: dict | None, tokens: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process) per generated token."""
    kw = {} if schema is None else dict(json_schema=schema)
    t0, c0 = time.perf_counter(), time.process_time()
    colibri.generate(model, "Once upon a time", max_new_tokens=tokens, stop=[],
                     temperature=0.8, seed=0, **kw)
    n = max(model.last_stats.generated_tokens, 1)
    return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


def constraint_cpu(model, schema: dict, tokens: int, reps: int = 5) -> float:
    """CPU seconds per token of the constraint's own work (mask, masked copy, accept),
    replaying the tokens of a constrained generation on fixed logits: the part of the
    overhead a loaded machine does not blur. Best of reps."""
    text = colibri.generate(model, "Once upon a time", max_new_tokens=tokens, stop=[],
                            temperature=0.8, seed=0, json_schema=schema)
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    spec = compile_spec(json_schema=schema)
    logits = np.random.default_rng(0).standard_normal(model.vocab_size).astype(np.float32)
    best = float("inf")
    for _ in range(reps):
        c = spec.start(model)
        c0, n = time.process_time(), 0
        for t in ids:
            if not np.isfinite(c.mask(logits)[t]):   # retokenised text may split otherwise
                break
            c.accept(t)
            n += 1
        best = min(best, (time.process_time() - c0) / max(n, 1))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help=".colibri files (default: the shipped model)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"load: {os.getloadavg()[0]:.2f} (1 min)")
    for path in args.models or [None]:
        model = colibri.load(path)
        per_token(model, SCHEMAS["string"], 8)      # builds the vocabulary table once
        runs: dict[str, list[tuple[float, float]]] = {"plain": [], **{k: [] for k in SCHEMAS}}
        for _ in range(args.rounds):
            for name in runs:                        # interleaved: drift hits all alike
                runs[name].append(per_token(model, SCHEMAS.get(name), args.tokens))
        wall = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
        cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
        name = os.path.basename(str(model.file.path))
        print(f"{name}: vocab {model.vocab_size}, plain {wall['plain'] * 1e3:.2f} ms/token "
              f"(cpu {cpu['plain'] * 1e3:.2f})")
        for k in SCHEMAS:
            own = constraint_cpu(model, SCHEMAS[k], args.tokens)
            print(f"  {k:8s} {wall[k] * 1e3:.2f} ms/token, ratio {wall[k] / wall['plain']:.3f} "
                  f"wall, {cpu[k] / cpu['plain']:.3f} cpu; the constraint's own work "
                  f"{own * 1e3:.3f} ms cpu/token = {own / cpu['plain']:.3f} of a plain token")
        model.close()


if __name__ == "__main__":
    main()
