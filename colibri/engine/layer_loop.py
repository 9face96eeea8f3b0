"""The forward pass, written once: embed -> per layer [norm -> attention -> + -> norm -> FFN
-> +] -> norm -> head, over a small description of the rows it runs on.

A pass is T rows of the residual stream h float32 (T, D). Everything but attention treats
them as rows: the norms, the MoE (its experts grouped over all T rows: an expert's weights
are read once per pass for every row that chose it), the dense MLP, the residual adds, the
head. Attention mixes rows of one sequence, so the description of the rows says how
(`attend`), and what a finished pass commits to its caches. Three descriptions:

  - PaddedBatch: B sequences of S rows each (T = B * S), left padding, one (B, L) cache or
    none; NumPy attention over masks (attention.Attention.__call__ / mla.MLA.__call__).
  - RaggedBatch: N sequences of S_i rows each, each through its own cache (the step of
    continuous batching, colibri.engine.ragged); attention per sequence (forward_segments).
  - SequenceRows: a RaggedBatch of one sequence's few new rows after its cache (speculative
    decoding's verification); where colibri.engine.decode_layer covers the model, all its
    layers run as one compiled call over the rows (the decode step extended to T rows).
  - TokenStep: one token of one sequence through a cache without padding, every vector in
    the cache's RunState (the decode step); attention over the cache compiled (decode).
    Where colibri.engine.decode_layer covers the model, all its layers run as one compiled call
    instead of run_layers: run_layers with a TokenStep is that call's specification.

Attention classes (Attention, MLA) are the one part that varies: each gives the three
methods above with the same signatures, and the description picks one.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .. import _kernels
from .attention import Segment, build_mask
from .checks import check_logits, run_moe
from .moe import MoE
from .routing import RoutingTrace, trace_layer
from .run_state import RunState

DECODE_MAX_ROWS = _kernels.DECODE_MAX_ROWS   # the rows of one compiled SequenceRows pass

__all__ = ["PaddedBatch", "RaggedBatch", "SequenceRows", "TokenStep", "forward_pass",
           "run_layers", "tracer", "Record", "unpadded", "is_token_step", "is_sequence_rows",
           "AttentionLayer", "DECODE_MAX_ROWS"]


class AttentionLayer(Protocol):
    """What a layer's attention gives the loop (attention.Attention, mla.MLA): one method
    per description of the rows; each writes the new rows' keys and values to the cache at
    its length (the description commits them after the pass)."""
    window: int | None                  # sliding window in slots, None: full attention

    def __call__(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mask: np.ndarray,
                 cache=None, layer: int = 0) -> np.ndarray:
        """PaddedBatch: x float32 (B, S, D), mask bool (B, S, L) -> (B, S, D)."""

    def forward_segments(self, x: np.ndarray, segments: list[Segment], layer: int
                         ) -> np.ndarray:
        """RaggedBatch: x float32 (T, D) -> (T, D), attention per segment."""

    def decode(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, cache, layer: int,
               state: RunState) -> np.ndarray:
        """TokenStep: x float32 (1, D) -> (1, D) (state.o)."""


# record(i, moe, x (T, D), ids (T, K), weights (T, K), shared gate (T,) or None): what a pass
# keeps of MoE layer i's routing (None: nothing)
Record = Callable[..., None]


class _NewRows:
    """What PaddedBatch and RaggedBatch share: buffers allocated per pass, no compiled path."""

    def buffers(self, D: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(xa, xf, y): the normed inputs of attention and FFN (T, D), the MoE's output
        buffer (None: it allocates)."""
        T = self.rows
        return np.empty((T, D), np.float32), np.empty((T, D), np.float32), None

    def run_compiled(self, model, h: np.ndarray) -> bool:
        return False


