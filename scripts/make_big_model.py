"""Write a Mixtral-8x7B-shaped q4 model with random weights (~26 GB), as a .colibri file or
as a llama.cpp GGUF holding the same weights: the on-disk larger-than-RAM benchmark of issue
16 (docs/memory.md).

    python scripts/make_big_model.py --out BIGDIR/mixtral-8x7b-q4.colibri
    python scripts/make_big_model.py --out BIGDIR/mixtral-8x7b-Q4_0.gguf     # the same weights
    python scripts/make_big_model.py --out small.colibri --layers 2          # a quick check

Geometry: Mixtral-8x7B (hidden 4096, expert intermediate 14336, 32 layers, 32 heads / 8 KV
heads, 8 experts top-2, vocab 32000, untied head; 46.7 B parameters, 12.9 B active per
token); `--set key=value` changes a config.json field (the tests make tiny ones). Every
matrix (experts, attention, head) is q4 with group 32, as `colibri convert --quant q4
--quantize experts,attn,head` writes it; routers and norms f32, the embedding bf16.

No Hugging Face folder and no f32 copy of the model. The tensors are drawn in colibri's
canonical order from one seeded generator, so both formats of one seed hold the same values:
a q4 tensor as raw rows (uniform random nibbles, q in [-7, 7], zero mean, and f16 scales of
0.02 / 4.3, so the weights have the transformers init's std of 0.02, with a +-25 % spread),
nothing encoded, so the writing runs at the disk's speed; at most one tensor (an expert's
14336 x 4096 matrix, 33 MB of q4, or the 262 MB bf16 embedding) is in memory at a time.

- .colibri: through colibri's format writer (colibri.format.writer.ColibriWriter). Without
  --checksums the file has no CRCs (the reader skips what is not there). No tokenizer: the
  benchmarks feed token ids.
- .gguf: llama.cpp's `llama` architecture as convert_hf_to_gguf.py writes Mixtral (its keys,
  tensor names, experts stacked per layer, q / k rows permuted for its interleaved RoPE),
  q4 as Q4_0 blocks with the same nibble bytes and scales, the embedding BF16, norms and
  routers F32, and a placeholder SentencePiece vocabulary (byte tokens + "<s>" / "</s>",
  which llama.cpp needs to load a model). The header is written by gguf.GGUFWriter, each
  tensor at its offset with pwrite as it is drawn. `colibri convert` of this GGUF gives back
  the .colibri file's tensors byte for byte (tests/test_make_big_model.py).

Both are written to a temporary file beside --out and renamed when complete.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from colibri import dtypes
from colibri.convert import Plan, quant_role
from colibri.families import canonical_tensors, get_family
from colibri.format.writer import ColibriWriter, TensorSpec
from colibri.convert.gguf_import import gguf_tensor_name
from colibri.format.quant import f32_to_bf16

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


def draw(rng: np.random.Generator, spec: TensorSpec) -> np.ndarray:
    """One tensor's stored data, drawn: raw q4 rows (uint8, R * row_stride bytes), f32 values
    or bf16 bits (uint16), as ColibriWriter.write takes them."""
    if spec.dtype == "q4":
        rows, cols = math.prod(spec.shape[:-1]), spec.shape[-1]
        stride = dtypes.tensor_nbytes("q4", (1, cols), spec.group_size)
        step = max(1, ROW_CHUNK_BYTES // stride)         # rows drawn at a time
        return np.concatenate([q4_rows(rng, min(step, rows - r0), cols, spec.group_size)
                               for r0 in range(0, rows, step)])
    values = dense_values(rng, spec)
    return values if spec.dtype == "f32" else f32_to_bf16(values)


def write_colibri(out: Path, plan: Plan, specs: list[TensorSpec], rng: np.random.Generator,
                  checksums: bool, overwrite: bool, progress) -> None:
    with ColibriWriter(out, specs, plan.metadata({"note": "random weights"}),
                       n_layers=plan.config.num_hidden_layers,
                       n_experts=plan.config.num_experts, checksums=checksums,
                       overwrite=overwrite) as writer:
        for s in specs:
            writer.write(s.name, draw(rng, s), raw=s.dtype == "q4")
            progress(s)
        writer.finish()


# --- the GGUF of the same draws --------------------------------------------------------------

GGUF_TYPES = {"q4": GGMLQuantizationType.Q4_0, "bf16": GGMLQuantizationType.BF16,
              "f32": GGMLQuantizationType.F32}


@dataclass
class GGUFTensor:
    name: str                     # e.g. "blk.3.ffn_up_exps.weight"
    shape: tuple[int, ...]        # logical, NumPy order ((E, I, D) for stacked experts)
    qtype: GGMLQuantizationType
    nbytes: int


def gguf_plan(cfg, specs: list[TensorSpec]) -> tuple[list[GGUFTensor], dict[str, tuple[int, int]]]:
    """The GGUF tensors (in order of first appearance in specs) and, per colibri tensor name,
    (index of its GGUF tensor, byte offset in it): experts are slices of their layer's
    stacked tensor."""
    canon = {t.name: t for t in canonical_tensors(cfg)}
    tensors: list[GGUFTensor] = []
    index: dict[str, int] = {}
    where: dict[str, tuple[int, int]] = {}
    for s in specs:
        t = canon[s.name]
        name = gguf_tensor_name(t.kind, t.layer)
        # colibri's q4 with groups of 32 is Q4_0's 18 bytes per block, bf16 / f32 the same
        one = dtypes.tensor_nbytes(s.dtype, s.shape, s.group_size)
        if name not in index:
            shape = (cfg.num_experts, *s.shape) if t.expert is not None else tuple(s.shape)
            index[name] = len(tensors)
            tensors.append(GGUFTensor(name, shape, GGUF_TYPES[s.dtype],
                                      dtypes.tensor_nbytes(s.dtype, shape, s.group_size)))
        where[s.name] = (index[name], one * (t.expert or 0))
    return tensors, where


def gguf_q4_blocks(raw: np.ndarray, cols: int) -> np.ndarray:
    """colibri q4 rows (R * (C/2 + C/32*2) bytes: the nibble bytes, then the f16 scales) ->
    GGUF Q4_0 rows (R, C/32*18: per block its f16 scale, then its 16 nibble bytes). The
    inverse of colibri.convert.gguf_import.gguf_q4_rows: the same bytes re-laid."""
    rows = raw.reshape(-1, cols // 2 + cols // 16)
    nib = rows[:, :cols // 2].reshape(len(rows), cols // 32, 16)
    scales = rows[:, cols // 2:].reshape(len(rows), cols // 32, 2)
    return np.concatenate([scales, nib], axis=2).reshape(len(rows), cols // 32 * 18)


def llama_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute of q / k rows (R, X): per head, the two
    RoPE halves -> interleaved pairs (whole rows move, so quantized rows move unchanged)."""
    r = rows.shape[0]
    return np.ascontiguousarray(rows.reshape(heads, 2, r // heads // 2, *rows.shape[1:])
                                .swapaxes(1, 2).reshape(rows.shape))


def gguf_data(cfg, kind: str, spec: TensorSpec, data: np.ndarray) -> np.ndarray:
    """A drawn tensor's bytes in the GGUF's layout."""
    if spec.dtype == "q4":
        data = gguf_q4_blocks(data, spec.shape[-1])
        if kind in ("attn.wq", "attn.wk"):
            data = llama_permute(data, cfg.num_attention_heads if kind == "attn.wq"
                                 else cfg.num_key_value_heads)
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def gguf_metadata(w: gguf.GGUFWriter, hf: dict) -> None:
    """The keys convert_hf_to_gguf.py writes for Mixtral (LlamaModel), and a placeholder
    SentencePiece vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then "▁t{i}"."""
    w.add_name("random Mixtral-8x7B-shaped (colibri make_big_model)")
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_rope_freq_base(hf["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_expert_used_count(hf["num_experts_per_tok"])
    w.add_expert_count(hf["num_local_experts"])
    w.add_vocab_size(hf["vocab_size"])
    w.add_rope_dimension_count(hf["hidden_size"] // hf["num_attention_heads"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    n = hf["vocab_size"]
    if n < 259:
        raise SystemExit(f"vocab_size {n}: the GGUF's vocabulary needs at least 259 tokens")
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
              *(f"\u2581t{i}" for i in range(n - 259))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL,
             *[gguf.TokenType.BYTE] * 256, *[gguf.TokenType.NORMAL] * (n - 259)]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(n - 259)])
    w.add_token_types(types)
    w.add_bos_token_id(hf["bos_token_id"])
    w.add_eos_token_id(hf["eos_token_id"])
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)


