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
router bias take BiasedExperts instead of the fused kernel: the same row kernels
(kernels.linear on one expert of the stack), one chosen expert at a time.

The kernels read the weights in place from the mapped file (WeightRef); an expert no token
chose is never touched. Every kernel call gets the model's thread count.

Shapes as in the package docstring (T token rows, E, K, I, Is shared-expert intermediate).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import kernels
from .runtime import Timings
from .weights import WeightRef

__all__ = ["MoE", "DenseMLP", "BiasedExperts", "swigluoai"]


def swigluoai(g: np.ndarray, u: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """GPT-OSS's expert activation, float32 as transformers: g clamped to <= limit, u to
    [-limit, limit]; (u + 1) * g * sigmoid(alpha * g). g, u (N, I) -> (N, I)."""
    g = np.minimum(g, np.float32(limit))
    u = np.clip(u, np.float32(-limit), np.float32(limit))
    glu = g * (np.float32(1.0) / (np.float32(1.0) + np.exp(-(g * np.float32(alpha)))))
    return (u + np.float32(1.0)) * glu


@dataclass
class BiasedExperts:
    """Routed experts with biases and / or the swigluoai activation: `p(x, ids, weights,
    out)` as the prepared fused kernel (x (T, D), ids int32 (T, K), weights (T, K), out
    (T, D) float32), expert e computing down(act(gate(x) + b_gate[e], up(x) + b_up[e])) +
    b_down[e]. w_*: WeightRef stacks (E, I, D), (E, I, D), (E, D, I); b_*: float32 (E, I),
    (E, I), (E, D) or None; activation one of config.EXPERT_ACTIVATIONS."""
    w_gate: WeightRef
    w_up: WeightRef
    w_down: WeightRef
    b_gate: np.ndarray | None
    b_up: np.ndarray | None
    b_down: np.ndarray | None
    activation: str
    alpha: float
    limit: float
    threads: int
    activations: str = "f32"

    def _linear(self, x: np.ndarray, w: WeightRef, b: np.ndarray | None, e: int) -> np.ndarray:
        return kernels.linear(x, w, None if b is None else b[e], expert=e,
                              threads=self.threads, activations=self.activations)

    def __call__(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                 out: np.ndarray) -> np.ndarray:
        K = ids.shape[1]
        slots = ids.reshape(-1)
        order = np.argsort(slots, kind="stable")                  # (token, k) slots by expert
        experts, starts = np.unique(slots[order], return_index=True)
        acc = np.zeros(out.shape, dtype=np.float32)
        for e, group in zip(experts.tolist(), np.split(order, starts[1:])):
            tokens = group // K
            xs = np.ascontiguousarray(x[tokens])
            g = self._linear(xs, self.w_gate, self.b_gate, e)
            u = self._linear(xs, self.w_up, self.b_up, e)
            if self.activation == "swigluoai":
                h = swigluoai(g, u, self.alpha, self.limit)
            else:
                h = g * (np.float32(1.0) / (np.float32(1.0) + np.exp(-g))) * u
            y = self._linear(np.ascontiguousarray(h, dtype=np.float32), self.w_down,
                             self.b_down, e)
            y *= weights.reshape(-1)[group][:, None]
            np.add.at(acc, tokens, y)
        out[...] = acc
        return out

@dataclass
class MoE:
    """Routed experts of one layer, plus the sigmoid-gated shared expert when present.

    router: (E, D); experts: WeightRef stacks (E, I, D), (E, I, D), (E, D, I);
    shared: (gate (Is, D), up (Is, D), down (D, Is)) or None; shared_gate: (1, D) or None.
    rule: the routing rule (config.ROUTERS), jitter_eps its parameter (sparsemixer);
    activations: of the experts and shared expert.
    correction_bias: float32 (E,), the choice bias of "sigmoid_group_topk"; n_group /
    topk_group: the group rules' groups; routed_scaling_factor: multiplies the weights.
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
    # experts_hook(x, ids, weights, y) runs the routed experts instead of the mapping's
    # kernel call when set: an expert cache (colibri.expert_cache) or the telemetry that
    # watches the mapping (colibri.telemetry). None: the plain call below.
    experts_hook: Callable | None = None

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
        self._experts = self.biased_experts or kernels.prepare_expert_ffn(
            self.w_gate, self.w_up, self.w_down, threads=self.threads,
            activations=self.activations)

    def __call__(self, x: np.ndarray, timings: Timings, out: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """x float32 (T, D) C-contiguous -> (y (T, D) f32, ids (T, K) int32, weights (T, K)
        f32, shared-gate values (T,) f32 or None). out: float32 (T, D) for y (not x), or
        None. The same kernels as linear / route_topk / expert_ffn, prepared at load."""
        t0 = time.perf_counter()
        logits = np.empty((x.shape[0], self.router.rows), dtype=np.float32)       # (T, E)
        self._router(x, logits)
        ids, weights = self._route(logits)                                           # (T, K)
        if self._scale != 1:
            weights *= self._scale
        t0 = timings.add("router", t0)
        y = np.empty(x.shape, dtype=np.float32) if out is None else out
        if self.experts_hook is None:
            self._experts(x, ids, weights, y)                                        # (T, D)
        else:
            self.experts_hook(x, ids, weights, y)
        t0 = timings.add("experts", t0)
        gate_values = None
        if self.shared is not None:
            g, u, d = self.shared
            s = kernels.swiglu(x, g, u, d, threads=self.threads,
                               activations=self.activations)                         # (T, D)
            if self.shared_gate is not None:
                z = kernels.linear(x, self.shared_gate, threads=self.threads)[:, 0]  # (T,)
                gate_values = (np.float32(1.0) / (np.float32(1.0) + np.exp(-z))).astype(np.float32)
                s *= gate_values[:, None]
            y += s
            timings.add("shared", t0)
        return y, ids, weights, gate_values


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
