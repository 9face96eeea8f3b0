"""FP8 checkpoints (DeepSeek-V3's release): float8_e4m3fn weights, each with a float32
`<key>_scale_inv` per block of config.json's quantization_config.weight_block_size (128 x 128
by default), dequantized on reading to value * scale_inv of its block."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..errors import ColibriError
from ..families.base import Source
from .checkpoint import SCALE_SUFFIX, SOURCE_DTYPES, CheckpointTensor

DEFAULT_FP8_BLOCK = (128, 128)


def fp8_block(hf_config: Mapping[str, Any]) -> tuple[int, int]:
    """The (rows, columns) of an FP8 checkpoint's scale blocks (quantization_config)."""
    q = hf_config.get("quantization_config") or {}
    block = q.get("weight_block_size", DEFAULT_FP8_BLOCK) if isinstance(q, dict) else None
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ColibriError(f"config.json: quantization_config.weight_block_size must be two "
                           f"positive integers, found {block!r}")
    return int(block[0]), int(block[1])


def fp8_scale(s: Source, c: CheckpointTensor, ckpt: Mapping[str, CheckpointTensor],
               block: tuple[int, int]) -> CheckpointTensor:
    """The scale tensor of FP8 checkpoint tensor c, shape-checked: (ceil(R/br), ceil(C/bc))."""
    scale = ckpt[s.key + SCALE_SUFFIX]
    if s.index or len(c.shape) != 2:
        raise ColibriError(f"checkpoint tensor {s.key!r}: FP8 is supported for whole 2-D "
                           f"matrices only, found shape {c.shape}")
    want = tuple(-(-n // b) for n, b in zip(c.shape, block))
    if scale.shape != want or scale.dtype not in SOURCE_DTYPES:
        raise ColibriError(f"checkpoint tensor {scale.key!r} has shape {scale.shape} and "
                           f"dtype {scale.dtype}; {s.key!r} {c.shape} in blocks of {block} "
                           f"needs {want} floats")
    return scale


def dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Block-scaled FP8 values float32 (R, C) times their block's scale_inv (ceil(R/br),
    ceil(C/bc)) -> float32 (R, C), as transformers' FP8 dequantization."""
    s = np.asarray(scale_inv, dtype=np.float32)
    full = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[:w.shape[0], :w.shape[1]]
    return w * full
