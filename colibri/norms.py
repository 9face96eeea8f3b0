"""RMSNorm in NumPy, float32: the general forward pass's norm and its specification.

    rms_norm(x, weight, eps) = weight * (x * (1 / sqrt(mean(x^2) + eps)))

as transformers' Llama-family RMSNorm computes it in float32. The decode step runs the same
arithmetic compiled (kernels.rms_norm_rows_into: NumPy's operations and summation order in
C, the same bits), one call per row.
"""
from __future__ import annotations

import numpy as np

__all__ = ["rms_norm"]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float,
             out: np.ndarray | None = None) -> np.ndarray:
    """RMSNorm over the last axis: x (..., C) f32, weight (C,) f32 -> (..., C) f32.

    out: float32 array of x's shape to write into (may be x itself). The operations are those
    of weight * (x * (1 / sqrt(mean(x^2) + eps))) in float32, with fewer temporaries.
    """
    x = np.asarray(x, dtype=np.float32)
    var = np.add.reduce(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    # np.mean's division, exactly: by the count as an intp, into the float32 sum
    np.true_divide(var, np.intp(x.shape[-1]), out=var, casting="unsafe")
    np.add(var, np.float32(eps), out=var)
    np.sqrt(var, out=var)
    np.true_divide(np.float32(1.0), var, out=var)
    out = np.multiply(x, var, out=out)
    return np.multiply(weight, out, out=out)