@dataclass
class PaddedBatch(_NewRows):
    """B sequences of S new rows each, rows b * S + s; valid bool (B, S) (False: padding),
    pos int64 (B, S) their RoPE positions; cache: a KVCache of batch B or None."""
    valid: np.ndarray
    pos: np.ndarray
    cos: np.ndarray                    # (B, 1, S, Dr/2), Rope.cos_sin
    sin: np.ndarray
    cache: object = None
    masks: dict = field(default_factory=dict)    # build_mask per sliding window, on first use

    @classmethod
    def of(cls, model, valid: np.ndarray, pos: np.ndarray, cache) -> "PaddedBatch":
        cos, sin = model.rope.cos_sin(pos)
        return cls(valid, pos, cos, sin, cache)

    @property
    def rows(self) -> int:
        return self.valid.size

    def attend(self, attn: AttentionLayer, x: np.ndarray, layer: int) -> np.ndarray:
        """Layer `layer`'s attention of the normed rows x (T, D) -> (T, D)."""
        B, S = self.valid.shape
        w = attn.window
        if w not in self.masks:
            c = self.cache           # the keys visible to the new rows: the cache's, then theirs
            seen = self.valid if c is None else np.concatenate([c.valid[:, :c.length],
                                                                self.valid], axis=1)
            self.masks[w] = build_mask(seen, S, w)                              # (B, S, L)
        o = attn(x.reshape(B, S, -1), self.cos, self.sin, self.masks[w], self.cache, layer)
        return o.reshape(B * S, -1)

    def commit(self) -> None:
        if self.cache is not None:
            self.cache.commit(self.valid, self.pos)

    checks_logits = True        # NaN logits raise (NonFiniteError naming the stage)


@dataclass
class RaggedBatch(_NewRows):
    """N sequences, each of its own cache: segments[j] holds rows [start, start + n)."""
    segments: list[Segment]

    @property
    def rows(self) -> int:
        s = self.segments[-1]
        return s.start + s.n

    def attend(self, attn: AttentionLayer, x: np.ndarray, layer: int) -> np.ndarray:
        return attn.forward_segments(x, self.segments, layer)

    def commit(self) -> None:
        for s in self.segments:
            if s.decode:
                s.cache.commit_one(int(s.positions[0]))
            else:
                s.cache.commit(np.ones((1, s.n), dtype=bool), s.positions[None])

    # a row of NaN logits is that sequence's error (the scheduler ends it alone), not the
    # whole step's
    checks_logits = False


@dataclass
class SequenceRows(RaggedBatch):
    """RaggedBatch of one segment: T <= DECODE_MAX_ROWS new rows after a cache without
    padding, with room for them (a speculative verification; is_sequence_rows decides).
    Every layer runs as one compiled call over the T rows (CompiledLayers.run_rows) when the
    model has one and it takes them; else run_layers runs them as for any RaggedBatch.
    routing: None, or int32 (M, T, K) that the compiled call fills with each MoE layer's
    experts of each row."""
    routing: np.ndarray | None = None

    def run_compiled(self, model, h: np.ndarray) -> bool:
        fast, s = model.compiled_step, self.segments[0]
        if fast is None:
            return False
        cos = np.ascontiguousarray(s.cos.reshape(s.n, -1))                   # (T, Dr/2)
        sin = np.ascontiguousarray(s.sin.reshape(s.n, -1))
        return fast.run_rows(model.run_state(s.cache), s.cache, h, cos, sin, model.timings,
                             self.routing)


