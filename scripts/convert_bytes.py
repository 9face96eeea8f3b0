"""The converter's output bytes before / after a change: tiny checkpoints of every kind
converted at every option, and the files compared byte for byte.

    python scripts/convert_bytes.py WORK convert before     # sources made once, then converted
    ... change the converter ...
    python scripts/convert_bytes.py WORK convert after
    python scripts/convert_bytes.py WORK compare before after

The sources (WORK/sources, made on first use, reused after so both runs read the same bytes):
every family of tests/hf_factory.py (f32; Mixtral also bf16 and sharded), DBRX, Granite-MoE,
PhiMoE and GPT-OSS from their test files' configs, DeepSeek-V3 with FP8 block-scaled
projections (scales in a second shard), GPT-OSS with its released MXFP4 experts, and GGUF
files of tests/gguf_factory.py (F32, BF16, Q8_0, Q4_0, and Q4_K / Q6_K experts). Each is
converted at --dtype auto/f32/f16/bf16 x --quant none/q8/q4 plus a few --quantize /
--group-size / --router-dtype / --meta variants (through the CLI); the GGUF files at their
--quant / --dtype choices; what a conversion refuses is recorded (its message) instead.

The metadata holds the conversion date (converter.date, seconds): the comparison masks its 25
characters and the 8 hex digits of the metadata CRC32 (which covers it) in both files, after
checking that each file's metadata and tensor checksums verify (ColibriFile.validate);
every other byte must be equal.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shutil
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

DTYPES = ("auto", "f32", "f16", "bf16")
QUANTS = ("none", "q8", "q4")
EXTRA = [  # CLI argument lists beyond the dtype x quant grid
    ["--quant", "q8", "--quantize", "experts,shared,attn,head,dense"],
    ["--quant", "q4", "--quantize", "attn", "--group-size", "32"],
    ["--quant", "q8", "--group-size", "64", "--router-dtype", "bf16"],
    ["--dtype", "f16", "--router-dtype", "auto", "--meta", "licence=apache-2.0", "note=a=b"],
    ["--no-checksums", "--dtype", "bf16"],
    ["--quant", "q8", "--group-size", "48"],                       # refused
    ["--quant", "q4", "--quantize", "experts,bogus"],              # refused
]
GGUF_OPTIONS = [[], ["--quant", "q8"], ["--quant", "q4"], ["--dtype", "f16"], ["--dtype", "f32"],
                ["--dtype", "bf16"], ["--meta", "source=gguf"]]
DATE = re.compile(rb'"date": "(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00)"')
CRC = re.compile(rb'"metadata_crc32": "([0-9a-f]{8})"}')


def make_sources(out: Path) -> None:
    import numpy as np
    from hf_factory import FAMILY_NAMES, OTHER_FAMILY_NAMES, make_hf_checkpoint
    from family_parity import make_checkpoint
    from gguf_factory import GGUF_OVERRIDES, write_gguf
    import test_family_deepseek_v3 as v3
    import test_family_gpt_oss as gpt
    from test_family_dbrx import dbrx_config
    from test_family_granitemoe import VARIANTS as GRANITE
    from test_family_phimoe import BASE as PHI, VARIANTS as PHI_VARIANTS
    from test_gguf_import import _random_blocks, _rewrite
    import transformers
    from gguf import GGMLQuantizationType as T

    out.mkdir(parents=True)
    hf = out / "hf"
    for fam in FAMILY_NAMES + OTHER_FAMILY_NAMES:
        make_hf_checkpoint(hf / fam, fam)
    make_hf_checkpoint(hf / "mixtral-bf16", "mixtral", dtype="bfloat16")
    make_hf_checkpoint(hf / "olmoe-no-tokenizer", "olmoe", tokenizer=False)
    make_hf_checkpoint(hf / "qwen2_moe-sharded", "qwen2_moe", sharded=True, seed=3)
    make_checkpoint(hf / "dbrx", dbrx_config())
    for name, config in GRANITE.items():
        make_checkpoint(hf / name, config())
    for name, variant in PHI_VARIANTS.items():
        make_checkpoint(hf / f"phimoe-{name}", transformers.PhimoeConfig(**PHI, **variant))
    make_checkpoint(hf / "gpt_oss", gpt.gpt_oss_config())
    fp8, _ = v3._fp8_checkpoint(hf / "deepseek_v3", hf / "deepseek_v3-fp8")
    v3._reshard(fp8)
    folders, _ = gpt._mxfp4_checkpoint(SimpleNamespace(path=hf / "gpt_oss"), out / "mx")
    shutil.move(folders["mxfp4"], hf / "gpt_oss-mxfp4")
    shutil.rmtree(out / "mx")

    gg = out / "gguf"
    gg.mkdir()
    for fam in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3"):
        base = make_hf_checkpoint(out / "gguf-hf" / fam, fam, **GGUF_OVERRIDES.get(fam, {}))
        for qtype in ("F32", "BF16", "Q8_0", "Q4_0"):
            write_gguf(base, gg / f"{fam}-{qtype}.gguf", qtype)
    kq_hf = make_hf_checkpoint(out / "gguf-hf" / "kq", "qwen3_moe", hidden_size=256,
                               moe_intermediate_size=256, head_dim=64)
    src, _ = write_gguf(kq_hf, out / "gguf-hf" / "kq-f32.gguf", "F32")
    rng = np.random.default_rng(1)
    types = {"ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q4_K, "ffn_down_exps": T.Q6_K}

    def retype(name, t):
        q = types.get(name.split(".")[-2])
        return (_random_blocks(tuple(reversed([int(d) for d in t.shape])), q, rng), q) \
            if q else None
    _rewrite(src, gg / "qwen3_moe-kquants.gguf", retype=retype)
    (gg / "not-gguf.gguf").write_bytes(b"GGUX" + bytes(60))           # refused


def run_cli(argv: list[str]) -> tuple[int, str]:
    """colibri's CLI in this process: (exit status, the warnings and stderr)."""
    from colibri.cli import main
    err = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(err):
        warnings.simplefilter("always")
        code = main(argv)
    notes = [f"{w.category.__name__}: {w.message}" for w in caught]
    return code, "\n".join(notes + err.getvalue().strip().splitlines())


