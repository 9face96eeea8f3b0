"""llama.cpp on the benchmark models: the GGUF files from the same weights, and pp/tg timings
measured the way llama-bench measures them, through llama-cpp-python (scripts/bench.py calls
this; it also runs on its own).

    python scripts/bench_llama_cpp.py gguf bench-models/mixtral-mini/hf OUT --llama-src SRC
    python scripts/bench_llama_cpp.py bench OUT/mixtral-mini-Q4_0.gguf --threads 1,2

Needs the optional `bench` extra: llama-cpp-python built from source (its sdist vendors the
llama.cpp tree), torch and sentencepiece (the converter imports them); the quantizing step
also runs with only a `llama-quantize` executable built from that tree.

How the GGUF files are made (the same weights, stated bits per weight):
1. SRC is the llama.cpp tree of the llama-cpp-python sdist, the same commit the installed
   binding was built from: `pip download --no-deps --no-binary llama-cpp-python
   llama-cpp-python` and unpack; SRC = llama_cpp_python-<v>/vendor/llama.cpp.
2. HF folder -> `<name>-BF16.gguf` with SRC/convert_hf_to_gguf.py --outtype bf16, run with
   SRC/gguf-py first on sys.path (the `gguf` writer of the same commit; the PyPI `gguf`
   package is the same writer, possibly older). One patch, applied in memory: the synthetic
   tokenizer of make_bench_models.py has a pre-tokenizer hash the converter does not know;
   its pre-tokenizer is byte-level BPE with the GPT-2 split regex, so an unknown hash is
   mapped to "gpt-2". This touches tokenizer metadata only, never a weight.
3. BF16 -> Q4_0 and Q8_0 with llama.cpp's quantizer (llama_model_quantize through the
   binding, default parameters, as `llama-quantize` does; without the binding, the
   `llama-quantize` executable of $LLAMA_QUANTIZE, SRC/build/bin or PATH): Q4_0 is 4.5
   bits per weight (32 4-bit codes + an f16 scale per block), Q8_0 8.5; llama.cpp keeps
   the output head of a Q4_0 file at Q6_K and the routers at f32 (see the bytes per token
   it reports).

Timings (same definitions as llama-bench and colibri bench): pp{P} = one decode call over P
random ids into an empty context, t/s = P / s; tg{N} = N single-token decode calls from an
empty context. One untimed warm-up, then `reps` repetitions; mean and sd of t/s.
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

GGUF_TYPES = {"q4": "Q4_0", "q8": "Q8_0", "bf16": "BF16"}


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def find_src(explicit: str | None = None) -> Path | None:
    """The llama.cpp tree: --llama-src, else $LLAMA_CPP_SRC; None if neither is a tree."""
    for cand in (explicit, os.environ.get("LLAMA_CPP_SRC")):
        if cand and (Path(cand) / "convert_hf_to_gguf.py").is_file():
            return Path(cand)
    return None


# ---------------------------------------------------------------------------------------------
# GGUF files


def _convert_in_process(src: Path, hf: Path, out: Path) -> None:
    """Run SRC/convert_hf_to_gguf.py (bf16) with the unknown-hash -> gpt-2 patch."""
    sys.path.insert(0, str(src / "gguf-py"))
    sys.path.insert(0, str(src))
    import conversion.base as base

    for cls in vars(base).values():
        if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
            original = cls.get_vocab_base_pre

            def patched(self, tokenizer, _original=original):
                try:
                    return _original(self, tokenizer)
                except NotImplementedError:         # synthetic byte-level BPE: GPT-2 split
                    return "gpt-2"
            cls.get_vocab_base_pre = patched
    sys.argv = ["convert_hf_to_gguf.py", str(hf), "--outtype", "bf16", "--outfile", str(out)]
    runpy.run_path(str(src / "convert_hf_to_gguf.py"), run_name="__main__")


def quantize(src_gguf: Path, dst: Path, gguf_type: str, threads: int = 2,
             src: Path | None = None) -> None:
    """BF16 GGUF -> gguf_type through the binding; without it, through the `llama-quantize`
    executable ($LLAMA_QUANTIZE, SRC/build/bin or PATH): the same llama_model_quantize."""
    try:
        import llama_cpp
    except ImportError:
        exe = next((str(c) for c in (os.environ.get("LLAMA_QUANTIZE"),
                                     src and src / "build" / "bin" / "llama-quantize")
                    if c and Path(c).is_file()), None) or shutil.which("llama-quantize")
        if exe is None:
            raise RuntimeError("quantizing needs llama-cpp-python or a llama-quantize "
                               "executable ($LLAMA_QUANTIZE, SRC/build/bin or PATH)") from None
        tmp = dst.with_suffix(".gguf.tmp")
        subprocess.run([exe, str(src_gguf), str(tmp), gguf_type, str(threads)], check=True,
                       stdout=subprocess.DEVNULL)
        tmp.rename(dst)
        return
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{gguf_type}")
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src_gguf).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {src_gguf} -> {gguf_type} failed ({rc})")


def make_gguf(hf: Path, out_dir: Path, src: Path, quants=("q4", "q8", "bf16"),
              name: str | None = None, threads: int = 2) -> dict[str, Path]:
    """{colibri quant: GGUF path} for the HF folder; existing files are kept."""
    name = name or hf.parent.name
    out_dir.mkdir(parents=True, exist_ok=True)
    bf16 = out_dir / f"{name}-BF16.gguf"
    files = {q: out_dir / f"{name}-{GGUF_TYPES[q]}.gguf" for q in quants}
    if all(p.exists() for p in files.values()):
        return files
    if not bf16.exists():
        tmp = bf16.with_suffix(".gguf.tmp")
        subprocess.run([sys.executable, __file__, "_convert", str(src), str(hf), str(tmp)],
                       check=True)
        tmp.rename(bf16)
    for q, path in files.items():
        if q != "bf16" and not path.exists():
            quantize(bf16, path, GGUF_TYPES[q], threads, src)
    return files


def bytes_per_token(path: Path, src: Path | None = None) -> int | None:
    """Bytes a decode step reads from a GGUF (attention, routers, top-k experts, norms,
    head, one embedding row), from its tensor table; None without the gguf reader."""
    if src is not None:
        sys.path.insert(0, str(src / "gguf-py"))
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    r = GGUFReader(str(path))
    k = None
    for key, f in r.fields.items():
        if key.endswith(".expert_used_count"):
            k = int(f.parts[f.data[0]][0])
    total = 0
    for t in r.tensors:
        nb = int(t.n_bytes)
        if t.name == "token_embd.weight":
            if not any(u.name == "output.weight" for u in r.tensors):
                total += nb                          # tied head reads the whole matrix
            total += nb // int(t.shape[-1])
        elif "_exps." in t.name:                     # (E, rows, cols) stacks: k of E
            total += nb * (k or 1) // int(t.shape[-1])
        else:
            total += nb
    return total


# ---------------------------------------------------------------------------------------------
# timings


def bench_gguf(path: Path, threads: list[int], n_prompt: int = 128, n_gen: int = 64,
               reps: int = 5, seed: int = 0) -> list[dict]:
    """pp{n_prompt} / tg{n_gen} rows for each thread count (see the module doc)."""
    import llama_cpp
    rows = []
    for t in threads:
        llm = llama_cpp.Llama(str(path), n_ctx=max(n_prompt, n_gen) + 8, n_batch=512,
                              n_ubatch=512, n_threads=t, n_threads_batch=t, verbose=False,
                              logits_all=False)
        rng = np.random.default_rng(seed)
        vocab = llm.n_vocab()
        for kind, n in (("pp", n_prompt), ("tg", n_gen)):
            if n <= 0:
                continue
            samples = []
            for rep in range(reps + 1):                  # rep 0: warm-up
                ids = [int(i) for i in rng.integers(0, vocab, n)]
                llm.reset()
                t0 = time.perf_counter()
                if kind == "pp":
                    llm.eval(ids)
                else:
                    for tok in ids:
                        llm.eval([tok])
                dt = time.perf_counter() - t0
                if rep:
                    samples.append(n / dt)
            rows.append({"engine": "llama.cpp", "model_path": str(path), "test": f"{kind}{n}",
                         "n_threads": t, "samples_ts": samples,
                         "avg_ts": float(np.mean(samples)),
                         "stddev_ts": float(np.std(samples, ddof=1)) if reps > 1 else 0.0})
        del llm
    return rows


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "_convert":
        _convert_in_process(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gguf", help="HF folder -> GGUF files")
    g.add_argument("hf")
    g.add_argument("out")
    g.add_argument("--llama-src", default=None)
    g.add_argument("--quants", default="q4,q8,bf16")
    b = sub.add_parser("bench", help="time a GGUF file")
    b.add_argument("gguf")
    b.add_argument("--threads", default="1,2")
    b.add_argument("--reps", type=int, default=5)
    b.add_argument("--n-prompt", type=int, default=128)
    b.add_argument("--n-gen", type=int, default=64)
    args = ap.parse_args(argv)
    if args.cmd == "gguf":
        src = find_src(args.llama_src)
        if src is None:
            ap.error("no llama.cpp tree: give --llama-src or set LLAMA_CPP_SRC (see the doc)")
        hf = Path(args.hf)
        files = make_gguf(hf, Path(args.out), src, tuple(args.quants.split(",")),
                          name=hf.parent.name if hf.name == "hf" else hf.name)
        print(json.dumps({k: str(v) for k, v in files.items()}, indent=2))
    else:
        rows = bench_gguf(Path(args.gguf), [int(t) for t in args.threads.split(",")],
                          args.n_prompt, args.n_gen, args.reps)
        for r in rows:
            print(f"{Path(r['model_path']).name} threads {r['n_threads']} {r['test']}: "
                  f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} t/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
