"""The feed-forward half of a layer: routed experts (+ gated shared expert) or a dense SwiGLU.

    router logits = x @ W_router^T                     (kernels.linear, f32 weights by default)
    ids, w        = route_topk(logits, K)              (the config's rule, e.g. softmax over all
                                                        E -> top-k [-> renorm]; DeepSeek's
                                                        group rules [+ correction bias])
    w            *= routed_scaling_factor              (DeepSeek, GLM-4-MoE; 1 elsewhere)
    y             = sum_k w[t,k] * expert_{ids[t,k]}(x[t])   (kernels.expert_ffn, grouped by expert)
    y            += sigmoid(x @ g) * shared(x)         (Qwen2-MoE's shared expert; DeepSeek's
                                                        and GLM's are ungated: + shared(x))

GPT-OSS's experts (biases on every projection, the clamped swigluoai activation) and its
router bias take BiasedExperts (colibri.kernels.biased_experts) instead of the fused kernel:
the same row kernels, one compiled call for a decode step's token or for many.

The kernels read the weights in place from the mapped file (WeightRef); an expert no token
chose is never touched. Every kernel call gets the model's thread count.

Shapes as in the package docstring (T token rows, E, K, I, Is shared-expert intermediate).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .. import kernels
from ..experts.expert_source import ExpertSource, MappedExperts
from ..kernels.biased_experts import BiasedExperts
from ..kernels.runtime import Timings
from ..kernels.weights import WeightRef

__all__ = ["MoE", "DenseMLP"]


@dataclass
class MoE:
    """Routed experts of one layer, plus the sigmoid-gated shared expert when present.

    router: (E, D); experts: WeightRef stacks (E, I, D), (E, I, D), (E, D, I);
    shared: (gate (Is, D), up (Is, D), down (D, Is)) or None; shared_gate: (1, D) or None.
    rule: the routing rule (config.ROUTERS), jitter_eps its parameter (sparsemixer);
    activations: of the experts and shared expert.
    correction_bias: float32 (E,), the choice bias of "sigmoid_group_topk"; n_group /
    topk_group: the group rules' groups; routed_scaling_factor: multiplies the weights.
    expert_source: where the routed experts come from (colibri.experts.expert_source; default the
    mapping's kernel call).
    """
    router: WeightRef
    w_gate: WeightRef
    w_up: WeightRef
    w_down: WeightRef
    top_k: int
    norm_topk_prob: bool
    threads: int
    shared: tuple[WeightRef, WeightRef, WeightRef] | None = None
    shared_gate: WeightRef | None = None
    rule: str = "softmax_topk"
    activations: str = "f32"       # of the experts (the router always sees f32 activations)
    jitter_eps: float = 0.0        # the sparsemixer rule's router_jitter_noise
    router_bias: np.ndarray | None = None     # float32 (E,), added to the router logits
    biased_experts: BiasedExperts | None = None   # instead of the fused expert kernel
    correction_bias: np.ndarray | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # where the routed experts come from (colibri.experts.expert_source): None at construction, the
    # mapping's kernel call (MappedExperts) from then on; an expert cache, remote shards or
    # the residency telemetry put their source over it
    expert_source: ExpertSource | None = None

    def __post_init__(self):
        # the kernel calls with their weights and settings checked once (kernels.prepare_*)
        self._router = kernels.prepare_linear(self.router, self.router_bias,
                                              threads=self.threads)
        self._route = kernels.prepare_route(self.top_k, rule=self.rule,
                                            norm_topk_prob=self.norm_topk_prob,
                                            threads=self.threads, jitter_eps=self.jitter_eps,
                                            bias=self.correction_bias,
                                            n_group=self.n_group, topk_group=self.topk_group)
        self._scale = np.float32(self.routed_scaling_factor)
        if self.expert_source is None:
            self.expert_source = MappedExperts(
                self.biased_experts or kernels.prepare_expert_ffn(
                    self.w_gate, self.w_up, self.w_down, threads=self.threads,
                    activations=self.activations))

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The router and top-k of x float32 (T, D) C-contiguous: ids int32 (T, K) and
        weights float32 (T, K), before routed_scaling_factor (what __call__ runs, and the
        expert prefetch's guess of the next layer)."""
        logits = np.empty((x.shape[0], self.router.rows), dtype=np.float32)       # (T, E)
        self._router(x, logits)
        return self._route(logits)

    def __call__(self, x: np.ndarray, timings: Timings, out: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """x float32 (T, D) C-contiguous -> (y (T, D) f32, ids (T, K) int32, weights (T, K)
        f32, shared-gate values (T,) f32 or None). out: float32 (T, D) for y (not x), or
        None. The same kernels as linear / route_topk / expert_ffn, prepared at load."""
        t0 = time.perf_counter()
        ids, weights = self.route(x)                                                 # (T, K)
        if self._scale != 1:
            weights *= self._scale
        t0 = timings.add("router", t0)
        y = np.empty(x.shape, dtype=np.float32) if out is None else out
        source = self.expert_source
        if source.overlaps:                      # remote experts: the shared one meanwhile
            pending = source.start(x, ids, weights)
            s, gate_values = self._shared(x)
            t0 = timings.add("shared", t0)
            source.finish(pending, ids, weights, y)
            timings.add("experts", t0)
            if s is not None:
                y += s
            return y, ids, weights, gate_values
        source(x, ids, weights, y)                                                   # (T, D)
        t0 = timings.add("experts", t0)
        s, gate_values = self._shared(x)
        if s is not None:
            y += s
            timings.add("shared", t0)
        return y, ids, weights, gate_values

    def _shared(self, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The shared expert's output (T, D), gated, and the gate values (T,) (None, None
        without a shared expert; gate values None when it is ungated)."""
        gate_values = None
        if self.shared is not None:
            g, u, d = self.shared
            s = kernels.swiglu(x, g, u, d, threads=self.threads,
                               activations=self.activations)                         # (T, D)
            if self.shared_gate is not None:
                z = kernels.linear(x, self.shared_gate, threads=self.threads)[:, 0]  # (T,)
                gate_values = (np.float32(1.0) / (np.float32(1.0) + np.exp(-z))).astype(np.float32)
                s *= gate_values[:, None]
            return s, gate_values
        return None, None


@dataclass
class DenseMLP:
    """SwiGLU feed-forward of a dense layer: down(silu(gate(x)) * up(x)); gate / up (Id, D),
    down (D, Id)."""
    w_gate: WeightRef
    w_up: WeightRef
    w_down: WeightRef
    threads: int
    activations: str = "f32"

    def __call__(self, x: np.ndarray, timings: Timings) -> np.ndarray:
        """x float32 (T, D) -> float32 (T, D)."""
        t0 = time.perf_counter()
        y = kernels.swiglu(x, self.w_gate, self.w_up, self.w_down, threads=self.threads,
                           activations=self.activations)
        timings.add("dense", t0)
        return y
