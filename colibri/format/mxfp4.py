"""MXFP4 (OCP Microscaling FP4), the format GPT-OSS ships its experts in, in NumPy: the
specification of the bytes (docs/format.md §6) and of the row kernels (csrc/mxfp4.h).

A row of C elements (C a multiple of 32) is stored as

    C/2 code bytes      byte j: element 2j in its low nibble, 2j + 1 in its high nibble
    C/32 scale bytes    E8M0: block b's scale is 2^(s_b - 127)

    w[c] = FP4_E2M1[nibble(c)] * 2^(s[c / 32] - 127),
    FP4_E2M1 = 0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negated (nibble bit 3 is the sign).

These are the checkpoint's `*_blocks` (E, R, C/32, 16) and `*_scales` (E, R, C/32) bytes,
row by row (transformers' convert_moe_packed_tensors decodes them the same way): the
converter copies them, it never requantizes. quantize() is the OCP rule (shared exponent
floor(log2 max|w|) - 2, elements rounded to the nearest FP4 value, ties to the even code),
for tests and for writing MXFP4 from floats. A scale byte of 255 (NaN in the spec) decodes to
NaN; the converter refuses it.
"""
from __future__ import annotations

import numpy as np

__all__ = ["FP4_VALUES", "BLOCK", "e8m0_to_f32", "dequantize", "quantize", "rows",
           "split"]

BLOCK = 32
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def e8m0_to_f32(s: np.ndarray) -> np.ndarray:
    """Scale bytes uint8 (...) -> float32 2^(s - 127) (s = 0: 2^-127; s = 255: NaN)."""
    s = np.asarray(s, dtype=np.uint8)
    out = np.ldexp(np.float32(1.0), s.astype(np.int32) - 127).astype(np.float32)
    return np.where(s == 255, np.float32(np.nan), out)


def dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """codes uint8 (..., C/2), scales uint8 (..., C/32) -> float32 (..., C)."""
    codes, scales = np.asarray(codes, dtype=np.uint8), np.asarray(scales, dtype=np.uint8)
    out = np.empty(codes.shape[:-1] + (2 * codes.shape[-1],), dtype=np.float32)
    out[..., 0::2] = FP4_VALUES[codes & 0x0F]
    out[..., 1::2] = FP4_VALUES[codes >> 4]
    blocks = out.reshape(out.shape[:-1] + (-1, BLOCK))
    blocks *= e8m0_to_f32(scales)[..., None]
    return out


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w float (..., C), C a multiple of 32 -> (codes uint8 (..., C/2), scales uint8
    (..., C/32)): per block, e = floor(log2 max|w|) - 2 clamped to [-127, 127] (an all-zero
    block: -127), each w / 2^e rounded to the nearest FP4 value (ties to the even code),
    saturating at +-6."""
    w = np.asarray(w, dtype=np.float32)
    if w.shape[-1] % BLOCK:
        raise ValueError(f"mxfp4: the last dimension {w.shape[-1]} is not a multiple of {BLOCK}")
    b = w.reshape(w.shape[:-1] + (-1, BLOCK))
    amax = np.abs(b).max(axis=-1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, -127)
    e = np.clip(e, -127, 127).astype(np.int32)
    v = np.abs(b) / np.ldexp(np.float32(1.0), e)[..., None]
    mag = FP4_VALUES[:8]
    dist = np.abs(v[..., None] - mag)                                    # (..., 32, 8)
    # nearest, ties to the even code: the distances of odd codes lose an equal contest
    idx = np.argmin(dist + np.where(np.arange(8) % 2, 1e-7 * np.maximum(v, 1)[..., None], 0),
                    axis=-1)
    nib = (idx + 8 * (np.signbit(b) & (idx > 0))).astype(np.uint8).reshape(w.shape)
    codes = (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)
    return codes, (e + 127).astype(np.uint8)


def rows(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The stored rows: codes (..., C/2) then scales (..., C/32), uint8 (..., C/2 + C/32)."""
    return np.concatenate([np.asarray(codes, np.uint8), np.asarray(scales, np.uint8)], axis=-1)


def split(stored: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Views of stored rows uint8 (..., C/2 + C/32): (codes, scales)."""
    return stored[..., :cols // 2], stored[..., cols // 2:]
