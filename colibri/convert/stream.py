"""The conversion itself: a ColibriWriter planned from the plan's TensorSpecs, then each
tensor read (one at a time, shard by shard; FP8 dequantized, MXFP4 kept as it ships),
checked for non-finite values, encoded, written and dropped; a GGUF file handed to
gguf_import. Peak memory is a small multiple of the largest tensor."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from ..errors import ColibriError
from ..format import ColibriWriter, mxfp4, validation
from .checkpoint import (GGUF_MAGIC, INDEX_FILE, TOKENIZER_FILES, ShardReader, is_gguf,
                         open_shard, read_tokenizer)
from .checks import check_finite, check_meta, signals_raise, verify_converted
from .fp8 import dequantize_fp8
from .plan import DEFAULT_QUANTIZE, Plan, PlannedTensor, plan


def _encode(t: PlannedTensor, a: np.ndarray) -> tuple[np.ndarray, bool]:
    """(array for ColibriWriter.write, raw?). bf16 -> bf16 goes through as raw bits."""
    if t.dtype == "bf16" and a.dtype.name == "bfloat16":
        return np.ascontiguousarray(a).reshape(-1).view(np.uint16).view(np.uint8), True
    return a, False


def _mxfp4_rows(src: Path, t: PlannedTensor, reader: ShardReader) -> np.ndarray:
    """The stored bytes of an MXFP4 tensor: its rows' code bytes (the checkpoint's blocks,
    unchanged) then their E8M0 scales, uint8 1-D; a scale of 255 (NaN) is an error."""
    s = t.source
    blocks = reader.get(t.ckpt.key, s.index)
    if t.scales.shard == t.ckpt.shard:
        scales = reader.get(t.scales.key, s.scales.index)
    else:
        with open_shard(src / t.scales.shard) as f:
            sl = f.get_slice(t.scales.key)
            scales = sl[s.scales.index] if s.scales.index else f.get_tensor(t.scales.key)
    if s.post:                                   # gate / up interleaved rows
        blocks, scales = blocks[s.post], scales[s.scales.post]
    rows, cols = t.canon.shape
    nan = np.flatnonzero(scales.reshape(-1) == 255)
    if nan.size:
        raise ColibriError(f"tensor {t.name} (checkpoint {t.scales.key!r}) has {nan.size} "
                           f"E8M0 scales of 255 (NaN), first at flat index {nan[0]}")
    codes = np.ascontiguousarray(blocks).reshape(rows, cols // 2)
    return mxfp4.rows(codes, np.asarray(scales).reshape(rows, cols // 32)).reshape(-1)


def _resolve_dst(p: Plan, dst: Path, force: bool) -> Path:
    src = p.src
    if dst.is_dir():
        dst = dst / f"{src.resolve().name}.colibri"
    real, src_real = dst.resolve(), src.resolve()
    inputs = {"config.json", INDEX_FILE, *TOKENIZER_FILES, *(t.ckpt.shard for t in p.tensors)}
    if real == src_real or (real.parent == src_real and real.name in inputs):
        raise ColibriError(f"{dst}: refusing to write over {real.name}, a file of the source "
                           f"checkpoint {src}")
    if not real.parent.is_dir():
        raise ColibriError(f"{dst}: folder {dst.parent} does not exist")
    if dst.exists() and not force:
        raise ColibriError(f"{dst}: already exists (use --force to overwrite)")
    return dst


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str = "auto",
            quant: str = "none", group_size: int | None = None,
            quantize: Iterable[str] | str = DEFAULT_QUANTIZE, router_dtype: str = "f32",
            meta: Mapping[str, str] | None = None, force: bool = False,
            checksums: bool = True, progress: bool = True) -> Path:
    """Convert the Hugging Face model folder (or llama.cpp GGUF file) `src` into the .colibri
    file `dst`; return its path.

    dtype: "auto" (the checkpoint's dtype) | "f32" | "f16" | "bf16" for unquantized weights.
    quant: "none" | "q8" | "q4" for the tensors whose role is in `quantize` (roles: experts,
        shared, attn, head, dense; a list or a comma-separated string).
    group_size: scale group size of q8/q4 (default quant.DEFAULT_GROUP_SIZE, lowered to
        divide every quantized input dimension).
    router_dtype: dtype of routers and the shared-expert gate ("f32" default; "auto" follows
        dtype).
    meta: free-form user metadata, string -> string.
    force: overwrite an existing dst. dst may be a folder: <src name>.colibri inside it.
    Raises ColibriError (with names and numbers) on anything wrong with src, dst or the options.

    A GGUF file (gguf_import.convert_gguf): its Q8_0 / Q4_0 / MXFP4 / float tensors are kept
    as they are; `quant` (q8 / q4), else `dtype` (f32 / f16 / bf16), else the nearest format
    ("auto") holds the tensors of other GGUF types; group_size, quantize and router_dtype do
    not apply.
    """

    src, dst = Path(src), Path(dst)
    if is_gguf(src):
        from ..extras import require_extra
        require_extra("gguf", "gguf", f"converting {src.name} (GGUF)")   # the optional package
        from .gguf_import import convert_gguf
        return convert_gguf(src, dst, quant=quant if quant != "none" else dtype, meta=meta,
                            force=force, checksums=checksums, progress=progress)
    if src.suffix.lower() == ".gguf" and src.is_file():
        raise ColibriError(f"{src}: not a GGUF file (it does not start with the GGUF magic "
                           f"{GGUF_MAGIC!r})")
    user = check_meta(meta)
    p = plan(src, dtype=dtype, quant=quant, group_size=group_size, quantize=quantize,
             router_dtype=router_dtype)
    dst = _resolve_dst(p, dst, force)
    p.tokenizer = read_tokenizer(src)
    if p.tokenizer is not None:              # refused before any byte is written
        problems = validation.tokenizer_problems(p.tokenizer["files"], p.config.vocab_size)
        if problems:
            raise ColibriError(f"{src}: {'; '.join(problems[:3])}")
    metadata = p.metadata(user)

    by_shard: dict[str, list[PlannedTensor]] = {}
    for t in p.tensors:
        by_shard.setdefault(t.ckpt.shard, []).append(t)
    largest = max(t.source_nbytes for t in p.tensors)
    total = sum(t.source_nbytes for t in p.tensors)

    from tqdm.auto import tqdm
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"convert {src.name}", disable=not progress, leave=False)
    try:
        with signals_raise(), \
                ColibriWriter(dst, p.specs(), metadata, n_layers=p.config.num_hidden_layers,
                              n_experts=p.config.num_experts, checksums=checksums,
                              overwrite=force) as writer:
            for shard, todo in by_shard.items():
                reader = ShardReader(src / shard, budget=max(largest, 64 << 20))
                try:
                    for t in todo:
                        if t.scales is not None:
                            writer.write(t.name, _mxfp4_rows(src, t, reader), raw=True)
                            bar.update(t.source_nbytes)
                            continue
                        a = _read(reader, src, t)
                        if t.source.post:            # GPT-OSS: gate / up interleaved
                            a = a[t.source.post]
                        if t.source.transpose:       # DBRX's w2: the block is down^T
                            a = np.ascontiguousarray(a.T)
                        if p.family.transform is not None:
                            a = p.family.transform(t.canon, p.config, p.hf_config, a)
                        check_finite(a, t.name, t.ckpt.key)
                        data, raw = _encode(t, a)
                        try:
                            writer.write(t.name, data, raw=raw)
                        except ValueError as e:
                            raise ColibriError(f"tensor {t.name} (checkpoint "
                                               f"{t.ckpt.key!r}): {e}") from None
                        del a, data
                        bar.update(t.source_nbytes)
                finally:
                    reader.close()
            writer.finish(verify=lambda tmp, header: verify_converted(tmp, dst, header))
    except (FileExistsError, IsADirectoryError) as e:
        raise ColibriError(str(e)) from None
    finally:
        bar.close()
    return dst


def _read(reader: ShardReader, src: Path, t: PlannedTensor) -> np.ndarray:
    """The values of planned tensor t as the checkpoint holds them (FP8: dequantized)."""
    if t.fp8_scale is None:
        return reader.get(t.ckpt.key, t.source.index)
    if t.fp8_scale.shard == t.ckpt.shard:
        scale = reader.get(t.fp8_scale.key, ()).astype(np.float32)
    else:
        with open_shard(src / t.fp8_scale.shard) as f:
            scale = f.get_tensor(t.fp8_scale.key).astype(np.float32)
    check_finite(scale, t.name, t.fp8_scale.key)
    return dequantize_fp8(reader.get_fp8(t.ckpt.key), scale, t.fp8_block)
