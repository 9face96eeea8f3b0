"""The ragged step of continuous batching: several sequences, each through its own cache, in
one forward pass (Model.forward_ragged).

The new tokens of all segments [(cache_i, ids_i)] are concatenated into T rows (a decode
segment is one token, a prefill chunk S_i tokens). What does not mix positions runs over all
T rows in one call each: the embedding, the norms, the q/k/v and output projections, the MoE
(its experts grouped over all rows: an expert's weights are read once per step for every
sequence that chose it, which is what batching wins on a CPU) and the head (the last row of
each segment, or the rows a caller asks for: scoring a prompt needs every position's
logits, generating only the last). What does mix positions runs per segment against that sequence's cache
(Attention.forward_segments, or the same method of another attention class): RoPE, the
cache write, the attention. Every cache then commits its S_i slots.

Shapes as in the package docstring (T rows, N segments).
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ..errors import ForeignCacheError
from ..kernels.runtime import blas_on_one_thread
from .attention import Segment
from .kv_cache import KVCache
from .layer_loop import (RaggedBatch, SequenceRows, forward_pass, is_sequence_rows,
                         is_token_step, unpadded)

__all__ = ["forward_ragged", "forward_rows", "check_segments", "ROW_ATTENTION_MAX"]

# Segments of up to this many tokens after a cache (non-empty, no padding) attend row by row through
# the decode step's compiled attention (attention.Segment.row_tables): for a few rows that is
# cheaper than building a mask and widening the cache for NumPy, and each row gets the bits
# of a decode step (what speculative decoding's verification compares against).
ROW_ATTENTION_MAX = 16


def check_segments(model, segments: Sequence) -> list[tuple[KVCache, np.ndarray]]:
    """[(cache, ids int64 (S,))] after checking each segment; ValueError naming the bad one."""
    if not isinstance(segments, (list, tuple)) or not segments:
        raise ValueError("segments must be a non-empty list of (cache, ids) pairs")
    V, dims = model.config.vocab_size, model.cache_dims
    out, seen = [], set()
    for j, seg in enumerate(segments):
        if not isinstance(seg, (list, tuple)) or len(seg) != 2:
            raise ValueError(f"segment {j} must be a (cache, ids) pair, got {type(seg).__name__}")
        cache, ids = seg
        if not isinstance(cache, KVCache):
            raise ValueError(f"segment {j}: cache must be a KVCache (model.new_cache()), got "
                             f"{type(cache).__name__}")
        if cache.batch != 1:
            raise ValueError(f"segment {j}: cache must be for one sequence, has batch "
                             f"{cache.batch}")
        found = (cache.n_layers, cache.n_kv_heads, cache.head_dim, cache.value_dim)
        if found != dims:
            raise ValueError(f"segment {j}: cache made for (layers, kv heads, head dim, value "
                             f"dim) = {found}, model has {dims}")
        if cache.owner is not None and cache.owner != model.identity:
            raise ForeignCacheError(f"segment {j}: its cache holds keys and values of another "
                                    f"model file, not of {model.file.path}")
        if id(cache) in seen:
            raise ValueError(f"segment {j}: its cache is already used by another segment")
        seen.add(id(cache))
        a = np.asarray(ids)
        if a.dtype.kind not in "iu" or a.ndim != 1 or a.size == 0:
            raise ValueError(f"segment {j}: ids must be a non-empty 1-D array of integers, got "
                             f"dtype {a.dtype} shape {a.shape}")
        if int(a.min()) < 0 or int(a.max()) >= V:
            raise ValueError(f"segment {j}: ids out of range [0, {V}): min {int(a.min())}, "
                             f"max {int(a.max())}")
        cache.check_room(a.size)
        out.append((cache, a.astype(np.int64, copy=False)))
    for cache, _ in out:
        cache.owner = model.identity
    return out


def _segments(model, checked: list[tuple[KVCache, np.ndarray]]) -> list[Segment]:
    """Each sequence's rows, positions and RoPE tables."""
    segs, row = [], 0
    for cache, ids in checked:
        n, past = ids.size, cache.length
        first = int(cache.next_positions()[0])
        positions = np.arange(first, first + n, dtype=np.int64)
        decode = is_token_step(cache, n)
        tables = None
        if decode:
            cos, sin = model.rope.cos_sin_one(first)                            # (Dr/2,)
        else:
            cos, sin = model.rope.cos_sin(positions[None])               # (1, 1, S, Dr/2)
            if past and n <= ROW_ATTENTION_MAX and past + n <= cache.ctx and unpadded(cache):
                tables = [model.rope.cos_sin_one(int(p)) for p in positions]
        segs.append(Segment(cache, row, n, positions, decode, cos, sin, row_tables=tables))
        row += n
    return segs


