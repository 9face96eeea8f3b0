"""The weight formats of a .colibri file: one table that the reader, the writer, the
quantizer, the model's weight references and the kernels' Python side all read.

A stored row of C elements takes

    plain (f32, f16, bf16, i32):  C * bits / 8 bytes
    quantized (q8, q4):           C * bits / 8 code bytes + (C / group_size) f16 scales

The on-disk code of a format is also the kernels' format code (`COLIBRI_F32` .. `COLIBRI_Q4`
in csrc/types.h); i32 is stored but never multiplied.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DType", "DTYPES", "DTYPE_NAMES", "QUANTIZED", "MATMUL", "BLOCK", "dtype",
           "row_stride", "by_code"]

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


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("f32", 0, 32, False, True, np.dtype("<f4")),
    DType("f16", 1, 16, False, True, np.dtype("<f2")),
    DType("bf16", 2, 16, False, True, np.dtype("<u2")),
    DType("q8", 3, 8, True, True, None),
    DType("q4", 4, 4, True, True, None),
    DType("i32", 5, 32, False, False, np.dtype("<i4")),
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


def row_stride(name: str, cols: int, group_size: int = 0) -> int:
    """Bytes of one stored row of `cols` elements of format `name` (see the module docstring).

    group_size is ignored for plain formats; for quantized ones it must be a positive multiple
    of BLOCK dividing cols (ValueError otherwise)."""
    d = dtype(name)
    cols = int(cols)
    if not d.quantized:
        return cols * d.bits // 8
    g = int(group_size)
    if g <= 0 or g % BLOCK or cols <= 0 or cols % g:
        raise ValueError(f"{name}: group_size {group_size} must be a positive multiple of "
                         f"{BLOCK} dividing the {cols} columns")
    return cols * d.bits // 8 + (cols // g) * 2
