"""The weight formats of a .colibri file: one table that the reader, the writer, the
quantizer, the model's weight references and the kernels' Python side all read.

A stored row of C elements takes

    plain (f32, f16, bf16, i32):  C * bits / 8 bytes
    quantized (q8, q4):           C * bits / 8 code bytes + (C / group_size) f16 scales
    mxfp4:                        C / 2 FP4 code bytes + C / 32 E8M0 scale bytes (group 32)

The on-disk code of a format is also the kernels' format code (`COLIBRI_F32` .. `COLIBRI_Q4`
in csrc/types.h); i32 is stored but never multiplied.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["DType", "DTYPES", "DTYPE_NAMES", "QUANTIZED", "MATMUL", "BLOCK", "dtype",
           "row_stride", "by_code", "check_group_size", "check_format_group", "tensor_nbytes"]

BLOCK = 32          # quantization group sizes are positive multiples of this


@dataclass(frozen=True)
class DType:
    """One stored format. storage: the NumPy dtype of a plain tensor's elements (bf16 is
    kept as its uint16 bits), None for the quantized ones."""
    name: str
    code: int                  # the file's dtype field, and the kernels' format code
    bits: int                  # per element, scales not included
    quantized: bool
    matmul: bool               # the kernels multiply by it
    storage: np.dtype | None
    scale_bytes: int = 2       # per group (quantized formats): f16, or E8M0 for mxfp4
    fixed_group: int = 0       # the only group size the format has (mxfp4: 32), 0: any


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("f32", 0, 32, False, True, np.dtype("<f4")),
    DType("f16", 1, 16, False, True, np.dtype("<f2")),
    DType("bf16", 2, 16, False, True, np.dtype("<u2")),
    DType("q8", 3, 8, True, True, None),
    DType("q4", 4, 4, True, True, None),
    DType("i32", 5, 32, False, False, np.dtype("<i4")),
    DType("mxfp4", 6, 4, True, True, None, scale_bytes=1, fixed_group=32),
)}
DTYPE_NAMES: tuple[str, ...] = tuple(sorted(DTYPES, key=lambda n: DTYPES[n].code))  # by code
QUANTIZED: tuple[str, ...] = tuple(n for n in DTYPE_NAMES if DTYPES[n].quantized)
MATMUL: tuple[str, ...] = tuple(n for n in DTYPE_NAMES if DTYPES[n].matmul)


def dtype(name: str) -> DType:
    """The DType called `name`; ValueError naming the known ones otherwise."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_NAMES)}"
                         ) from None


def by_code(code: int) -> DType:
    """The DType stored as `code`; ValueError naming the known codes otherwise."""
    if not 0 <= int(code) < len(DTYPE_NAMES):
        raise ValueError(f"unknown dtype code {code} (known: 0..{len(DTYPE_NAMES) - 1} = "
                         f"{', '.join(DTYPE_NAMES)})")
    return DTYPES[DTYPE_NAMES[int(code)]]


def check_group_size(cols: int, group_size: int, name: str) -> None:
    """ValueError naming tensor `name` unless `group_size` suits a quantized row of `cols`
    columns: an int, a positive multiple of BLOCK, dividing cols (the input dimension)."""
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
        raise ValueError(f"tensor {name!r}: group_size must be an int, found {group_size!r}")
    if group_size <= 0 or group_size % BLOCK:
        raise ValueError(f"tensor {name!r}: group_size {group_size} is not a positive "
                         f"multiple of {BLOCK}")
    if cols <= 0 or cols % group_size:
        raise ValueError(f"tensor {name!r}: group_size {group_size} does not divide its "
                         f"{cols} columns (the input dimension)")


def check_format_group(name: str, group_size: int, tensor: str) -> None:
    """ValueError naming `tensor` when format `name` has a fixed group size (mxfp4: 32) and
    group_size is another."""
    fixed = dtype(name).fixed_group
    if fixed and group_size != fixed:
        raise ValueError(f"tensor {tensor!r}: {name} has group size {fixed}, found "
                         f"{group_size}")


def row_stride(name: str, cols: int, group_size: int = 0) -> int:
    """Bytes of one stored row of `cols` elements of format `name` (see the module docstring).

    group_size is ignored for plain formats; for quantized ones it must pass
    check_group_size (ValueError otherwise)."""
    d = dtype(name)
    cols = int(cols)
    if not d.quantized:
        return cols * d.bits // 8
    g = int(group_size)
    check_group_size(cols, g, f"<{cols} columns>")
    check_format_group(name, g, f"<{cols} columns>")
    return cols * d.bits // 8 + (cols // g) * d.scale_bytes


def tensor_nbytes(name: str, shape: tuple[int, ...], group_size: int = 0) -> int:
    """Bytes a tensor of format `name` and logical `shape` (..., R, C) occupies in the file:
    prod(shape) elements, or prod(shape[:-1]) rows of row_stride (Python ints, no overflow)."""
    d = dtype(name)
    shape = tuple(int(n) for n in shape)
    if not shape or any(n <= 0 for n in shape):
        raise ValueError(f"shape {shape} must have at least one dimension, all > 0")
    if not d.quantized:
        return math.prod(shape) * d.bits // 8
    return math.prod(shape[:-1]) * row_stride(name, shape[-1], group_size)
