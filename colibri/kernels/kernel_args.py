"""The argument checks of the kernels' Python face (colibri/kernels/__init__.py): each names the
argument and says what was expected and what was found, before a compiled call."""
from __future__ import annotations

import numpy as np

from .weights import WeightRef


def f32_array(name: str, a: np.ndarray, ndim: tuple[int, ...]) -> np.ndarray:
    """a as a C-contiguous float32 array (a copy only if a is not contiguous)."""
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise TypeError(f"{name} must be float32, found {a.dtype}")
    if a.ndim not in ndim:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndim))} dimensions, found "
                         f"shape {a.shape}")
    return np.ascontiguousarray(a)


def expert_ids(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """Expert ids (T, K) of any integer dtype -> int32. The range is checked once, by the
    compiled kernel (ValueError naming the first bad id and its position), before any
    memory is touched. Values that do not fit int32 are rejected here."""
    ids = np.asarray(ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"ids must be integers, found {ids.dtype}")
    if ids.ndim != 2:
        raise ValueError(f"ids must be (T, K), found shape {ids.shape}")
    if ids.dtype == np.int32:
        return np.ascontiguousarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= n_experts):
        raise ValueError(f"expert ids must be in 0..{n_experts - 1}, found values in "
                         f"{ids.min()}..{ids.max()}")
    return np.ascontiguousarray(ids, dtype=np.int32)


def out_array(out: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype=np.float32)
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != shape
            or not out.flags.c_contiguous or not out.flags.writeable):
        raise ValueError(f"out must be a writable C-contiguous float32 array of shape {shape}, "
                         f"found {getattr(out, 'dtype', type(out).__name__)} "
                         f"{getattr(out, 'shape', '')}")
    return out


def weight_refs(**refs) -> None:
    """ValueError naming the first argument (name=value) that is not a WeightRef."""
    for name, ref in refs.items():
        if not isinstance(ref, WeightRef):
            raise ValueError(f"{name} must be a WeightRef, found {type(ref).__name__}")


def rows_f32(name: str, a, ndim: tuple[int, ...], writable: bool = False) -> np.ndarray:
    """a as it is, if a C-contiguous float32 array of one of `ndim` dimensions (writable if
    asked); else ValueError naming what was expected and what was found."""
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim not in ndim \
            or not a.flags.c_contiguous or (writable and not a.flags.writeable):
        want = " or ".join(f"{n}-D" for n in ndim)
        raise ValueError(f"{name} must be a {'writable ' if writable else ''}C-contiguous "
                         f"float32 {want} array, found "
                         f"{getattr(a, 'dtype', type(a).__name__)} with shape "
                         f"{getattr(a, 'shape', None)}"
                         + ("" if not isinstance(a, np.ndarray) or a.flags.c_contiguous
                            else " (not contiguous)"))
    return a
