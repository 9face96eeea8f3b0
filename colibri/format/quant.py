"""Weight encodings of the .colibri file: f32, f16, bf16, i32, and group-quantized q8 / q4.

This module is the NumPy definition of the bytes the file holds (docs/format.md §6): the
converter encodes with it, the reader decodes with it, and the kernels are tested against it.
The sizes and the group-size rule of each format are colibri.dtypes' (row_stride,
tensor_nbytes, check_group_size); this module does the encoding work.

Quantized tensors have a logical shape (..., R, C); C is the input (reduction) dimension and is
split into C/G groups of G = group_size consecutive elements, one float16 scale per group.
Each row is stored as its quant bytes followed by its C/G scales:

    q8 row: C x int8 q             | C/G x f16 scale      w = q * scale[g],  q in [-127, 127]
    q4 row: C/2 x packed nibbles   | C/G x f16 scale      w = (nibble - 8) * scale[g]

q4 packs 32-element blocks into 16 bytes in llama.cpp Q4_0 order: byte 16*j + i of a row holds
element 32*j + i in its low nibble and element 32*j + 16 + i in its high nibble, so one load
and a mask give 16 consecutive elements and a shift gives the next 16.

Quantizers (symmetric, no zero point; the choice is measured in docs/quantization.md):
    q8: scale = max|w| / 127, q = round(w / scale)
    q4: m = the value of largest magnitude in the group (sign kept; the first one on a tie),
        scale = m / -8, q = clamp(round(w / scale), -8, 7), nibble = q + 8
The scale is rounded to float16 first and the division uses that stored scale, so the decoded
error is measured against what the file really holds. round() is round-half-to-even (np.rint).
A group whose scale is 0 (all zeros, or a scale that underflows float16) stores q = 0.

Error bound (tested): with s the stored f16 scale and s32 the exact f32 scale of a group,
    |w - w_hat| <= |s| / 2                     for every element that is not clamped;
    |w - w_hat| <= |s| + 8 * |s32 - s|          for q4 elements clamped to nibble 15: values
                                                of the opposite sign to m with |w| > 7.5 |s|
                                                (one step at most; the Q4_0 rule trades it
                                                for the 16th level);
    q8 and the nibble-0 side clamp only when f16 rounding shrank the scale, by at most
    127 * |s32 - s| resp. 8 * |s32 - s| (|s32 - s| <= 2^-11 |s32| for normal f16 scales).

Memory: the converter quantizes one tensor at a time (e.g. a 14336 x 4096 f32 expert stack);
everything here works in row chunks of about CHUNK_ELEMENTS elements, so the temporaries are a
few MB whatever the tensor size; only the outputs are full size.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from .. import dtypes
from . import mxfp4 as _mxfp4

# Chosen by measurement (docs/quantization.md, scripts/measure_quant_error.py): on heavy-tailed
# and outlier-column weights, G64 -> G32 buys 7-10 dB of q4 SNR per extra bit (> 6.02 dB/bit).
DEFAULT_GROUP_SIZE: int = 32

_F16 = np.dtype("<f2")
_F16_MAX = float(np.finfo(np.float16).max)        # 65504
CHUNK_ELEMENTS = 1 << 20                            # ~4 MB of f32 per working chunk

__all__ = [
    "DEFAULT_GROUP_SIZE", "f32_to_bf16", "bf16_to_f32", "quantize_q8", "quantize_q4",
    "dequantize_q8", "dequantize_q4", "encode", "decode", "split_rows",
]


# ---------------------------------------------------------------------------------------------
# bf16 <-> f32


def _flat_chunks(n: int, chunk: int = CHUNK_ELEMENTS) -> Iterator[slice]:
    for start in range(0, n, chunk):
        yield slice(start, min(n, start + chunk))


def _as_f32_bits(x: np.ndarray) -> np.ndarray:
    """Contiguous f32 copy/view of x, as uint32 bits (flat)."""
    a = np.ascontiguousarray(x, dtype=np.float32)
    return a.reshape(-1).view(np.uint32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 (any shape) -> uint16 bf16 bits, same shape.

    Round to nearest, ties to even (the bf16 conversion of PyTorch and the hardware); inf stays
    inf, finite values that round past the largest bf16 become inf, NaN stays NaN (sign and top
    payload kept, quiet bit set so the truncation can never turn a NaN into inf).
    """
    x = np.asarray(x)
    if x.dtype.name == "bfloat16":                    # ml_dtypes: already bf16, keep the bits
        return x.view(np.uint16).copy()
    shape = x.shape
    u = _as_f32_bits(x)
    out = np.empty(u.size, dtype=np.uint16)
    for sl in _flat_chunks(u.size):
        b = u[sl]
        lsb = (b >> 16) & 1
        r = (b + (lsb + 0x7FFF)) >> 16   # may wrap for NaN bits: replaced below
        nan = (b & 0x7FFFFFFF) > 0x7F800000
        if nan.any():
            r[nan] = (b[nan] >> 16) | 0x0040
        out[sl] = r
    return out.reshape(shape)


