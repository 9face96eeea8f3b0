"""The checks around a forward pass that keep bad calls from running or results from lying.

  - positions: integers in [0, MAX_POSITION], checked in their own dtype before any cast (a
    uint64 2**64 - 1 must not become -1, a position near 2**63 must not overflow to 0 when
    the next one is counted);
  - the context: one warning per model (warnings.warn) when a cache or a position goes past
    the model's max_position_embeddings, where RoPE was never trained;
  - a KV cache belongs to the model (file) that first used it: ForeignCacheError for a cache
    of another model with the same shapes; CacheBusyError for a cache already inside a
    forward pass on another thread (KVCache.claim: two decodes on one cache would interleave
    their slot writes);
  - NaN: the router's NaN error and NaN logits become a NonFiniteError naming the layer and
    the stage the NaN came from (attention, a norm, the router, the final norm, the head),
    found on the error path only from the buffers the step left behind.
"""
from __future__ import annotations

import warnings

import numpy as np

from .errors import ColibriError

__all__ = ["MAX_POSITION", "NonFiniteError", "ForeignCacheError", "CacheBusyError",
           "check_positions", "warn_past_context", "layer_nan_stage", "layer_nan_error",
           "run_moe", "head_nan_stage", "check_logits"]

# Largest RoPE position accepted: far beyond any context, and with room for counting on
MAX_POSITION = 2**31 - 1


class NonFiniteError(ColibriError, ValueError):
    """A forward pass produced NaN; the message names the layer and stage it came from."""


class ForeignCacheError(ColibriError, ValueError):
    """A KV cache was filled by another model (file) than the one it is given to."""


class CacheBusyError(ColibriError, RuntimeError):
    """A KV cache is in a forward pass on another thread."""


def check_positions(positions, B: int, S: int) -> np.ndarray:
    """positions int (S,) or (B, S) -> int64 (B, S), each in [0, MAX_POSITION]; ValueError
    naming the dtype, shape or the value out of range."""
    p = np.asarray(positions)
    if p.dtype.kind not in "iu" or p.dtype == object:
        raise ValueError(f"positions must be integers, got dtype {p.dtype}")
    if p.ndim == 1:
        p = np.broadcast_to(p, (B, p.shape[0]))
    if p.shape != (B, S):
        raise ValueError(f"positions must have shape ({S},) or ({B}, {S}), got "
                         f"{np.asarray(positions).shape}")
    if p.size:
        lo, hi = int(p.min()), int(p.max())       # Python ints: exact for any dtype
        if lo < 0 or hi > MAX_POSITION:
            raise ValueError(f"positions must be in [0, {MAX_POSITION}], got min {lo}, "
                             f"max {hi}")
    return p.astype(np.int64)


def warn_past_context(model, last: int, what: str) -> None:
    """Warn once per model when position `last` (0-based) is past max_position_embeddings."""
    limit = model.config.max_position_embeddings
    if last < limit or model.warned_past_context:
        return
    model.warned_past_context = True
    warnings.warn(f"{what} reaches position {last}, past this model's "
                  f"max_position_embeddings {limit}: its output may degrade there",
                  stacklevel=3)


def _nan(x) -> bool:
    return x is not None and bool(np.isnan(x).any())


def layer_nan_stage(i: int, attn_in, attn_out, mlp_in) -> str:
    """Where a NaN met in layer i's router came from: attn_in the normed input of the
    attention, attn_out its output, mlp_in the normed input of the router (each (T, D))."""
    if not _nan(mlp_in):
        return f"layer {i}'s router (its logits are NaN on a finite input: the router weights)"
    if _nan(attn_out):
        if _nan(attn_in):
            where = "the embedding" if i == 0 else f"layer {i - 1}'s MLP / experts"
            return (f"the input of layer {i} (its attention norm's output: from {where} or "
                    f"the norm weights)")
        return f"layer {i}'s attention (its projections or scores)"
    return f"layer {i}'s MLP norm (on a finite residual stream)"


def layer_nan_error(i: int, attn_in, attn_out, mlp_in) -> NonFiniteError:
    """The error for a NaN met in layer i's router, naming where it came from
    (layer_nan_stage)."""
    return NonFiniteError(f"NaN in the forward pass, from "
                          f"{layer_nan_stage(i, attn_in, attn_out, mlp_in)}")


def run_moe(i: int, moe, x, timings, attn_in, attn_out, out=None):
    """moe(x, timings, out=out) of layer i (a moe.MoE: -> (y, ids, weights, gate)); the
    ValueError its router raises on NaN logits becomes layer_nan_error (attn_in / attn_out:
    the layer's attention input and output, x the router's input)."""
    try:
        return moe(x, timings, out=out)
    except ValueError as e:
        if "NaN" not in str(e):
            raise
        raise layer_nan_error(i, attn_in, attn_out, x) from None


def head_nan_stage(n_layers: int, residual, normed) -> str:
    """Where NaN logits came from: residual (T, D) the stream after the last layer, normed
    the final norm's output."""
    if _nan(residual):
        return (f"the residual stream after layer {n_layers - 1} (a layer's attention or MLP "
                f"made it NaN)")
    if _nan(normed):
        return "the final norm"
    return "the head (the output projection)"


def check_logits(logits: np.ndarray, n_layers: int, residual, normed) -> None:
    """Raise NonFiniteError naming the stage when logits hold NaN (one reduction when not)."""
    if np.isnan(np.max(logits)):
        bad = int(np.isnan(logits).sum())
        raise NonFiniteError(f"the forward pass made {bad} NaN logits; they come from "
                             f"{head_nan_stage(n_layers, residual, normed)}")
