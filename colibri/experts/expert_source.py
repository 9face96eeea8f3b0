"""Where a MoE layer's routed experts come from: an explicit source per layer (MoE.expert_source).

    MappedExperts    the mapping's own kernel call (kernels.prepare_expert_ffn, or
                     biased_experts.BiasedExperts): what every layer has at load
    CachedExperts    a memory budget's expert cache (colibri.experts.expert_cache): the blocks in
    its
                     slots, read on demand
    ShardedExperts   remote expert shards (colibri.experts.expert_shards): start() sends the calls,
                     finish() combines, so that the shared expert runs here meanwhile
    WatchedExperts   the residency telemetry (colibri.experts.telemetry) over any of them

A source is called source(x, ids, weights, y): x float32 (T, D) the layer's normed rows, ids
int32 (T, K) the routed experts, weights float32 (T, K) their routing weights; y float32
(T, D) is written with sum_k weights[t, k] * expert_{ids[t, k]}(x[t]). The wrappers keep the
source they were put over as `inner` (the cache and the shards replace its computation, the
telemetry calls it), and `without` takes one out again wherever it sits in the chain, so
that they compose in any order.

`compiled_reason` tells the compiled decode step (colibri.engine.decode_layer.CompiledLayers)
whether it can run a source: None for the mapping (the compiled step calls the mapping's
kernel itself), else the reason the step must take the Python layers, which `colibri bench`
prints.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ExpertSource", "MappedExperts", "CachedExperts", "ShardedExperts",
           "WatchedExperts", "without", "Record"]

# record(hit bool (T, K), nbytes int64 (T,)): the residency of the blocks a layer call uses
# (hit: the block was in memory) and the bytes read for them, reported before the kernel
# reads them
Record = Callable[[np.ndarray, np.ndarray], None]


class ExpertSource:
    """The routed experts of one MoE layer (see the module docstring)."""

    #: the source this one was put over (None: a source of its own)
    inner: "ExpertSource | None" = None
    #: start(x, ids, weights) -> pending and finish(pending, ids, weights, y) instead of one
    #: call: the experts run elsewhere while the layer computes its shared expert
    overlaps: bool = False

    @property
    def compiled_reason(self) -> str | None:
        """Why the compiled decode step cannot run this source (None: it can)."""
        return "an expert source the compiled step does not know"

    def __call__(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                 y: np.ndarray) -> None:
        raise NotImplementedError

    def observed(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, y: np.ndarray,
                 record: Record) -> bool:
        """The call, its blocks' residency reported to record before its kernel reads
        them, when this source knows it (an expert cache); False, nothing done, when it
        does not (the caller measures the residency, then calls)."""
        return False

    def start(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> Any:
        raise TypeError(f"{type(self).__name__} runs in one call (overlaps is False)")

    def finish(self, pending: Any, ids: np.ndarray, weights: np.ndarray,
               y: np.ndarray) -> None:
        raise TypeError(f"{type(self).__name__} runs in one call (overlaps is False)")


def without(source: ExpertSource, gone: ExpertSource) -> ExpertSource:
    """The chain `source` with the wrapper `gone` taken out (its inner in its place);
    `source` unchanged when `gone` is not in it."""
    if source is gone:
        return gone.inner
    s = source
    while s.inner is not None:
        if s.inner is gone:
            s.inner = gone.inner
            break
        s = s.inner
    return source


class MappedExperts(ExpertSource):
    """The mapping's kernel call: call(x, ids, weights, y) over the file's expert stacks
    (a prepared kernels.prepare_expert_ffn, or a biased_experts.BiasedExperts)."""

    compiled_reason = None

    def __init__(self, call: Callable):
        self.call = call

    def __call__(self, x, ids, weights, y) -> None:
        self.call(x, ids, weights, y)


class CachedExperts(ExpertSource):
    """One layer of an expert cache (colibri.experts.expert_cache.ExpertCache): its blocks made
    resident (cache.ensure_counted), then kernel(x, ids, slots, weights, y) over the arena's
    slots, or kernel None (the madvise mode) the inner source over the mapping."""

    compiled_reason = "an expert cache: budgeted experts are served from Python"

    def __init__(self, cache, j: int, kernel: Callable | None, inner: ExpertSource):
        self.cache, self.j, self.kernel, self.inner = cache, j, kernel, inner

    def __call__(self, x, ids, weights, y) -> None:
        self._run(x, ids, weights, y, None)

    def observed(self, x, ids, weights, y, record: Record) -> bool:
        self._run(x, ids, weights, y, record)
        return True

    def _run(self, x, ids, weights, y, record: Record | None) -> None:
        cache = self.cache
        slots, hit, nbytes = cache.ensure_counted(self.j, ids)
        if record is not None:
            record(hit, nbytes)
        if cache.prefetcher is not None:
            cache.prefetcher.after_layer(self.j, x, ids)
        if self.kernel is not None:
            self.kernel(x, ids, slots, weights, y)
        else:
            self.inner(x, ids, weights, y)


def combine(og: np.ndarray, ids: np.ndarray, weights: np.ndarray, y: np.ndarray,
            by_id: bool) -> np.ndarray:
    """y (T, D) = sum over k of weights[t, k] * og[t * K + k], the product rounded and then
    added, from zero: in k order (the fused kernel's combine) or, by_id, in ascending
    expert id (stable; BiasedExperts')."""
    T, K = ids.shape
    og3 = og.reshape(T, K, -1)
    w = weights
    if by_id:
        order = np.argsort(ids, axis=1, kind="stable")
        og3 = np.take_along_axis(og3, order[:, :, None], axis=1)
        w = np.take_along_axis(weights, order, axis=1)
    y[...] = 0
    for k in range(K):
        y += og3[:, k, :] * w[:, k, None]
    return y


class ShardedExperts(ExpertSource):
    """One layer's experts on remote shards (colibri.experts.expert_shards.ExpertShards):
    start() sends the calls, finish() combines their slot outputs (combine,
    in expert-id order for biased experts)."""

    compiled_reason = "remote expert shards: the routed experts run on Ray actors"
    overlaps = True

    def __init__(self, shards, layer: int, j: int, biased: bool, inner: ExpertSource):
        self.shards, self.layer, self.j, self.biased = shards, layer, j, biased
        self.inner, self._combine = inner, combine

    def start(self, x, ids, weights):
        return self.shards.start(self.layer, self.j, x, ids)

    def finish(self, pending, ids, weights, y) -> None:
        self._combine(self.shards.finish(pending), ids, weights, y, self.biased)

    def __call__(self, x, ids, weights, y) -> None:
        self.finish(self.start(x, ids, weights), ids, weights, y)


class WatchedExperts(ExpertSource):
    """The residency telemetry over `inner`: record(hit, nbytes) for every layer call,
    before its kernel reads the blocks, from the inner source when it knows them (an expert
    cache's hits and reads), else from probe(ids) -> (hit, nbytes) (mincore on the
    mapping's blocks). The experts are the inner source's, bit for bit."""

    def __init__(self, inner: ExpertSource, record: Record,
                 probe: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
                 owner: Any = None):
        self.inner, self.record, self.probe = inner, record, probe
        self.owner = owner          # what records (a telemetry.ExpertTelemetry), or None

    @property
    def overlaps(self) -> bool:
        return self.inner.overlaps

    @property
    def compiled_reason(self) -> str | None:
        own = "residency telemetry: each layer's expert blocks are checked from Python"
        below = self.inner.compiled_reason
        return own if below is None else f"{own}; {below}"

    def __call__(self, x, ids, weights, y) -> None:
        self._run(x, ids, weights, y, self.record)

    def observed(self, x, ids, weights, y, record: Record) -> bool:
        def both(hit: np.ndarray, nbytes: np.ndarray) -> None:
            self.record(hit, nbytes)
            record(hit, nbytes)
        self._run(x, ids, weights, y, both)
        return True

    def _run(self, x, ids, weights, y, record: Record) -> None:
        if not self.inner.observed(x, ids, weights, y, record):
            record(*self.probe(ids))
            self.inner(x, ids, weights, y)

    def start(self, x, ids, weights):
        self.record(*self.probe(ids))
        return self.inner.start(x, ids, weights)

    def finish(self, pending, ids, weights, y) -> None:
        self.inner.finish(pending, ids, weights, y)