def convert_all(work: Path, label: str) -> None:
    src = work / "sources"
    if not src.exists():
        make_sources(src)
    out = work / label
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    jobs = []
    for folder in sorted((src / "hf").iterdir()):
        grid = [["--dtype", d, "--quant", q] for d in DTYPES for q in QUANTS]
        for args in grid + EXTRA:
            jobs.append((folder, args))
    for path in sorted((src / "gguf").iterdir()):
        for args in GGUF_OPTIONS:
            jobs.append((path, args))
    log = {}
    for i, (path, args) in enumerate(jobs):
        name = f"{path.stem}__{'_'.join(a.lstrip('-') for a in args) or 'default'}"
        name = re.sub(r"[^A-Za-z0-9_.=,-]", "_", name)
        code, notes = run_cli(["convert", str(path), str(out / f"{name}.colibri"), "-q"] + args)
        log[name] = {"status": code, "notes": notes}
        print(f"[{i + 1}/{len(jobs)}] {name}: {code}", flush=True)
    (out / "log.json").write_text(json.dumps(log, indent=1, sort_keys=True))


def masked(path: Path) -> bytes:
    """The file's bytes with the date and the metadata CRC masked, after its checksums
    verified (both files must hold exactly one of each)."""
    from colibri.format import ColibriFile
    with ColibriFile(path) as cf:
        problems = cf.validate()
    if problems:
        raise SystemExit(f"{path}: does not validate: {problems[:3]}")
    raw = bytearray(path.read_bytes())
    for pattern in (DATE, CRC):
        found = list(pattern.finditer(raw))
        if len(found) != 1:
            raise SystemExit(f"{path}: {len(found)} matches of {pattern.pattern!r}")
        a, b = found[0].span(1)
        raw[a:b] = b"#" * (b - a)
    return bytes(raw)


def compare(work: Path, a: str, b: str) -> int:
    la = json.loads((work / a / "log.json").read_text())
    lb = json.loads((work / b / "log.json").read_text())
    bad = 0
    if la != lb:
        for k in sorted(set(la) | set(lb)):
            if la.get(k) != lb.get(k):
                print(f"DIFFERENT outcome {k}:\n  {a}: {la.get(k)}\n  {b}: {lb.get(k)}")
                bad += 1
    files = sorted(p.name for p in (work / a).glob("*.colibri"))
    if files != sorted(p.name for p in (work / b).glob("*.colibri")):
        print("DIFFERENT sets of files written")
        bad += 1
    same = 0
    for name in files:
        if masked(work / a / name) == masked(work / b / name):
            same += 1
        else:
            print(f"DIFFERENT bytes: {name}")
            bad += 1
    refused = sum(1 for v in la.values() if v["status"] != 0)
    print(f"{same} of {len(files)} files identical (date and metadata CRC masked), "
          f"{len(la)} conversions, {refused} refused with identical messages"
          if not bad else f"{bad} differences")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert")
    c.add_argument("label")
    d = sub.add_parser("compare")
    d.add_argument("a")
    d.add_argument("b")
    args = ap.parse_args()
    if args.cmd == "convert":
        convert_all(args.work, args.label)
        return 0
    return compare(args.work, args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
