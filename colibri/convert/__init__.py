"""A Hugging Face checkpoint folder (or a llama.cpp GGUF file) -> one .colibri file, streamed
tensor by tensor.

    convert(src, dst, dtype="auto", quant="none", quantize=("experts", "shared"))

Two stages:
1. plan(): read config.json, pick the family, derive the ModelConfig, list the canonical tensors
   with the shapes config.json implies, and match every one to a checkpoint key (shapes and
   dtypes come from the safetensors headers; no tensor data is read). Every mismatch is an
   error that names the checkpoint key, the config fields and expected vs found; a checkpoint
   key nobody claims is an error too.
2. convert(): a ColibriWriter is planned from the TensorSpecs; then each tensor is read (one
   at a time, shard by shard), checked for non-finite values, encoded and written, and
   dropped. Peak memory is a small multiple of the largest tensor. The writer writes a temp
   file beside DST and renames it at the end, so an interrupted conversion leaves no DST,
   and converting onto a file a server maps is safe: DST is never opened for writing, the
   server keeps the old inode's bytes until it reloads (format/writer.py), and the temp
   files of killed conversions of the same DST are removed by the next one.

Target dtype of each tensor:
- norms, biases: f32. Routers and the shared-expert gate: `router_dtype` (f32 by default;
  routing decisions are sensitive to error).
- everything else: `quant` (q8/q4) when its role is in `quantize`, else `dtype`;
  dtype "auto" keeps the checkpoint's dtype (bf16 stays bf16, bit-exact).
- a quantized tensor whose input dimension the group size does not divide falls back, per
  tensor, to the nearest format that holds it (smaller groups of the same format, else
  `dtype`), with one warning line listing them (llama.cpp's behaviour); the file's converter
  metadata lists them under "fallback".
Roles: experts (routed experts), shared (shared expert), attn (wq/wk/wv/wo and MLA's
projections), head (lm_head), dense (the mlp of dense layers). The embedding is never
quantized.

FP8 checkpoints (DeepSeek-V3's release: float8_e4m3fn weights, each with a float32
`<key>_scale_inv` per block of config.json's quantization_config.weight_block_size, 128 x 128)
are dequantized on reading, value * scale_inv of its block, then stored as above; "auto"
stores them as bf16 (the checkpoint's other tensors' dtype). GPT-OSS's MXFP4 experts are
stored as they ship (format mxfp4).

The modules, in the order a conversion uses them: checkpoint (the safetensors shards,
config.json and tokenizer files read), plan (every tensor matched and given its format),
fp8 (block-scaled FP8 dequantized), stream (the reading, encoding and writing: convert()),
guard (signals, the finished file validated before the rename), checks (the user metadata,
the values' finiteness, ConversionWarning), gguf_config and gguf_import (a GGUF file).
"""
from __future__ import annotations

from .checkpoint import CheckpointTensor, is_gguf, read_json, read_tokenizer, scan_checkpoint
from .checks import ConversionInterrupted, ConversionWarning, parse_meta
from .fp8 import dequantize_fp8, fp8_block
from .plan import (DEFAULT_QUANTIZE, DTYPES, QUANTS, ROLES, Plan, PlannedTensor, plan,
                   quant_role)
from .stream import convert

__all__ = ["CheckpointTensor", "ConversionInterrupted", "ConversionWarning", "DEFAULT_QUANTIZE",
           "DTYPES", "Plan", "PlannedTensor", "QUANTS", "ROLES", "convert", "dequantize_fp8",
           "fp8_block", "is_gguf", "parse_meta", "plan", "quant_role", "read_json",
           "read_tokenizer", "scan_checkpoint"]
