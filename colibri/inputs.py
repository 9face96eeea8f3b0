"""The argument checks of Model.forward's general entry: every input named with what was
expected and what was found, before anything runs (the plain decode step skips them:
Model.decode_call decides in a few comparisons that a call is one). Shapes as in the
package docstring.
"""
from __future__ import annotations

import numpy as np

from .guards import ForeignCacheError, check_positions, warn_past_context
from .kv_cache import KVCache

__all__ = ["check_inputs"]


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
