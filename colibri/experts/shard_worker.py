"""One expert shard's side of colibri.experts.expert_shards: the body of a Ray actor that maps the
model file on its own node, checks it is the driver's (`fingerprint`), and runs its experts'
(token, k) slots with the very kernels the single process runs, each slot with weight 1
(the driver adds them: colibri.experts.expert_shards.combine).

Shapes: T token rows, S slots, D hidden size.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import time

import numpy as np

from ..errors import ColibriError
from ..format import ColibriFile

__all__ = ["ExpertShardError", "ShardWorker", "fingerprint"]


class ExpertShardError(ColibriError, RuntimeError):
    """An expert shard failed a call (its actor died, timed out or raised)."""


def fingerprint(f: ColibriFile) -> str:
    """What the file holds, comparable across machines (the driver's and an actor's copy):
    its size and every tensor's name, offset, size and CRC."""
    h = hashlib.blake2b(digest_size=8)
    h.update(str(f.file_size).encode())
    for name in f.tensors:
        info = f.info(name)
        h.update(f"{name}:{info.offset}:{info.nbytes}:{info.crc32};".encode())
    return h.hexdigest()

def _expert_calls(f: ColibriFile, buf: np.ndarray, layer: int, threads: int,
                  activations: str):
    """The routed-expert call of one MoE layer as Model builds it: (call, biased), call(x,
    ids, weights, out) over the mapping; biased: a BiasedExperts (else the fused kernel)."""
    from .. import kernels
    from ..kernels.biased_experts import BiasedExperts
    from ..kernels.weights import expert_ref, vector
    c = f.model_config
    mlp = ("w_gate", "w_up", "w_down")
    stacks = [expert_ref(f, buf, layer, n, c.num_experts) for n in mlp]
    if c.expert_bias or c.expert_activation != "silu":
        p = f"layers.{layer}."
        biases = ([vector(f, f"{p}moe.b_{n[2:]}") for n in mlp] if c.expert_bias
                  else [None] * 3)
        return BiasedExperts(*stacks, *biases, c.expert_activation, c.swiglu_alpha,
                             c.swiglu_limit, threads, activations), True
    return kernels.prepare_expert_ffn(*stacks, threads=threads, activations=activations), False


class _CachedCall:
    """An expert cache's layer source (expert_source.CachedExperts) as the worker calls a
    layer's experts (the many= argument of BiasedExperts is the cache's business: it
    forwards T rows as they are)."""

    def __init__(self, source):
        self.source = source

    def __call__(self, x, ids, weights, out, many: bool = False):
        self.source(x, ids, weights, out)