def check_logits_rows(logits_rows, checked) -> list[np.ndarray] | None:
    """logits_rows as int64 arrays, one per segment, each in [0, S_i); ValueError naming the
    segment otherwise (None stays None: the last row of each segment)."""
    if logits_rows is None:
        return None
    if not isinstance(logits_rows, (list, tuple)) or len(logits_rows) != len(checked):
        raise ValueError(f"logits_rows must be a list of one array of row indices per segment "
                         f"({len(checked)}), got {type(logits_rows).__name__}"
                         + (f" of {len(logits_rows)}" if isinstance(logits_rows, (list, tuple))
                            else ""))
    out = []
    for j, (rows, (_, ids)) in enumerate(zip(logits_rows, checked)):
        r = np.asarray(rows)
        if r.size == 0:
            out.append(np.zeros(0, np.int64))
            continue
        if r.dtype.kind not in "iu" or r.ndim != 1:
            raise ValueError(f"logits_rows[{j}] must be a 1-D array of integers, got dtype "
                             f"{r.dtype} shape {r.shape}")
        if int(r.min()) < 0 or int(r.max()) >= ids.size:
            raise ValueError(f"logits_rows[{j}] out of the segment's rows [0, {ids.size}): min "
                             f"{int(r.min())}, max {int(r.max())}")
        out.append(r.astype(np.int64, copy=False))
    return out


def forward_ragged(model, segments: Sequence, return_routing: bool = False,
                   logits_rows: Sequence | None = None):
    """Model.forward_ragged: logits float32 (N, V) of the last row of each segment, or with
    logits_rows (per segment, row indices int (R_i,) within its S_i new tokens) the logits of
    those rows, segment after segment: (sum R_i, V) [, routing per segment int32 (M, S_i, K)];
    each segment's cache advances by its S_i tokens."""
    checked = check_segments(model, segments)
    rows = check_logits_rows(logits_rows, checked)
    if rows is not None and all(r.size == 1 and r[0] == ids.size - 1
                                for r, (_, ids) in zip(rows, checked)):
        rows = None                                       # the last rows: the usual step
    if rows is None and len(checked) == 1 and checked[0][1].size == 1:  # one token of one sequence: the
        cache, ids = checked[0]                           # decode step (the same bits, fewer
        out = model.decode_call(ids, cache, None, return_routing)   # allocations)
        if out is not None:
            if not return_routing:
                return out
            logits, trace = out
            routing = np.stack(trace.ids).astype(np.int32, copy=False).reshape(
                len(trace.ids), 1, -1) if trace.ids else np.zeros(
                (0, 1, model.config.num_experts_per_tok), np.int32)
            return logits, [routing]
    with blas_on_one_thread():
        return _run(model, checked, return_routing, rows)


def forward_rows(model, cache: KVCache, ids, return_routing: bool = False):
    """Model.forward_rows: logits float32 (T, V) of each of T new tokens ids int (T,) of one
    sequence through `cache` (batch 1), which advances by T [, routing: [int32 (M, T, K)],
    each MoE layer's experts of each row, as forward_ragged gives one segment's]. With no
    padding in the cache and T <= DECODE_MAX_ROWS (layer_loop.SequenceRows) every layer runs
    as one compiled call over the T rows where the compiled step covers the model and its
    expert sources; otherwise forward_ragged's path for the one segment (its values, up to
    the summation order)."""
    checked = check_segments(model, [(cache, ids)])
    n = checked[0][1].size
    if n == 1 and not return_routing:   # the decode step (its bits, fewer allocations)
        out = model.decode_call(checked[0][1], cache, None, False)
        if out is not None:
            return out
    fast = model.compiled_step
    if is_sequence_rows(cache, n) and fast is not None and fast.takes():
        K = model.config.num_experts_per_tok
        routing = np.empty((fast.moe_layers, n, K), np.int32) if return_routing else None
        with blas_on_one_thread():
            logits = _run(model, checked, False, [np.arange(n)],
                          lambda segs: SequenceRows(segs, routing))
        return (logits, [routing]) if return_routing else logits
    with blas_on_one_thread():
        return _run(model, checked, return_routing, [np.arange(n)])


def _run(model, checked, return_routing: bool, logits_rows: list[np.ndarray] | None = None,
         batch=RaggedBatch):
    t0 = time.perf_counter()
    segs = _segments(model, checked)
    ids = np.concatenate([i for _, i in checked])                                  # (T,)
    h = np.ascontiguousarray(model.embed(ids[None])[0], dtype=np.float32)        # (T, D)
    routing = []                                              # per MoE layer: ids (T, K)
    record = (lambda i, moe, x, chosen, weights, gate: routing.append(chosen)) \
        if return_routing else None
    if logits_rows is None:
        rows = np.array([s.start + s.n - 1 for s in segs])                         # (N,)
    else:
        rows = np.concatenate([s.start + r for s, r in zip(segs, logits_rows)])  # (sum R_i,)
    logits = forward_pass(model, batch(segs), h, t0, record, rows)
    if not return_routing:
        return logits
    K = model.config.num_experts_per_tok
    stacked = (np.stack(routing).astype(np.int32, copy=False) if routing
               else np.zeros((0, ids.size, K), dtype=np.int32))                   # (M, T, K)
    return logits, [stacked[:, s.start:s.start + s.n] for s in segs]
