"""colibri against the memory-bandwidth ceiling, llama.cpp and transformers, on the benchmark
models of scripts/make_bench_models.py, in one run.

    python scripts/make_bench_models.py --out bench-models --only mixtral-mini
    python scripts/bench.py --models bench-models --only mixtral-mini --threads 1,2
    python scripts/bench.py --models bench-models --small            # the CI-scale variants
    python scripts/bench.py ... --llama-src SRC --json results.json  # + llama.cpp, + JSON

For each model and format (q4, q8, bf16: MODELS/<name>/<name>-<q>.colibri):
- colibri: colibri.tools.bench.run_bench (pp{P}, tg{N}, llama-bench style), which also measures
  the read bandwidth with colibri.kernels.read_bandwidth at the same thread count; decode is
  printed as a fraction of the ceiling bandwidth / bytes-per-token;
- llama.cpp (when llama-cpp-python is installed and --llama-src names the llama.cpp tree it
  was built from, scripts/bench_llama_cpp.py): GGUF files of the same weights, q4 -> Q4_0,
  q8 -> Q8_0, bf16 -> BF16, same threads and tests;
- transformers (when torch is installed): the HF folder at bf16, eager, same tests
  (skipped when the model would not fit in memory: transformers holds ~2x the weights);
then the ratios colibri / peer for each (model, bits, threads, test).
Everything runs in this one process (except the GGUF conversion), one engine after another,
so the ratios compare like with like on a machine whose absolute speed drifts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

FULL = ("mixtral-mini", "olmoe-16L")
SMALL = ("mixtral-mini-small", "olmoe-small")
QUANTS = ("q4", "q8", "bf16")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


# ---------------------------------------------------------------------------------------------
# transformers


def bench_transformers(hf: Path, threads: list[int], n_prompt: int, n_gen: int, reps: int,
                       seed: int = 0) -> list[dict]:
    """pp/tg of the HF folder in transformers (bf16, eager, batch 1, KV cache)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
    model.eval()
    vocab = model.config.vocab_size
    rows = []
    saved = torch.get_num_threads()
    try:
        for t in threads:
            torch.set_num_threads(t)
            rng = np.random.default_rng(seed)
            for kind, n in (("pp", n_prompt), ("tg", n_gen)):
                if n <= 0:
                    continue
                samples = []
                for rep in range(reps + 1):                     # rep 0: warm-up
                    ids = torch.from_numpy(rng.integers(0, vocab, (1, n)))
                    with torch.inference_mode():
                        t0 = time.perf_counter()
                        if kind == "pp":
                            model(ids, use_cache=True, logits_to_keep=1)
                        else:
                            past = None
                            for i in range(n):
                                out = model(ids[:, i:i + 1], past_key_values=past,
                                            use_cache=True)
                                past = out.past_key_values
                        dt = time.perf_counter() - t0
                    if rep:
                        samples.append(n / dt)
                rows.append({"engine": "transformers", "test": f"{kind}{n}", "n_threads": t,
                             "samples_ts": samples, "avg_ts": float(np.mean(samples)),
                             "stddev_ts": float(np.std(samples, ddof=1)) if reps > 1 else 0.0})
    finally:
        torch.set_num_threads(saved)
        del model
    return rows


def _fits_transformers(hf: Path) -> bool:
    """transformers peaks at ~2x the bf16 weights while loading (docs/performance.md)."""
    import psutil
    size = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    return 2.2 * size < psutil.virtual_memory().available


# ---------------------------------------------------------------------------------------------
# the run