def write_gguf(out: Path, plan: Plan, specs: list[TensorSpec], rng: np.random.Generator,
               overwrite: bool, progress) -> None:
    """The GGUF of the same draws: the header by gguf.GGUFWriter, then each drawn tensor
    pwritten at its offset in the data section; a temporary file renamed at the end."""
    if out.exists() and not overwrite:
        raise SystemExit(f"{out}: exists (--force overwrites it)")
    cfg = plan.config
    tensors, where = gguf_plan(cfg, specs)
    kinds = {t.name: t.kind for t in canonical_tensors(cfg)}
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        w = gguf.GGUFWriter(tmp, "llama")
        gguf_metadata(w, plan.hf_config)
        for t in tensors:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        align = w.data_alignment
        start = w.ggml_pad(w.fout[0].tell(), align)
        w.close()
        offsets = np.cumsum([0] + [w.ggml_pad(t.nbytes, align) for t in tensors]).tolist()
        fd = os.open(tmp, os.O_WRONLY)
        try:
            os.ftruncate(fd, start + offsets[-1])
            for s in specs:
                k, at = where[s.name]
                data = gguf_data(cfg, kinds[s.name], s, draw(rng, s))
                if os.pwrite(fd, data, start + offsets[k] + at) != data.nbytes:
                    raise OSError(f"{tmp}: short write of {s.name}")
                progress(s)
            os.fsync(fd)
        finally:
            os.close(fd)
        reader = gguf.GGUFReader(tmp)                     # llama.cpp's reading of the offsets
        read = {r.name: r for r in reader.tensors}
        for t, off in zip(tensors, offsets):
            got = read[t.name]
            if got.data_offset != start + off or got.n_bytes != t.nbytes:
                raise SystemExit(f"{tmp}: {t.name} read at {got.data_offset} ({got.n_bytes} B), "
                                 f"written at {start + off} ({t.nbytes} B)")
        del reader, read
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()


