"""The checks of a forward call: its arguments before anything runs, and what keeps bad
calls from running or results from lying while it runs.

  - the arguments of Model.forward's general entry (check_inputs): every input named with
    what was expected and what was found (the plain decode step skips them:
    Model.decode_call decides in a few comparisons that a call is one);
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

The errors themselves are in colibri.errors. Shapes as in the package docstring.
"""
from __future__ import annotations

import warnings

import numpy as np

from ..errors import ForeignCacheError, NonFiniteError
from .kv_cache import KVCache


def is_int(v) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def is_number(v) -> bool:
    """An int or float (Python or NumPy), not a bool."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


# Largest RoPE position accepted: far beyond any context, and with room for counting on
MAX_POSITION = 2**31 - 1


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


def check_inputs(model, input_ids, input_embeds, cache, positions, attention_mask):
    """-> (x float32 (B, S, D) or ids int64 (B, S), squeeze, valid (B, S), positions (B, S))."""
    if (input_ids is None) == (input_embeds is None):
        raise ValueError("give exactly one of input_ids and input_embeds")
    if input_ids is not None:
        ids = np.asarray(input_ids)
        if ids.dtype == object or ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids must be integers, got dtype {ids.dtype}")
        if ids.ndim not in (1, 2):
            raise ValueError(f"input_ids must have shape (S,) or (B, S), got ndim {ids.ndim} "
                             f"(shape {ids.shape})")
        squeeze = ids.ndim == 1
        ids = ids.reshape(1, -1) if squeeze else ids
        if ids.size == 0:
            raise ValueError(f"input_ids is empty (shape {np.asarray(input_ids).shape})")
        if ids.size == 1:                                  # a decode step: no reductions
            lo = hi = int(ids.reshape(-1)[0])
        else:
            lo, hi = int(ids.min()), int(ids.max())
        V = model.config.vocab_size
        if lo < 0 or hi >= V:
            raise ValueError(f"input_ids out of range [0, {V}): "
                             f"min {lo}, max {hi} (vocab_size {V})")
        data = ids.astype(np.int64, copy=False)
    else:
        x = np.asarray(input_embeds)
        if x.dtype.kind != "f":
            raise ValueError(f"input_embeds must be floating point, got dtype {x.dtype}")
        D = model.config.hidden_size
        if x.ndim not in (2, 3) or x.shape[-1] != D:
            raise ValueError(f"input_embeds must have shape (S, {D}) or (B, S, {D}), "
                             f"got {x.shape}")
        squeeze = x.ndim == 2
        x = x[None] if squeeze else x
        if x.shape[1] == 0:
            raise ValueError("input_embeds has no tokens (S = 0)")
        if not np.isfinite(x).all():
            raise ValueError(f"input_embeds holds {int((~np.isfinite(x)).sum())} non-finite values")
        data = np.ascontiguousarray(x, dtype=np.float32)
    B, S = data.shape[:2]
    past = 0
    if cache is not None:
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache must be a KVCache (model.new_cache()), got {type(cache).__name__}")
        if cache.batch != B:
            raise ValueError(f"cache batch {cache.batch} does not match input batch {B}")
        dims = (cache.n_layers, cache.n_kv_heads, cache.head_dim, cache.value_dim)
        if dims != model.cache_dims:
            raise ValueError(f"cache made for (layers, kv heads, head dim, value dim) = "
                             f"{dims}, model has {model.cache_dims}")
        if cache.owner is None:
            cache.owner = model.identity
        elif cache.owner != model.identity:
            raise ForeignCacheError(f"this KV cache holds keys and values of another model "
                                    f"file (identity {cache.owner}), not of "
                                    f"{model.file.path}; make one with model.new_cache()")
        cache.check_room(S)
        past = cache.length
    if attention_mask is None:
        valid = np.ones((B, S), dtype=bool)
    else:
        m = np.asarray(attention_mask)
        if m.ndim == 1 and squeeze:
            m = m[None]
        if m.ndim != 2 or m.shape[0] != B or m.shape[1] not in (S, past + S):
            raise ValueError(f"attention_mask must have shape ({B}, {S}) or ({B}, {past + S}) "
                             f"(past {past} + new {S}), got {np.asarray(attention_mask).shape}")
        if not np.isin(m, (0, 1)).all():
            raise ValueError("attention_mask must hold only 0 and 1 (or booleans)")
        m = m.astype(bool)
        if m.shape[1] == past + S and past and not np.array_equal(m[:, :past], cache.valid[:, :past]):
            raise ValueError("attention_mask's first columns disagree with the padding already in the cache")
        valid = m[:, -S:]
    if positions is None:
        start = cache.next_positions() if cache is not None else np.zeros(B, np.int64)
        if S == 1 and attention_mask is None:             # one real token each: its start
            pos = start[:, None]
        else:
            pos = start[:, None] + np.cumsum(valid, axis=1) - 1
            pos = np.maximum(pos, 0)
    else:
        pos = check_positions(positions, B, S)
    if pos.size:
        warn_past_context(model, int(pos.max()), "the input")
    return data, squeeze, valid, pos