def run(models_dir: Path, names: list[str], quants: list[str], threads: list[int],
        n_prompt: int, n_gen: int, reps: int, llama_src: str | None, peers: bool,
        say=print, activations: tuple[str, ...] = ("int16",)) -> list[dict]:
    from colibri.tools.bench import run_bench

    import bench_llama_cpp as lcpp

    src = lcpp.find_src(llama_src)
    use_llama = peers and lcpp.available() and src is not None
    try:
        import torch  # noqa: F401
        use_torch = peers
    except ImportError:
        use_torch = False
    if peers and not use_llama:
        say("llama.cpp: skipped (needs llama-cpp-python and --llama-src / LLAMA_CPP_SRC)")
    rows: list[dict] = []
    for name in names:
        root = models_dir / name
        hf = root / "hf"
        for q in quants:
            path = root / f"{name}-{q}.colibri"
            if not path.exists():
                say(f"{path}: missing (scripts/make_bench_models.py), skipped")
                continue
            # plain formats multiply f32 activations under every setting: run them once
            acts = list(activations) if q in ("q4", "q8") else ["f32"]
            for r in run_bench(path, n_prompt=n_prompt, n_gen=n_gen, threads=threads,
                               reps=reps, progress=say, activations=acts):
                rows.append({**r, "engine": "colibri", "name": name, "quant": q})
            if use_llama:
                gguf = lcpp.make_gguf(hf, root / "gguf", src, (q,), name=name)[q]
                per_token = lcpp.bytes_per_token(gguf, src)
                for r in lcpp.bench_gguf(gguf, threads, n_prompt, n_gen, reps):
                    rows.append({**r, "name": name, "quant": q, "bytes_per_token": per_token})
        if use_torch and "bf16" in quants and hf.exists():
            if _fits_transformers(hf):
                say(f"transformers: {name} bf16")
                for r in bench_transformers(hf, threads, n_prompt, n_gen, reps):
                    rows.append({**r, "name": name, "quant": "bf16"})
            else:
                say(f"transformers: {name} skipped (would not fit in memory)")
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """colibri t/s / peer t/s for each (model, quant, threads, test) both engines ran, one
    per colibri activations setting."""
    key = lambda r: (r["name"], r["quant"], r["n_threads"], r["test"])   # noqa: E731
    col: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["engine"] == "colibri":
            col.setdefault(key(r), []).append(r)
    out = []
    for r in rows:
        for c in col.get(key(r), []) if r["engine"] != "colibri" else []:
            out.append({"name": r["name"], "quant": r["quant"], "n_threads": r["n_threads"],
                        "test": r["test"], "peer": r["engine"],
                        "activations": c.get("activations", "f32"), "colibri_ts": c["avg_ts"],
                        "peer_ts": r["avg_ts"], "ratio": c["avg_ts"] / r["avg_ts"]})
    return out


def _engine(r: dict) -> str:
    acts = r.get("activations", "f32") if r["engine"] == "colibri" else "f32"
    return r["engine"] + ("" if acts == "f32" else f" ({acts} act.)")


def format_table(rows: list[dict]) -> str:
    """One line per (model, bits, engine, threads, test); the tg lines with the fraction of
    the ceiling (the read bandwidth colibri measured at that thread count / bytes per token),
    then the ratios."""
    bandwidth = {r["n_threads"]: r["read_bandwidth_gbs"] for r in rows
                 if r["engine"] == "colibri" and r.get("read_bandwidth_gbs")}
    lines = ["| model | bits | engine | threads | test | t/s | MB/token | GB/s read | "
             "of ceiling |", "|---|---|---|--:|---|--:|--:|--:|--:|"]
    for r in rows:
        bpt, bw = r.get("bytes_per_token"), bandwidth.get(r["n_threads"])
        frac = (f"{r['avg_ts'] * bpt / (bw * 1e9):.2f}"
                if r["test"].startswith("tg") and bpt and bw else "")
        lines.append(f"| {r['name']} | {r['quant']} | {_engine(r)} | {r['n_threads']} | "
                     f"{r['test']} | {r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} | "
                     f"{bpt / 1e6 if bpt else float('nan'):.1f} | "
                     f"{bw if bw else float('nan'):.1f} | {frac} |")
    rat = ratios(rows)
    if rat:
        lines += ["", "| model | bits | activations | threads | test | colibri t/s | peer t/s | "
                  "colibri / peer |", "|---|---|---|--:|---|--:|--:|--:|"]
        for r in rat:
            lines.append(f"| {r['name']} | {r['quant']} | {r['activations']} | "
                         f"{r['n_threads']} | {r['test']} | "
                         f"{r['colibri_ts']:.2f} | {r['peer_ts']:.2f} ({r['peer']}) | "
                         f"{r['ratio']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bench-models", help="make_bench_models.py --out")
    ap.add_argument("--only", action="append", default=None, help="model name (repeatable)")
    ap.add_argument("--small", action="store_true", help=f"{', '.join(SMALL)}")
    ap.add_argument("--quants", default=",".join(QUANTS))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--activations", default="f32,int16,int8",
                    help="colibri activations to run, each in turn (colibri's default is int16; "
                         "int8 / int16 apply to q4/q8 files only, the others run once as f32)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--llama-src", default=None,
                    help="llama.cpp tree of the llama-cpp-python sdist (or $LLAMA_CPP_SRC)")
    ap.add_argument("--no-peers", action="store_true", help="colibri only")
    ap.add_argument("--json", default=None, help="write every row here")
    args = ap.parse_args(argv)
    names = args.only or list(SMALL if args.small else FULL)
    say = lambda line: print(line, file=sys.stderr, flush=True)   # noqa: E731
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = run(Path(args.models), names, args.quants.split(","), _ints(args.threads),
               args.n_prompt, args.n_gen, args.reps, args.llama_src, not args.no_peers, say,
               tuple(args.activations.split(",")))
    print(format_table(rows))
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nload average (1 min) {load0:.1f} at the start, {load1:.1f} at the end, on "
          f"{os.cpu_count()} CPUs: figures taken on a busy machine understate the 2-thread "
          f"rows most (docs/performance.md)")
    if args.json:
        from colibri.tools.bench import json_ready
        Path(args.json).write_text(json.dumps({"rows": json_ready(rows),
                                               "ratios": ratios(rows)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
