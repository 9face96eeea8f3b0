"""Weight references: where a weight matrix lies in a byte buffer, read in place by the kernels.

A ``WeightRef`` is a uint8 buffer (the whole file mapping, or an encoded array in tests)
plus byte offsets and strides; the kernels read it where it lies (zero copies, dequantized
in registers). Row strides come from the one table of formats, ``colibri.dtypes``.

The adapters from a mapped ``.colibri`` file build them without reading a byte:
``weight_ref`` (one matrix), ``expert_ref`` (a layer's strided stack of experts),
``fused_ref`` (matrices back to back, as one), and ``vector`` (a small float32 tensor: a
norm weight, a bias).

Shapes: R rows (outputs) and C columns (inputs) of a weight matrix, E experts, Q group size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import _kernels, dtypes
from ..errors import ColibriError
from ..format import ColibriFile, quant

__all__ = ["WeightRef", "weight_ref", "expert_ref", "fused_ref", "vector"]


@dataclass(frozen=True, eq=False)          # eq=False: identity equality, hashable (buf is an array)
class WeightRef:
    """Where a weight matrix (or a stack of E of them) lies in a byte buffer.

    buf:           uint8, 1-D, C-contiguous, may be read-only (a view of the mmap'd file).
                   Any object with the buffer protocol (bytes, mmap) is wrapped without a copy.
    offset:        byte offset of row 0 of expert 0.
    dtype:         one of dtypes.MATMUL: "f32" | "f16" | "bf16" | "q8" | "q4" (docs/format.md §6).
    rows, cols:    logical (R, C) of one matrix; y = W @ x reduces over C.
    group_size:    Q, for q8/q4 (a multiple of 32 dividing C); 0 otherwise.
    row_stride:    bytes between rows; 0 means packed (dtypes.row_stride).
    n_experts:     E matrices of the same shape ...
    expert_stride: ... this many bytes apart; 0 means packed (rows * row_stride).

    Construction checks every field against the buffer (ValueError naming the field and the
    numbers); the kernels check again before they read, so a bad WeightRef can never make
    them read outside the buffer.
    """

    buf: np.ndarray = field(repr=False)
    offset: int
    dtype: str
    rows: int
    cols: int
    group_size: int = 0
    row_stride: int = 0
    n_experts: int = 1
    expert_stride: int = 0

    def __post_init__(self) -> None:
        buf = self.buf
        if not isinstance(buf, np.ndarray):
            try:
                buf = np.frombuffer(buf, dtype=np.uint8)
            except TypeError as exc:
                raise ValueError(f"WeightRef: buf must be a uint8 array or a buffer, found "
                                 f"{type(self.buf).__name__}") from exc
            object.__setattr__(self, "buf", buf)
        if self.dtype not in dtypes.MATMUL:
            raise ValueError(f"WeightRef: dtype {self.dtype!r} is not a weight format of the "
                             f"kernels (expected one of {', '.join(dtypes.MATMUL)})")
        for name in ("offset", "rows", "cols", "group_size", "row_stride", "n_experts",
                     "expert_stride"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"WeightRef: {name} must be an int, found {v!r}")
            object.__setattr__(self, name, int(v))
        if self.dtype in dtypes.QUANTIZED or self.cols > 0:
            try:                                 # checks a quantized format's group size
                packed = dtypes.row_stride(self.dtype, self.cols, self.group_size)
            except ValueError as exc:
                raise ValueError(f"WeightRef: {exc}") from None
            if self.row_stride == 0 and self.cols > 0:
                object.__setattr__(self, "row_stride", packed)
        if self.expert_stride == 0 and self.n_experts > 1:
            object.__setattr__(self, "expert_stride", self.rows * self.row_stride)
        _kernels.weight_span(self, "WeightRef")

    @classmethod
    def from_array(cls, w: np.ndarray, dtype: str, group_size: int = 0) -> "WeightRef":
        """Encode w float (R, C) or (E, R, C) with quant.encode into a new packed buffer.

        For tests and small models; a real model's weights are views of its file.
        """
        w = np.asarray(w)
        if w.ndim not in (2, 3):
            raise ValueError(f"WeightRef.from_array: w must be (R, C) or (E, R, C), found "
                             f"shape {w.shape}")
        if dtype not in dtypes.MATMUL:
            raise ValueError(f"WeightRef.from_array: dtype {dtype!r} is not one of "
                             f"{', '.join(dtypes.MATMUL)}")
        gs = int(group_size) if dtype in dtypes.QUANTIZED else 0
        E = w.shape[0] if w.ndim == 3 else 1
        R, C = w.shape[-2:]
        buf = quant.encode(w, dtype, gs)
        return cls(buf=buf, offset=0, dtype=dtype, rows=R, cols=C, group_size=gs,
                   n_experts=E)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape: (R, C), or (E, R, C) for a stack."""
        return (self.rows, self.cols) if self.n_experts == 1 else (
            self.n_experts, self.rows, self.cols)

    def expert(self, e: int) -> "WeightRef":
        """The single matrix of expert e, as its own WeightRef (same buffer)."""
        if not 0 <= e < self.n_experts:
            raise ValueError(f"expert {e} out of range for {self.n_experts} experts")
        return WeightRef(self.buf, self.offset + e * self.expert_stride, self.dtype,
                         self.rows, self.cols, self.group_size, self.row_stride)


# ---------------------------------------------------------------------------------------------
# adapters from a mapped file


def weight_ref(f: ColibriFile, buf: np.ndarray, name: str) -> WeightRef:
    """WeightRef over the 2-D tensor `name` (R, C) of the mapped file; no bytes are read."""
    info = f.info(name)
    if len(info.shape) != 2:
        raise ColibriError(f"{f.path}: tensor {name!r} has shape {info.shape}; expected a matrix")
    if info.dtype not in dtypes.MATMUL:
        raise ColibriError(f"{f.path}: tensor {name!r} has dtype {info.dtype}, which the "
                           f"kernels cannot multiply by")
    R, C = info.shape
    return WeightRef(buf, info.offset, info.dtype, R, C, info.group_size)   # rows packed


def expert_ref(f: ColibriFile, buf: np.ndarray, layer: int, proj: str, n_experts: int) -> WeightRef:
    """WeightRef over the strided (E, R, C) stack of one projection of a layer's experts."""
    name0 = f"layers.{layer}.moe.experts.0.{proj}"
    info = f.info(name0)
    R, C = info.shape
    stride = f.expert_stride(layer) if n_experts > 1 else 0
    return WeightRef(buf, info.offset, info.dtype, R, C, info.group_size,
                     n_experts=n_experts, expert_stride=stride)       # rows packed


def fused_ref(refs: list[WeightRef]) -> WeightRef | None:
    """One WeightRef over matrices that lie back to back in the same buffer with the same
    format and columns (their rows stacked, in order), or None when they do not."""
    a = refs[0]
    end = a.offset
    for r in refs:
        if (r.buf is not a.buf or r.dtype != a.dtype or r.cols != a.cols or r.n_experts != 1
                or r.group_size != a.group_size or r.row_stride != a.row_stride
                or r.offset != end):
            return None
        end += r.rows * r.row_stride
    return WeightRef(a.buf, a.offset, a.dtype, sum(r.rows for r in refs), a.cols,
                     a.group_size, a.row_stride)


def vector(f: ColibriFile, name: str) -> np.ndarray:
    """A small 1-D tensor (norm weight, bias) as float32."""
    t = f.tensor(name)
    if isinstance(t, np.ndarray) and t.dtype == np.float32:
        return t
    return f.to_float32(name)