def parse_set(items: list[str]) -> dict:
    """--set key=value pairs (values as JSON where they parse, else strings)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in MIXTRAL_8X7B:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(MIXTRAL_8X7B)}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True,
                    help="the file to write: .colibri, or .gguf for llama.cpp's format")
    ap.add_argument("--layers", type=int, default=32, help="fewer layers for a quick check")
    ap.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                    help="change config.json fields, e.g. hidden_size=256 (tests, checks)")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checksums", action="store_true", help="store CRC32s (slower; .colibri)")
    ap.add_argument("--force", action="store_true", help="overwrite --out")
    args = ap.parse_args(argv)
    hf_config = dict(MIXTRAL_8X7B, num_hidden_layers=args.layers, **parse_set(args.set))
    out = Path(args.out)
    as_gguf = out.suffix == ".gguf"
    if as_gguf and args.group_size != 32:
        raise SystemExit("--group-size: a GGUF's Q4_0 has groups of 32")
    plan, specs = plan_tensors(hf_config, args.group_size)
    # the same in both formats (Q4_0 blocks are colibri's q4 rows of groups of 32, re-laid)
    total = sum(dtypes.tensor_nbytes(s.dtype, s.shape, s.group_size) for s in specs)
    folder = out.parent if str(out.parent) else Path(".")
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    if total > free:
        print(f"{folder}: {free / 1e9:.1f} GB free, the file needs {total / 1e9:.1f} GB",
              file=sys.stderr)
        return 1
    print(f"writing {out}: {len(specs)} tensors, {total / 1e9:.2f} GB", flush=True)
    rng = np.random.default_rng(args.seed)
    t0, done, next_report = time.perf_counter(), 0, 0.0

    def progress(s: TensorSpec) -> None:
        nonlocal done, next_report
        done += dtypes.tensor_nbytes(s.dtype, s.shape, s.group_size)
        if time.perf_counter() - t0 >= next_report:
            print(f"  {done / 1e9:6.2f} / {total / 1e9:.2f} GB, "
                  f"{done / 1e9 / max(1e-9, time.perf_counter() - t0):.2f} GB/s", flush=True)
            next_report += 30

    if as_gguf:
        write_gguf(out, plan, specs, rng, args.force, progress)
    else:
        write_colibri(out, plan, specs, rng, args.checksums, args.force, progress)
    print(f"wrote {out} ({os.path.getsize(out) / 1e9:.2f} GB) in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
