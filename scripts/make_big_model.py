"""Write a Mixtral-8x7B-shaped q4 .colibri file with random weights (~26 GB): the on-disk
larger-than-RAM benchmark of issue 16 (docs/memory.md).

    python scripts/make_big_model.py --out BIGDIR/mixtral-8x7b-q4.colibri
    python scripts/make_big_model.py --out small.colibri --layers 2      # a quick check

Geometry: Mixtral-8x7B (hidden 4096, expert intermediate 14336, 32 layers, 32 heads / 8 KV
heads, 8 experts top-2, vocab 32000, untied head; 46.7 B parameters, 12.9 B active per
token). Every matrix (experts, attention, head) is q4 with group 32, as `colibri convert
--quant q4 --quantize experts,attn,head` writes it; routers and norms f32, the embedding bf16.
No tokenizer: the benchmarks feed token ids.

No Hugging Face folder and no f32 copy of the model: colibri's format writer
(colibri.format.writer.ColibriWriter) plans the layout, then each tensor is written as it is
drawn. A q4 tensor is written as raw rows: uniform random nibbles (q in [-7, 7], zero mean)
and f16 scales of 0.02 / 4.3 (so the weights have the transformers init's std of 0.02) with a +-25 %
spread; nothing is encoded, so the writing runs at the disk's speed. At most one tensor (an
expert's 14336 x 4096 matrix, 33 MB of q4; or the 262 MB bf16 embedding) is in memory at a
time. Without --checksums the file has no CRCs (the reader skips what is not there).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from colibri import dtypes
from colibri.convert import Plan, quant_role
from colibri.families import canonical_tensors, get_family
from colibri.format.writer import ColibriWriter, TensorSpec
from colibri.quant import f32_to_bf16

MIXTRAL_8X7B = dict(
    model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
    tie_word_embeddings=False, max_position_embeddings=32768, rope_theta=1e6,
    rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=1, eos_token_id=2,
    torch_dtype="bfloat16")
QUANTIZED_ROLES = ("experts", "attn", "head")
INIT_STD = 0.02
NIBBLE_STD = math.sqrt((15**2 - 1) / 12)        # std of q uniform in [-7, 7]: 4.32
ROW_CHUNK_BYTES = 1 << 25                        # raw bytes drawn at a time


def plan_tensors(hf_config: dict, group_size: int) -> tuple[Plan, list[TensorSpec]]:
    """The Plan (for its metadata) and the writer's specs, by colibri's conversion rules."""
    family = get_family(hf_config["model_type"])
    cfg = family.model_config(hf_config)
    specs = []
    for t in canonical_tensors(cfg):
        role = quant_role(t.kind)
        if role in QUANTIZED_ROLES:
            dtype, g = "q4", group_size
        elif t.kind == "tok_embeddings":
            dtype, g = "bf16", 0
        else:                                     # routers, norms
            dtype, g = "f32", 0
        kind = "router" if t.kind == "moe.router" else "expert" if t.expert is not None \
            else "dense"
        specs.append(TensorSpec(t.name, dtype, tuple(t.shape), g, kind,
                                t.layer if kind != "dense" else None, t.expert, t.proj))
    plan = Plan(Path("random-mixtral-8x7b"), family, hf_config, cfg, [], "bf16", "q4",
                group_size, list(QUANTIZED_ROLES), "f32")
    return plan, specs


def q4_rows(rng: np.random.Generator, rows: int, cols: int, group_size: int) -> np.ndarray:
    """Raw q4 rows (uint8, rows * row_stride bytes): random nibbles, then f16 scales."""
    ng = cols // group_size
    out = np.empty((rows, cols // 2 + 2 * ng), dtype=np.uint8)
    # nibbles 1..15 (q in [-7, 7]): zero mean. All 16 values (q in [-8, 7]) would give every
    # matrix a mean of -scale/2, a rank-1 part that pushes every token's hidden state along
    # one direction, so that every router picks the same experts and any cache hits
    nib = rng.integers(1, 16, size=(rows, cols), dtype=np.uint8)
    out[:, :cols // 2] = nib[:, 0::2] | (nib[:, 1::2] << 4)
    scale = INIT_STD / NIBBLE_STD
    scales = (scale * rng.uniform(0.75, 1.25, size=(rows, ng))).astype(np.float16)
    out[:, cols // 2:] = scales.view(np.uint8)
    return out.reshape(-1)


def dense_values(rng: np.random.Generator, spec: TensorSpec) -> np.ndarray:
    """f32 / bf16 values: norm weights 1, routers and the embedding N(0, INIT_STD)."""
    if spec.name.endswith("norm"):
        return np.ones(spec.shape, dtype=np.float32)
    return (rng.standard_normal(spec.shape, dtype=np.float32) * np.float32(INIT_STD))


def write_q4(writer: ColibriWriter, rng: np.random.Generator, spec: TensorSpec) -> None:
    rows, cols = math.prod(spec.shape[:-1]), spec.shape[-1]
    stride = dtypes.tensor_nbytes("q4", (1, cols), spec.group_size)
    # one tensor's raw bytes at a time (the largest, 14336 x 4096, is 33 MB)
    data = np.concatenate([q4_rows(rng, min(step, rows - r0), cols, spec.group_size)
                           for step in [max(1, ROW_CHUNK_BYTES // stride)]
                           for r0 in range(0, rows, step)])
    writer.write(spec.name, data, raw=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the .colibri file to write")
    ap.add_argument("--layers", type=int, default=32, help="fewer layers for a quick check")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checksums", action="store_true", help="store CRC32s (slower)")
    ap.add_argument("--force", action="store_true", help="overwrite --out")
    args = ap.parse_args()
    hf_config = dict(MIXTRAL_8X7B, num_hidden_layers=args.layers)
    plan, specs = plan_tensors(hf_config, args.group_size)
    total = sum(dtypes.tensor_nbytes(s.dtype, s.shape, s.group_size) for s in specs)
    out = Path(args.out)
    free = os.statvfs(out.parent).f_bavail * os.statvfs(out.parent).f_frsize
    if total > free:
        print(f"{out.parent}: {free / 1e9:.1f} GB free, the file needs {total / 1e9:.1f} GB",
              file=sys.stderr)
        return 1
    print(f"writing {out}: {len(specs)} tensors, {total / 1e9:.2f} GB", flush=True)
    rng = np.random.default_rng(args.seed)
    t0, done, next_report = time.perf_counter(), 0, 0.0
    with ColibriWriter(out, specs, plan.metadata({"note": "random weights"}),
                       n_layers=plan.config.num_hidden_layers,
                       n_experts=plan.config.num_experts, checksums=args.checksums,
                       overwrite=args.force) as writer:
        for s in specs:
            if s.dtype == "q4":
                write_q4(writer, rng, s)
            else:
                values = dense_values(rng, s)
                writer.write(s.name, values if s.dtype == "f32" else f32_to_bf16(values))
                del values
            done += dtypes.tensor_nbytes(s.dtype, s.shape, s.group_size)
            if time.perf_counter() - t0 >= next_report:
                print(f"  {done / 1e9:6.2f} / {total / 1e9:.2f} GB, "
                      f"{done / 1e9 / max(1e-9, time.perf_counter() - t0):.2f} GB/s",
                      flush=True)
                next_report += 30
        writer.finish()
    print(f"wrote {out} ({os.path.getsize(out) / 1e9:.2f} GB) in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