class ShardWorker:
    """One shard's experts (the body of a Ray actor; usable in process too).

    path: the .colibri file on this node; version: the driver's fingerprint of it (a
    different file is refused); owned: {MoE layer number: the experts this shard owns};
    threads, activations: as the driver's model (the same kernels, the same bits);
    latency: seconds slept before each run() (an injected network delay, for measuring;
    at most 10). memory_budget: bytes this shard's experts may hold (None: the page cache
    decides): an expert cache (colibri.experts.expert_cache's arena) of budget // block slots;
    at least the most experts it owns in one layer (a prefill may use them all).
    """

    def __init__(self, path: str, version: str, owned: dict[int, list[int]], threads: int,
                 activations: str, index: int = 0, latency: float = 0.0,
                 memory_budget: int | None = None):
        if not 0 <= latency <= 10:
            raise ValueError(f"latency must be in [0, 10] seconds, got {latency!r}")
        self.latency = float(latency)
        from .expert_cache import weights_buffer
        self.index = index
        self.file = ColibriFile(path)
        found = fingerprint(self.file)
        if found != version:
            raise ExpertShardError(f"expert shard {index}: {path} on this node is not the "
                                   f"driver's model file (fingerprint {found}, the driver's "
                                   f"{version})")
        buf = weights_buffer(self.file, None, True)
        self.owned = {int(k): np.asarray(v, np.int32) for k, v in owned.items()}
        self.calls = {layer: _expert_calls(self.file, buf, layer, threads, activations)
                      for layer in self.owned}
        self.cache = None
        if memory_budget is not None:
            self.cache = self._expert_cache(buf, threads, activations, int(memory_budget))
        self.pid = os.getpid()

    def _expert_cache(self, buf, threads: int, activations: str, budget: int):
        """An ExpertCache over this shard's experts: their blocks in an arena of
        budget // block slots (the dense part is the driver's: none of the budget)."""
        from types import SimpleNamespace

        from .expert_cache import ExpertCache, MemoryBudgetError, memory_plan
        from .expert_source import MappedExperts
        from ..kernels.weights import expert_ref
        sizes = memory_plan(self.file)
        need = max(len(v) for v in self.owned.values()) * sizes.slot_bytes
        if budget < need:
            raise MemoryBudgetError(
                f"expert shard {self.index}: memory budget {budget} bytes is below its "
                f"largest layer's experts, {need} bytes")
        n = min(budget // sizes.slot_bytes, sum(len(v) for v in self.owned.values()))
        plan = dataclasses.replace(sizes, dense_ranges=(), dense_bytes=0, budget=budget,
                                   n_slots=int(n))
        layers = {}
        for layer, (call, biased) in self.calls.items():      # what the cache reads of a layer
            stacks = [expert_ref(self.file, buf, layer, p, self.file.n_experts)
                      for p in ("w_gate", "w_up", "w_down")]
            layers[layer] = SimpleNamespace(ffn=SimpleNamespace(
                w_gate=stacks[0], w_up=stacks[1], w_down=stacks[2], threads=threads,
                activations=activations, biased_experts=call if biased else None,
                expert_source=MappedExperts(call)))
        shim = SimpleNamespace(file=self.file, buffer=buf, layers=layers)
        cache = ExpertCache(shim, plan)
        for layer in self.calls:                  # run() calls through the cache now
            source = layers[layer].ffn.expert_source
            biased = self.calls[layer][1]
            self.calls[layer] = (_CachedCall(source), biased)
        return cache

    def cache_stats(self) -> dict | None:
        """The shard's expert cache counters (ExpertCache.stats()), or None without one."""
        return None if self.cache is None else self.cache.stats()

    def ready(self) -> int:
        """The actor's process id, once its shard is mapped."""
        return self.pid

    def node(self) -> str:
        """The host name and Ray node id this shard runs on ("" for the id outside Ray)."""
        import socket
        try:
            import ray
            node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        except ImportError:
            node = ""
        return f"{socket.gethostname()}/{node}"

    def run_owned(self, call: tuple) -> tuple[np.ndarray, np.ndarray]:
        """The compiled graph's call: call = (layer, x (T, D), ids int32 (T, K)), the same
        for every shard -> (slots int64 (S,) this shard owns, their outputs (S, D))."""
        layer, x, ids = call
        flat = ids.reshape(-1)
        slots = np.flatnonzero(np.isin(flat, self.owned[layer]))
        if slots.size == 0:
            return slots, np.empty((0, x.shape[1]), np.float32)
        return slots, self.run(layer, x, slots, flat[slots], ids.shape[1])

    def run(self, layer: int, x: np.ndarray, slots: np.ndarray, ids: np.ndarray,
            K: int) -> np.ndarray:
        """The outputs of the slots this shard owns, each with routing weight 1.

        x float32 (T, D): the layer's input rows; slots int64 (S,) ascending, t * K + k;
        ids int32 (S,) their experts (this shard's) -> float32 (S, D), row s = expert
        ids[s] of token slots[s] // K, computed as the single process's kernel computes it:
        with T = 1 one call per slot (the one-token path), else one call over the slots'
        token rows with one expert each (each expert sees the same tokens, in the same
        order, as in the single call over all slots).
        """
        if self.latency:
            time.sleep(self.latency)
        call, biased = self.calls[layer]
        if not np.isin(ids, self.owned[layer]).all():
            raise ExpertShardError(f"expert shard {self.index}: layer {layer} asked for "
                                   f"experts it does not own")
        T, D = x.shape
        S = slots.shape[0]
        out = np.empty((S, D), np.float32)
        ones = np.ones((1, 1), np.float32)
        if T == 1:
            for s in range(S):
                call(x, ids[s:s + 1].reshape(1, 1), ones, out[s:s + 1])
            return out
        rows = np.ascontiguousarray(x[slots // K])
        ids2 = np.ascontiguousarray(ids.reshape(S, 1))
        w = np.ones((S, 1), np.float32)
        if biased:                 # the many-token path even when S == 1 (its bits)
            call(rows, ids2, w, out, many=True)
        else:
            call(rows, ids2, w, out)
        return out
