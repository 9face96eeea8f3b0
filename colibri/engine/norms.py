"""RMSNorm and LayerNorm in NumPy, float32: the general forward pass's norms and their
specification.

    rms_norm(x, weight, eps)         = weight * (x * (1 / sqrt(mean(x^2) + eps)))
    layer_norm(x, weight, bias, eps) = (x - mean(x)) / sqrt(var(x) + eps) * weight [+ bias]

as transformers computes them in float32 (Llama-family RMSNorm; torch.nn.LayerNorm, biased
variance, for DBRX without and PhiMoE with a bias). The decode step runs RMSNorm compiled
(kernels.rms_norm_rows_into: NumPy's operations and summation order in C, the same bits), one
call per row, and LayerNorm through layer_norm on its (1, D) row.
"""
from __future__ import annotations

import numpy as np

__all__ = ["rms_norm", "layer_norm"]


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


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, eps: float,
               out: np.ndarray | None = None) -> np.ndarray:
    """LayerNorm over the last axis: x (..., C) f32, weight (C,) f32, bias (C,) f32 or None
    -> (..., C) f32. out: float32 array of x's shape to write into (may be x itself).

    mean and the biased variance in float32 (two passes, as torch's CPU kernel), then
    (x - mean) * (1 / sqrt(var + eps)) * weight + bias.
    """
    x = np.asarray(x, dtype=np.float32)
    n = np.intp(x.shape[-1])
    mean = np.add.reduce(x, axis=-1, keepdims=True, dtype=np.float32)
    np.true_divide(mean, n, out=mean, casting="unsafe")
    centred = np.subtract(x, mean)
    var = np.add.reduce(np.square(centred), axis=-1, keepdims=True, dtype=np.float32)
    np.true_divide(var, n, out=var, casting="unsafe")
    np.add(var, np.float32(eps), out=var)
    np.sqrt(var, out=var)
    np.true_divide(np.float32(1.0), var, out=var)
    out = np.multiply(centred, var, out=out)
    np.multiply(out, weight, out=out)
    if bias is not None:
        np.add(out, bias, out=out)
    return out