@dataclass(slots=True)                  # made once per decode step: the lighter object
class TokenStep:
    """One token of one sequence at RoPE position `position`, through `cache` (batch 1, no
    padding, room for it), every vector in `state` (its h (1, D) holds the embedded token)."""
    cache: object
    state: RunState
    position: int
    cos: np.ndarray                    # (Dr/2,), Rope.cos_sin_one
    sin: np.ndarray

    rows = 1
    checks_logits = True

    def buffers(self, D: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        s = self.state
        return s.xa, s.xf, s.y

    def attend(self, attn: AttentionLayer, x: np.ndarray, layer: int) -> np.ndarray:
        return attn.decode(x, self.cos, self.sin, self.cache, layer, self.state)

    def run_compiled(self, model, h: np.ndarray) -> bool:
        """Every layer in one compiled call (colibri.engine.decode_layer) when the model has one and
        it takes this step (h is state.h); False: run_layers runs them."""
        fast = model.compiled_step
        return fast is not None and fast.run(self.state, self.cache, self.cos, self.sin,
                                             model.timings)

    def commit(self) -> None:
        self.cache.commit_one(self.position)


def unpadded(cache) -> bool:
    """Whether every slot of a cache of one sequence holds a real token (no padding)."""
    n = cache.length
    return np.count_nonzero(cache.valid[0, :n]) == n


def is_token_step(cache, rows: int) -> bool:
    """Whether `rows` new rows through `cache` make a TokenStep: one row, a cache of one
    sequence with room for it and no padding. The one place that decides it (Model.forward,
    its fast entry Model.decode_call, the ragged step's segments)."""
    return (rows == 1 and cache is not None and cache.batch == 1
            and cache.length < cache.ctx and unpadded(cache))


def is_sequence_rows(cache, rows: int) -> bool:
    """Whether `rows` new rows through `cache` make SequenceRows: 1 <= rows <=
    DECODE_MAX_ROWS, a cache of one sequence with room for them and no padding."""
    return (1 <= rows <= DECODE_MAX_ROWS and cache.batch == 1
            and cache.length + rows <= cache.ctx and unpadded(cache))


def tracer(trace: RoutingTrace, B: int, S: int, threads: int) -> Record:
    """The Record that appends each MoE layer's routing to trace, shaped (B, S, ...)."""
    def record(i, moe, x, ids, weights, gate):
        trace_layer(trace, i, moe, x, ids, weights, gate, B, S, threads)
    return record


def run_layers(model, batch, h: np.ndarray, record: Record | None = None) -> None:
    """Every layer of `model` over the rows h float32 (T, D) of `batch`, in place."""
    tm, rm = model.timings, model.residual_mult
    norm, eps = model.norm_rows_into, model.eps32
    xa, xf, y_out = batch.buffers(h.shape[1])
    t0 = time.perf_counter()
    for i, layer in enumerate(model.layers):
        norm(h, layer.attn_norm, layer.attn_norm_bias, eps, xa)
        o = batch.attend(layer.attn, xa, i)
        if rm is not None:                                   # Granite's muP
            np.multiply(o, rm, out=o)
        np.add(h, o, out=h)
        norm(h, layer.ffn_norm, layer.ffn_norm_bias, eps, xf)
        t0 = tm.add("attention", t0)
        if isinstance(layer.ffn, MoE):
            y, ids, weights, gate = run_moe(i, layer.ffn, xf, tm, xa, o, out=y_out)
            if record is not None:
                record(i, layer.ffn, xf, ids, weights, gate)
        else:
            y = layer.ffn(xf, tm)
        if rm is not None:
            np.multiply(y, rm, out=y)
        np.add(h, y, out=h)
        t0 = time.perf_counter()


def forward_pass(model, batch, h: np.ndarray, t0: float, record: Record | None = None,
                 head_rows: np.ndarray | None = None) -> np.ndarray:
    """The pass: the embedded rows h float32 (T, D) (owned by the pass: updated in place)
    through every layer, the final norm and the head of the rows head_rows (int (R,), None:
    all T); then the batch's caches commit. Logits float32 (R, V), a new array. t0: the
    pass's start (perf_counter), its embedding timed from there."""
    tm, c = model.timings, model.config
    if model.embedding_mult is not None:                     # Granite's muP
        np.multiply(h, model.embedding_mult, out=h)
    t0 = tm.add("embed", t0)
    if record is not None or not batch.run_compiled(model, h):
        run_layers(model, batch, h, record)
    t0 = time.perf_counter()
    if head_rows is None:                  # the decode step norms into its RunState's xa
        hl, hn = h, batch.state.xa if isinstance(batch, TokenStep) else np.empty_like(h)
    else:
        hl = hn = h[head_rows]                                            # (R, D), a copy
    model.norm_rows_into(hl, model.final_norm, model.final_norm_bias, model.eps32, hn)
    logits = np.empty((hl.shape[0], c.vocab_size), dtype=np.float32)
    if hl.shape[0]:
        model.head_into(hn, logits)
    if batch.checks_logits:
        check_logits(logits, model.n_layers, hl, hn)
    tm.add("head", t0)
    batch.commit()
    return logits
