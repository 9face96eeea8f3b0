"""GGUF import of files made by llama.cpp's own tools, measured against llama.cpp itself:
the shipped (trained) model -> HF folder -> convert_hf_to_gguf.py (F32) -> llama-quantize
(Q8_0, Q4_0, Q4_K_M, ...) -> `colibri convert` of each GGUF; then llama-perplexity and
`colibri perplexity` on the same text, each engine's KL divergence of the quantized file
against its own F32 file.

    python scripts/check_gguf_quantize.py --llama-src SRC --llama-bin BIN [--types Q8_0,Q4_0]
        [--tokens 16384] [--ctx 256] [--work DIR]

SRC: the llama.cpp tree of the llama-cpp-python sdist (scripts/check_gguf_llamacpp.py says
how to get it); BIN: the folder with its built `llama-quantize` and `llama-perplexity`
(cmake --build build --target llama-quantize llama-perplexity). For each type the script
prints, per engine, perplexity, KL(F32 || quantized) mean and the same-top-token rate over
the same scored tokens (llama-perplexity's scheme: non-overlapping windows of --ctx tokens,
the second half of each scored; `colibri perplexity` uses the same scheme), and for the
imported file which tensors colibri kept bit for bit and which it requantized (with the
error it reported). The text is Python source from the running interpreter's standard
library (the shipped model was trained on CPython's standard library, docs/tiny-model.md):
the same bytes go to both engines, and each tokenizes them with the GGUF's tokenizer.

What it shows: Q8_0 / Q4_0 blocks are the same numbers in both engines (colibri keeps them
bit for bit), so the two engines' perplexities and KLs agree up to their arithmetic
(llama.cpp multiplies them with int8 activations; colibri here with f32, -a int16 or int8
otherwise); K-quants are requantized by colibri (docs/format.md section 14), so its KL is
larger by what the requantization costs. Bounded: ~1 min per type on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from check_gguf_llamacpp import _PATCH  # noqa: E402  (the converter with the hash patch)

SHIPPED = ROOT / "colibri" / "models" / "tiny-moe.colibri"
TEXT_MODULES = ("json/decoder.py", "json/encoder.py", "argparse.py", "textwrap.py",
                "difflib.py", "inspect.py", "dataclasses.py", "typing.py")


def export_hf(src: Path, out: Path) -> Path:
    """The shipped .colibri as a Hugging Face folder: its config.json, tokenizer files and
    every tensor widened to float32 under the checkpoint key colibri read it from."""
    import colibri
    from colibri.families import get_family
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    f = colibri.open(src)
    cfg = dict(f.config)
    fam = get_family(cfg["model_type"])
    sd = {}
    for key, canon in fam.tensor_map(f.model_config):
        sd[key] = f.to_float32(canon)
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name, text in f.tokenizer_files.items():
        (out / name).write_text(text)
    f.close()
    return out


def text_file(out: Path, n_bytes: int) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = [(stdlib / m).read_text() for m in TEXT_MODULES if (stdlib / m).is_file()]
    out.write_text("\n".join(parts)[:n_bytes])
    return out


def llama_ppl(binary: Path, gguf: Path, text: Path, ctx: int, kld: Path,
              base: bool, threads: int) -> dict:
    """llama-perplexity's final figures: with base, write the F32 logits to kld; else read
    them and report KL and same-top."""
    cmd = [str(binary / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(ctx),
           "-b", str(ctx), "-t", str(threads), "--kl-divergence-base", str(kld)]
    if not base:
        cmd.append("--kl-divergence")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    log = run.stdout + run.stderr
    if run.returncode != 0:
        raise RuntimeError(f"llama-perplexity failed on {gguf.name}: {log[-800:]}")
    res = {}
    chunks = re.findall(r"\[\d+\]([\d.]+)", log)     # the running estimate after each chunk
    if chunks:
        res["ppl"] = float(chunks[-1])
    for key, pat in (("ppl", r"Mean PPL\(Q\)\s*:\s*([\d.]+)"),
                     ("kl", r"Mean\s+KLD:\s*([-\d.e]+)"),
                     ("same_top", r"Same top p:\s*([\d.]+)")):
        m = re.search(pat, log)
        if m:
            res[key] = float(m.group(1)) / (100 if key == "same_top" else 1)
    return res


def colibri_ppl(model: Path, base: Path, text: Path, ctx: int, activations: str,
                threads: int) -> dict:
    cmd = [sys.executable, "-m", "colibri", "perplexity", str(model), "-f", str(text), "-c",
           str(ctx), "-t", str(threads), "-a", activations, "--kl-base", str(base), "-o", "json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"colibri perplexity failed on {model.name}: {run.stderr[-800:]}")
    r = json.loads(run.stdout)
    return {"ppl": r["ppl"], "kl": r["kl"]["kl_mean"], "same_top": r["kl"]["same_top"],
            "ppl_base": r["kl"]["ppl_base"], "scored": r["n_scored"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-src", required=True, type=Path)
    ap.add_argument("--llama-bin", required=True, type=Path)
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_K_M,Q5_K_M,Q6_K")
    ap.add_argument("--bytes", type=int, default=200_000, help="bytes of text (default 200k)")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("-a", "--activations", default="int8",
                    help="colibri's activations (default int8: llama.cpp's arithmetic for "
                         "Q8_0 / Q4_0 / K-quant dots)")
    ap.add_argument("-t", "--threads", type=int, default=1,
                    help="threads of both engines (default 1: llama.cpp's OpenMP threads spin, "
                         "so on a shared machine more than one can be far slower)")
    ap.add_argument("--work", type=Path, default=None, help="keep the files here")
    args = ap.parse_args()
    import colibri
    with tempfile.TemporaryDirectory(prefix="colibri-ggufq-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        hf = export_hf(SHIPPED, work / "hf")
        text = text_file(work / "text.txt", args.bytes)
        f32 = work / "tiny-moe-F32.gguf"
        run = subprocess.run([sys.executable, "-c", _PATCH, str(args.llama_src), str(hf),
                              str(f32), "f32"], capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            raise SystemExit(f"convert_hf_to_gguf.py failed: {run.stderr[-800:]}")
        base_c = colibri.convert(f32, work / "tiny-moe-F32.colibri", force=True, progress=False)
        kld = work / "base.kld"
        lb = llama_ppl(args.llama_bin, f32, text, args.ctx, kld, base=True,
                       threads=args.threads)
        base_ppl = None
        print("| type | file MiB | colibri kept / requantized | llama.cpp ppl | colibri ppl | "
              "llama.cpp KL | colibri KL | llama.cpp same top | colibri same top |")
        print("|---|--:|---|--:|--:|--:|--:|--:|--:|")
        for t in args.types.split(","):
            q = work / f"tiny-moe-{t}.gguf"
            run = subprocess.run([str(args.llama_bin / "llama-quantize"), str(f32), str(q), t,
                                  str(args.threads)], capture_output=True, text=True, timeout=600)
            if run.returncode != 0:
                raise SystemExit(f"llama-quantize {t} failed: {run.stderr[-800:]}")
            conv = subprocess.run([sys.executable, "-m", "colibri", "convert", str(q),
                                   str(work / f"tiny-moe-{t}.colibri"), "--force"],
                                  capture_output=True, text=True, timeout=600)
            if conv.returncode != 0:
                raise SystemExit(f"colibri convert {q.name} failed: {conv.stderr[-800:]}")
            with colibri.open(work / f"tiny-moe-{t}.colibri") as cf:
                fmts = {}
                for n in cf.names():
                    d = cf.info(n).dtype
                    fmts[d] = fmts.get(d, 0) + 1
            requant = [ln for ln in (conv.stdout + conv.stderr).splitlines()
                       if "requantiz" in ln.lower()]
            lq = llama_ppl(args.llama_bin, q, text, args.ctx, kld, base=False,
                           threads=args.threads)
            cq = colibri_ppl(work / f"tiny-moe-{t}.colibri", base_c, text, args.ctx,
                             args.activations, args.threads)
            if base_ppl is None:
                base_ppl = cq["ppl_base"]
                print(f"F32 base: llama.cpp ppl {lb.get('ppl', float('nan')):.4f}, colibri ppl "
                      f"{base_ppl:.4f} ({cq['scored']} tokens scored)", flush=True)
            kept = ", ".join(f"{k} {v}" for k, v in sorted(fmts.items()))
            # "attn.wq Q5_0 -> q8: max|err|/max|w| 0.00385, ... (6 tensors)" -> "Q5_0→q8 6"
            moved: dict[str, int] = {}
            for a, b, n in re.findall(r"(\w+) -> (\w+): [^(]*\((\d+) tensors?\)",
                                      " ".join(requant)):
                moved[f"{a}→{b}"] = moved.get(f"{a}→{b}", 0) + int(n)
            note = kept + ("; requantized " + ", ".join(f"{k} {v}" for k, v in moved.items())
                           if moved else "")
            print(f"| {t} | {q.stat().st_size / 2**20:.2f} | {note} | {lq.get('ppl', 0):.4f} | "
                  f"{cq['ppl']:.4f} | {lq.get('kl', float('nan')):.2e} | {cq['kl']:.2e} | "
                  f"{lq.get('same_top', float('nan')):.3f} | {cq['same_top']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