def bf16_to_f32(x: np.ndarray) -> np.ndarray:
    """uint16 bf16 bits (or an ml_dtypes bfloat16 array) -> float32, exact, same shape."""
    x = np.asarray(x)
    if x.dtype.name == "bfloat16":
        x = x.view(np.uint16)
    if x.dtype != np.uint16:
        raise ValueError(f"bf16_to_f32 expects uint16 bf16 bits, found dtype {x.dtype}")
    return (x.astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------------------------------------
# row iteration helpers


def _rows2d(*arrays: np.ndarray) -> list[tuple[np.ndarray, ...]]:
    """2-D views (rows, last axis) covering all rows of each array in C order, without copying.

    The arrays share their leading shape; the result is a list of tuples of views, one tuple
    per piece. An (E, R, C) stack whose experts sit at a stride other than R rows (the
    page-aligned expert blocks of the file) cannot be one 2-D view; it becomes one per expert.
    """
    a0 = arrays[0]
    if a0.ndim <= 2:
        return [tuple(a.reshape(-1, a.shape[-1]) if a.ndim == 1 else a for a in arrays)]
    try:
        return [tuple(a.reshape(-1, a.shape[-1], copy=False) for a in arrays)]
    except ValueError:
        out: list[tuple[np.ndarray, ...]] = []
        for i in range(a0.shape[0]):
            out.extend(_rows2d(*(a[i] for a in arrays)))
        return out


def _row_chunks(n_rows: int, cols: int) -> Iterator[slice]:
    step = max(1, CHUNK_ELEMENTS // max(1, cols))
    for start in range(0, n_rows, step):
        yield slice(start, min(n_rows, start + step))


def _label(name: str | None) -> str:
    return f"tensor {name!r}" if name else "tensor"


def _prepare(w: np.ndarray, group_size: int, fmt: str, name: str | None) -> np.ndarray:
    """Validate w for quantization; return it as 2-D (N, C) (a view when possible)."""
    w = np.asarray(w)
    if w.ndim == 0:
        raise ValueError(f"{fmt}: {_label(name)} is a scalar; need shape (..., C)")
    if w.dtype.name == "bfloat16":
        pass                                          # widened exactly per chunk
    elif not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"{fmt}: {_label(name)} has dtype {w.dtype}; expected floating point")
    dtypes.check_group_size(w.shape[-1], int(group_size), name or "<unnamed>")
    if w.ndim == 1:
        return w.reshape(1, -1)
    return w.reshape(-1, w.shape[-1])                # copies only if w is not C-reshapable


def _chunk_f32(w2: np.ndarray, sl: slice, fmt: str, name: str | None) -> np.ndarray:
    x = np.array(w2[sl], dtype=np.float32)          # a copy: the quantizers work in place
    if not np.isfinite(x).all():
        bad = np.flatnonzero(~np.isfinite(x))
        row, col = divmod(int(bad[0]), x.shape[1])
        raise ValueError(f"{fmt}: {_label(name)} has {bad.size} non-finite value(s) in rows "
                         f"{sl.start}..{sl.stop - 1}; first {x.flat[bad[0]]} at row "
                         f"{sl.start + row}, column {col}")
    return x


def _scale_overflow(fmt: str, name: str | None, peak: float, scale: float, rule: str):
    return ValueError(f"{fmt}: {_label(name)} has a group with |w| = {peak:.6g}; its scale "
                      f"{rule} = {scale:.6g} exceeds the float16 maximum {_F16_MAX:g}")


# ---------------------------------------------------------------------------------------------
# q8


def quantize_q8(w: np.ndarray, group_size: int, *, name: str | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric 8-bit group quantization.

    w: float (..., C), finite. Returns q int8 (..., C) in [-127, 127] and scales float16
    (..., C/G), with scale = f16(max|w| / 127) and q = round(w / scale) (0 where scale is 0).
    Raises ValueError on non-finite input, bad group size, or a scale beyond float16.
    """
    w2 = _prepare(w, group_size, "quantize_q8", name)
    n, cols = w2.shape
    q = np.empty((n, cols), dtype=np.int8)
    scales = np.empty((n, cols // int(group_size)), dtype=_F16)
    _quantize_q8_into(w2, int(group_size), name, q.view(np.uint8), scales)
    lead = np.shape(w)[:-1]
    return q.reshape(*lead, cols), scales.reshape(*lead, cols // int(group_size))


def _quantize_q8_into(w2: np.ndarray, G: int, name: str | None, qdst: np.ndarray,
                      sdst: np.ndarray) -> None:
    """w2 (N, C) -> qdst uint8 (N, C) (int8 bits), sdst float16 (N, C/G); dsts may be views."""
    n, cols = w2.shape
    ng = cols // G
    for sl in _row_chunks(n, cols):
        x = _chunk_f32(w2, sl, "quantize_q8", name).reshape(-1, ng, G)       # (r, ng, G)
        amax = np.abs(x).max(axis=-1)                                          # (r, ng)
        s32 = amax / np.float32(127.0)
        with np.errstate(over="ignore"):
            s16 = s32.astype(_F16)
        if np.isinf(s16).any():
            i = int(np.flatnonzero(np.isinf(s16))[0])
            raise _scale_overflow("quantize_q8", name, float(amax.flat[i]), float(s32.flat[i]),
                                  "max|w|/127")
        sdst[sl] = s16
        div = s16.astype(np.float32)
        zero = div == 0
        div[zero] = 1.0                      # groups of zeros (or underflowed scales) -> q = 0
        t = np.divide(x, div[..., None], out=x)
        np.rint(t, out=t)
        np.clip(t, -127, 127, out=t)
        t[zero] = 0
        qdst[sl] = t.reshape(-1, cols).astype(np.int8).view(np.uint8)


def dequantize_q8(q: np.ndarray, scales: np.ndarray, group_size: int) -> np.ndarray:
    """q int8 (or its uint8 bytes) (..., C), scales float16 (..., C/G) -> float32 (..., C).

    Inputs may be strided read-only views of the file (split_rows); no copy of them is made.
    """
    q = np.asarray(q)
    if q.dtype == np.uint8:
        q = q.view(np.int8)
    return _dequantize(q, scales, group_size, "q8")


# ---------------------------------------------------------------------------------------------
# q4


def _pack_q4(nib: np.ndarray) -> np.ndarray:
    """nibbles uint8 (r, C) in 0..15 -> packed uint8 (r, C/2), Q4_0 order (see module doc)."""
    r, cols = nib.shape
    b = nib.reshape(r, cols // 32, 2, 16)                 # [..., 0, :] = elements 0..15 of a block
    return (b[:, :, 0, :] | (b[:, :, 1, :] << 4)).reshape(r, cols // 2)


def _unpack_q4(packed: np.ndarray) -> np.ndarray:
    """packed uint8 (r, C/2) -> nibbles uint8 (r, C), inverse of _pack_q4."""
    r, half = packed.shape
    p = packed.reshape(r, half // 16, 16)
    out = np.empty((r, half // 16, 2, 16), dtype=np.uint8)
    np.bitwise_and(p, 0x0F, out=out[:, :, 0, :])
    np.right_shift(p, 4, out=out[:, :, 1, :])
    return out.reshape(r, half * 2)


def quantize_q4(w: np.ndarray, group_size: int, *, name: str | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric 4-bit group quantization, llama.cpp Q4_0 rule, Q4_0 nibble order.

    w: float (..., C), finite. Returns packed uint8 (..., C/2) and scales float16 (..., C/G),
    with m = the signed value of largest magnitude in the group, scale = f16(m / -8),
    nibble = clamp(round(w / scale), -8, 7) + 8 (8, i.e. 0.0, where scale is 0).
    Raises ValueError on non-finite input, bad group size, or a scale beyond float16.
    """
    w2 = _prepare(w, group_size, "quantize_q4", name)
    n, cols = w2.shape
    packed = np.empty((n, cols // 2), dtype=np.uint8)
    scales = np.empty((n, cols // int(group_size)), dtype=_F16)
    _quantize_q4_into(w2, int(group_size), name, packed, scales)
    lead = np.shape(w)[:-1]
    return packed.reshape(*lead, cols // 2), scales.reshape(*lead, cols // int(group_size))


def _quantize_q4_into(w2: np.ndarray, G: int, name: str | None, qdst: np.ndarray,
                      sdst: np.ndarray) -> None:
    """w2 (N, C) -> qdst packed uint8 (N, C/2), sdst float16 (N, C/G); dsts may be views."""
    n, cols = w2.shape
    ng = cols // G
    for sl in _row_chunks(n, cols):
        x = _chunk_f32(w2, sl, "quantize_q4", name).reshape(-1, ng, G)        # (r, ng, G)
        idx = np.abs(x).argmax(axis=-1)[..., None]                            # (r, ng, 1)
        m = np.take_along_axis(x, idx, axis=-1)[..., 0]                       # (r, ng), signed
        s32 = m / np.float32(-8.0)                                            # exact in f32
        with np.errstate(over="ignore"):
            s16 = s32.astype(_F16)
        if np.isinf(s16).any():
            i = int(np.flatnonzero(np.isinf(s16))[0])
            raise _scale_overflow("quantize_q4", name, abs(float(m.flat[i])),
                                  float(s32.flat[i]), "m/-8")
        sdst[sl] = s16
        div = s16.astype(np.float32)
        zero = div == 0
        div[zero] = 1.0
        t = np.divide(x, div[..., None], out=x)
        np.rint(t, out=t)
        np.clip(t, -8, 7, out=t)
        t[zero] = 0
        t += 8
        qdst[sl] = _pack_q4(t.astype(np.uint8).reshape(-1, cols))


def dequantize_q4(packed: np.ndarray, scales: np.ndarray, group_size: int) -> np.ndarray:
    """packed uint8 (..., C/2), scales float16 (..., C/G) -> float32 (..., C).

    Inputs may be strided read-only views of the file (split_rows); no copy of them is made.
    """
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise ValueError(f"dequantize_q4 expects packed uint8 nibbles, found {packed.dtype}")
    return _dequantize(packed, scales, group_size, "q4")


def _dequantize(qd: np.ndarray, scales: np.ndarray, group_size: int, fmt: str) -> np.ndarray:
    scales = np.asarray(scales)
    if scales.dtype != np.float16:
        raise ValueError(f"dequantize_{fmt} expects float16 scales, found {scales.dtype}")
    G = int(group_size)
    cols = qd.shape[-1] * (2 if fmt == "q4" else 1)
    dtypes.check_group_size(cols, G, f"<{fmt} data>")
    if scales.shape != qd.shape[:-1] + (cols // G,):
        raise ValueError(f"dequantize_{fmt}: scales shape {scales.shape} does not match data "
                         f"shape {qd.shape} with group_size {G} (expected "
                         f"{qd.shape[:-1] + (cols // G,)})")
    out = np.empty(qd.shape[:-1] + (cols,), dtype=np.float32)
    ng = cols // G
    row0 = 0
    out2 = out.reshape(-1, cols)
    for qv, sv in _rows2d(qd, scales):
        for sl in _row_chunks(qv.shape[0], cols):
            if fmt == "q4":
                v = _unpack_q4(qv[sl]).astype(np.float32)
                v -= 8
            else:
                v = qv[sl].astype(np.float32)
            dst = out2[row0 + sl.start: row0 + sl.stop].reshape(-1, ng, G)
            np.multiply(v.reshape(-1, ng, G), sv[sl].astype(np.float32)[..., None], out=dst)
        row0 += qv.shape[0]
    return out


# ---------------------------------------------------------------------------------------------
# bytes on disk


def split_rows(rows: np.ndarray, dtype: str, cols: int, group_size: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """Zero-copy views of the quant bytes and the scales of stored quantized rows.

    rows: uint8 (..., row_stride), e.g. (R, row_stride) or an (E, R, row_stride) strided view of
    the mapping (the last axis must be contiguous). Returns
      qdata  uint8 (..., C * bits / 8)   (q8: view it as int8 for the signed values)
      scales float16 (..., C / G)        (possibly unaligned; NumPy handles that)
    Both share memory with `rows` (and stay read-only when it is).
    """
    if dtype not in dtypes.QUANTIZED:
        raise ValueError(f"split_rows needs a quantized dtype ({', '.join(dtypes.QUANTIZED)}), "
                         f"found {dtype!r}")
    rows = np.asarray(rows)
    stride = dtypes.row_stride(dtype, cols, group_size)
    if rows.dtype != np.uint8 or rows.ndim < 1 or rows.shape[-1] != stride:
        raise ValueError(f"split_rows: expected uint8 rows of {stride} bytes ({dtype}, {cols} "
                         f"columns, group_size {group_size}), found {rows.dtype} with shape "
                         f"{rows.shape}")
    if rows.strides[-1] != 1:
        raise ValueError("split_rows: the last axis of the rows must be contiguous")
    qbytes = int(cols) * dtypes.DTYPES[dtype].bits // 8
    qdata = rows[..., :qbytes]
    if dtype == "mxfp4":                            # E8M0 scale bytes
        return qdata, rows[..., qbytes:]
    scales = rows[..., qbytes:].view(_F16)
    return qdata, scales


def encode(w: np.ndarray, dtype: str, group_size: int = 0, *, name: str | None = None
           ) -> np.ndarray:
    """w in logical shape -> 1-D uint8, exactly the bytes the file stores for it (format §6).

    f32/f16: IEEE little-endian (f16 rounds to nearest even; a finite value beyond the f16
    range is an error, not inf). bf16: f32_to_bf16 bits; a uint16 array is taken as bf16 bits
    already (the reader's view of bf16). i32: int32 (integer input in range).
    q8/q4: each row is its quant bytes followed by its f16 scales.
    """
    dtypes.dtype(dtype)                             # ValueError naming the known ones
    w = np.asarray(w)
    if dtype == "mxfp4":
        dtypes.check_format_group(dtype, group_size, _label(name))
        codes, scales = _mxfp4.quantize(w.reshape(-1, w.shape[-1]))
        return _mxfp4.rows(codes, scales).reshape(-1)
    if dtype in dtypes.QUANTIZED:
        # Quantize straight into the row buffer: the output is the only full-size array.
        w2 = _prepare(w, group_size, f"encode {dtype}", name)
        n, cols = w2.shape
        out = np.empty((n, dtypes.row_stride(dtype, cols, group_size)), dtype=np.uint8)
        qdv, scv = split_rows(out, dtype, cols, group_size)
        into = _quantize_q8_into if dtype == "q8" else _quantize_q4_into
        into(w2, int(group_size), name, qdv, scv)
        return out.reshape(-1)
    if dtype == "bf16":
        if w.dtype == np.uint16:     # already bf16 bits (what the reader exposes): kept as is
            return np.ascontiguousarray(w, dtype="<u2").reshape(-1).view(np.uint8)
        return f32_to_bf16(w).astype("<u2", copy=False).reshape(-1).view(np.uint8)
    if dtype == "i32":
        if not np.issubdtype(w.dtype, np.integer):
            raise ValueError(f"encode i32: {_label(name)} has dtype {w.dtype}; expected integers")
        if w.size and (w.min() < -2**31 or w.max() >= 2**31):
            raise ValueError(f"encode i32: {_label(name)} has values outside int32 "
                             f"[{w.min()}, {w.max()}]")
        return np.ascontiguousarray(w, dtype="<i4").reshape(-1).view(np.uint8)
    if dtype == "f16":
        with np.errstate(over="ignore"):
            h = np.ascontiguousarray(w, dtype="<f2")
        if np.isinf(h).any():
            bad = np.isinf(h) & np.isfinite(np.asarray(w, dtype=np.float32))
            if bad.any():
                i = int(np.flatnonzero(bad.reshape(-1))[0])
                raise ValueError(f"encode f16: {_label(name)} value "
                                 f"{np.asarray(w).reshape(-1)[i]} at flat index {i} is beyond "
                                 f"the float16 range (max {_F16_MAX:g})")
        return h.reshape(-1).view(np.uint8)
    return np.ascontiguousarray(w, dtype="<f4").reshape(-1).view(np.uint8)


def decode(raw: np.ndarray, dtype: str, shape: tuple[int, ...], group_size: int = 0
           ) -> np.ndarray:
    """Bytes of one tensor (uint8, 1-D, e.g. a view of the mapping) -> a new array of `shape`.

    float32 for every dtype except i32, which decodes to int32 (exact).
    """
    dtypes.dtype(dtype)                             # ValueError naming the known ones
    raw = np.asarray(raw)
    shape = tuple(int(d) for d in shape)
    need = dtypes.tensor_nbytes(dtype, shape, group_size)
    if raw.dtype != np.uint8 or raw.ndim != 1 or raw.size != need:
        raise ValueError(f"decode {dtype} {shape}: expected {need} bytes (1-D uint8), found "
                         f"{raw.size} bytes of dtype {raw.dtype} with shape {raw.shape}")
    if dtype in dtypes.QUANTIZED:
        cols = shape[-1]
        rows = raw.reshape(-1, dtypes.row_stride(dtype, cols, group_size))
        qd, sc = split_rows(rows, dtype, cols, group_size)
        if dtype == "mxfp4":
            return _mxfp4.dequantize(qd, sc).reshape(shape)
        deq = dequantize_q8 if dtype == "q8" else dequantize_q4
        return deq(qd, sc, group_size).reshape(shape)
    a = raw.view(dtypes.DTYPES[dtype].storage).reshape(shape)
    if dtype == "bf16":
        return bf16_to_f32(a.astype(np.uint16, copy=False))
    if dtype == "i32":
        return a.astype(np.int32)
    return a.astype(np.float32)
