"""GGUF import against llama.cpp's own converter: tiny checkpoints -> convert_hf_to_gguf.py ->
colibri convert -> logits against transformers on the GGUF's weights.

    python scripts/check_gguf_llamacpp.py --llama-src SRC [--families mixtral,olmoe]
        [--outtype f32,q8_0,bf16]

SRC is the llama.cpp tree of the llama-cpp-python sdist, 0.3.36 or later (the converter split
into a `conversion` package; `pip download --no-deps --no-binary llama-cpp-python
llama-cpp-python`, unpack, SRC = llama_cpp_python-<v>/vendor/llama.cpp); nothing of it is
copied into colibri. Per family and output type (f32, q8_0, bf16: the
converter's own; Q4_0 and K-quants need llama-quantize, a built binary):
1. a tiny random checkpoint of tests/hf_factory.py (with the overrides of
   tests/gguf_factory.GGUF_OVERRIDES; config.json also gets the top-level `rope_theta` /
   `num_experts`, and for DeepSeek-V3 `scoring_func: sigmoid`, that hub configs have and the
   converter reads);
2. SRC/convert_hf_to_gguf.py in a subprocess, with SRC/gguf-py first on sys.path and one
   in-memory patch: the test tokenizer's pre-tokenizer hash is unknown to it, so an unknown
   hash is reported as "gpt-2" (the test tokenizer is byte-level BPE with the GPT-2 split;
   tokenizer metadata only, never a weight);
3. the same checkpoint written by tests/gguf_factory.write_gguf: every tensor must have the
   real file's name, type, shape and bytes, and every metadata key the importer reads the
   real file's value (so the fast tests' files are llama.cpp's);
4. colibri.convert of the real file, and its logits against transformers given the GGUF's
   dequantized weights (the factory's reference state dict): max relative error.
Prints one line per family and type; exit status 1 if any check fails. Bounded: a few
seconds per family.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3")
_PATCH = """
import runpy, sys
src, hf, out, outtype = sys.argv[1:5]
sys.path[:0] = [src + "/gguf-py", src]
import conversion.base as base
for cls in list(vars(base).values()):
    if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
        def patched(self, tokenizer, _original=cls.get_vocab_base_pre):
            try:
                return _original(self, tokenizer)
            except NotImplementedError:          # the test tokenizer: byte-level, GPT-2 split
                return "gpt-2"
        cls.get_vocab_base_pre = patched
sys.argv = ["convert_hf_to_gguf.py", hf, "--outtype", outtype, "--outfile", out]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def hub_style(hf_dir: Path) -> None:
    """Add the top-level config.json fields hub configs carry and the converter reads."""
    path = hf_dir / "config.json"
    cfg = json.loads(path.read_text())
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:
        cfg.setdefault("rope_theta", theta)
    if cfg.get("num_local_experts") and cfg["model_type"] != "mixtral":
        cfg.setdefault("num_experts", cfg["num_local_experts"])
    if cfg["model_type"] == "deepseek_v3":        # transformers 5 leaves these out
        cfg.update(scoring_func="sigmoid", topk_method="noaux_tc")
    path.write_text(json.dumps(cfg, indent=2))


def compare_layouts(real: Path, ours: Path) -> list[str]:
    """Differences between the converter's GGUF and the test factory's (tensors and the
    metadata keys the importer reads)."""
    import gguf
    a, b = gguf.GGUFReader(real), gguf.GGUFReader(ours)
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    out = [f"tensor names differ: only real {sorted(set(ta) - set(tb))[:4]}, only ours "
           f"{sorted(set(tb) - set(ta))[:4]}"] if set(ta) != set(tb) else []
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name], tb[name]
        if (x.tensor_type, list(x.shape)) != (y.tensor_type, list(y.shape)):
            out.append(f"{name}: real {x.tensor_type.name} {list(x.shape)}, ours "
                       f"{y.tensor_type.name} {list(y.shape)}")
        elif not np.array_equal(np.asarray(x.data).view(np.uint8),
                                np.asarray(y.data).view(np.uint8)):
            out.append(f"{name}: bytes differ")
    arch = a.fields["general.architecture"].contents()
    for key, field in a.fields.items():
        if key.startswith(arch + ".") or key.startswith("tokenizer.ggml.") or \
                key == "tokenizer.chat_template":
            other = b.fields.get(key)
            if other is None or other.contents() != field.contents():
                out.append(f"metadata {key}: real {field.contents()!r:.60}, ours "
                           f"{other.contents() if other else None!r:.60}")
    return out


def check(family: str, outtype: str, src: Path, work: Path) -> bool:
    import torch
    import transformers

    import colibri
    import colibri.api as api
    from gguf_factory import GGUF_OVERRIDES, write_gguf
    from hf_factory import make_hf_checkpoint
    from safetensors.numpy import save_file

    hf = make_hf_checkpoint(work / family / "hf", family, **GGUF_OVERRIDES.get(family, {}))
    hub_style(hf)
    real = work / family / f"real-{outtype}.gguf"
    run = subprocess.run([sys.executable, "-c", _PATCH, str(src), str(hf), str(real), outtype],
                         capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        print(f"{family:12s} {outtype:5s} llama.cpp's converter failed: "
              f"{run.stderr.strip().splitlines()[-1]}")
        return False
    qtype = {"f32": "F32", "q8_0": "Q8_0", "bf16": "BF16", "f16": "F16"}[outtype]
    ours, ref = write_gguf(hf, work / family / f"ours-{outtype}.gguf", qtype)
    diffs = compare_layouts(real, ours)
    dst = colibri.convert(real, work / family / f"real-{outtype}.colibri", progress=False,
                          force=True)
    folder = work / family / "ref"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text((hf / "config.json").read_text())
    save_file({k: np.ascontiguousarray(v) for k, v in ref.items()}, folder / "model.safetensors")
    ids = np.array([[5, 17, 99, 3, 250, 41, 7, 120, 64, 11, 200, 33]])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).logits.numpy()
    with colibri.load(dst, threads=1, activations="f32") as m:
        got = api.forward(m, ids)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    ok = err <= 1e-4 and not diffs
    print(f"{family:12s} {outtype:5s} {'ok  ' if ok else 'FAIL'} logits max rel err "
          f"{err:.1e}; layout vs tests/gguf_factory: "
          f"{'identical' if not diffs else '; '.join(diffs[:3])}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-src", required=True, type=Path,
                    help="llama.cpp tree of the llama-cpp-python sdist")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--outtype", default="f32,q8_0", help="comma-separated: f32, q8_0, bf16")
    args = ap.parse_args()
    if not (args.llama_src / "convert_hf_to_gguf.py").is_file():
        ap.error(f"{args.llama_src}: no convert_hf_to_gguf.py")
    import transformers
    transformers.utils.logging.disable_progress_bar()
    ok = True
    with tempfile.TemporaryDirectory(prefix="colibri-gguf-") as tmp:
        for family in args.families.split(","):
            for outtype in args.outtype.split(","):
                ok &= check(family, outtype, args.llama_src, Path(tmp))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
