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
router bias take BiasedExperts instead of the fused kernel: the same row kernels, one
compiled call for a decode step's token, else a prepared linear per chosen expert and
matrix.

The kernels read the weights in place from the mapped file (WeightRef); an expert no token
chose is never touched. Every kernel call gets the model's thread count.

Shapes as in the package docstring (T token rows, E, K, I, Is shared-expert intermediate).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import kernels
from ..experts.expert_source import ExpertSource, MappedExperts
from ..kernels.runtime import Timings
from ..kernels.weights import WeightRef

__all__ = ["MoE", "DenseMLP", "BiasedExperts", "swigluoai"]


def swigluoai(g: np.ndarray, u: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """GPT-OSS's expert activation, float32 as transformers: g clamped to <= limit, u to
    [-limit, limit]; (u + 1) * g * sigmoid(alpha * g). g, u (N, I) -> (N, I)."""
    return _swigluoai_into(np.array(g, dtype=np.float32), np.array(u, dtype=np.float32),
                           alpha, limit)


def _swigluoai_into(g: np.ndarray, u: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """swigluoai in place (the same operations, the same bits): g and u float32 (N, I) are
    overwritten; returns u, which holds the result."""
    np.minimum(g, np.float32(limit), out=g)
    np.clip(u, np.float32(-limit), np.float32(limit), out=u)
    t = g * np.float32(alpha)
    np.negative(t, out=t)
    np.exp(t, out=t)
    t += np.float32(1.0)
    np.divide(np.float32(1.0), t, out=t)
    t *= g                                                    # g * sigmoid(alpha * g)
    u += np.float32(1.0)
    u *= t
    return u


def _silu_mul_into(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """g * sigmoid(g) * u in place (g overwritten; returns u, the result)."""
    t = np.negative(g)
    np.exp(t, out=t)
    t += np.float32(1.0)
    np.divide(np.float32(1.0), t, out=t)
    np.multiply(g, t, out=g)
    np.multiply(g, u, out=u)
    return u


@dataclass
class BiasedExperts:
    """Routed experts with biases and / or the swigluoai activation: `p(x, ids, weights,
    out)` as the prepared fused kernel (x (T, D), ids int32 (T, K), weights (T, K), out
    (T, D) float32, out may be x), expert e computing down(act(gate(x) + b_gate[e],
    up(x) + b_up[e])) + b_down[e]. w_*: WeightRef stacks (E, I, D), (E, I, D), (E, D, I);
    b_*: float32 (E, I), (E, I), (E, D) or None; activation one of config.EXPERT_ACTIVATIONS.

    One token (the decode step): one compiled call (kernels.prepare_biased_experts: the
    chosen experts' gate / up rows, biases and activation on the pool, then their down rows
    and the weighted sum). More tokens (prefill, the ragged step of several sequences; or
    out is x): one compiled call too (kernels.prepare_biased_experts_grouped: the slots
    grouped by expert once, then per expert its matrices over its tokens), whose bits are
    those of `reference`, the specification: one pass per chosen expert over its tokens,
    each matrix a prepared linear (kept per stack row) and its bias added after it (the
    kernels add a bias the same way: one float32 addition), the activation in NumPy. Either
    way the expert outputs are added per token in ascending expert order.

    Over an expert cache's arena (colibri.experts.expert_cache) the stacks hold its slots (n_slots,
    ...) and n_experts is the biases' E; `p(x, ids, weights, out, slots)` then reads expert
    ids[t, k] from stack row slots[t, k] (int32 (T, K)), its biases from row ids[t, k]."""
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
    n_experts: int | None = None       # the biases' E when the stacks are an arena's slots

    def __post_init__(self):
        self._stacks = (self.w_gate, self.w_up, self.w_down)
        self._biases = (self.b_gate, self.b_up, self.b_down)
        self._prepared: dict[tuple[int, int, str], Callable] = {}
        args = (self.w_gate, self.w_up, self.w_down, self.b_gate, self.b_up, self.b_down,
                self.activation, self.alpha, self.limit)
        kw = dict(threads=self.threads, activations=self.activations, n_experts=self.n_experts)
        # one token (the decode step): every chosen expert in one compiled call
        self._decode = kernels.prepare_biased_experts(*args, **kw)
        # more tokens: one compiled call with reference's bits (it needs NumPy's exp loop)
        self._grouped = (kernels.prepare_biased_experts_grouped(*args, **kw)
                         if kernels.EXP_LOOP else None)

    def _linear(self, j: int, e: int, n: int, s: int
                ) -> Callable[[np.ndarray, np.ndarray], None]:
        """Matrix j (0 gate, 1 up, 2 down) of expert e at stack row s, for n tokens: its
        prepared linear (on f32 activations where kernels.mxfp4_f32_activations says so),
        then its bias added."""
        act = ("f32" if kernels.mxfp4_f32_activations(self._stacks[j], self.activations, n)
               else self.activations)
        key = (j, s, act)
        p = self._prepared.get(key)
        if p is None:
            p = kernels.prepare_linear(self._stacks[j].expert(s), threads=self.threads,
                                       activations=act)
            self._prepared[key] = p
        b = self._biases[j]
        if b is None:
            return p

        def biased(x: np.ndarray, y: np.ndarray) -> None:
            p(x, y)
            y += b[e]
        return biased

    def __call__(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                 out: np.ndarray, slots: np.ndarray | None = None, many: bool = False
                 ) -> np.ndarray:
        """many: the many-token call even for one token (its bits: an expert shard computing
        one slot of a many-token step, colibri.experts.expert_shards)."""
        T, K = ids.shape
        call = (self._decode if T == 1 and not many and not np.may_share_memory(x, out)
                else self._grouped or self.reference)
        if slots is None:
            call(x, ids, weights, out)
        else:
            call(x, ids, weights, out, slots)
        return out

    def reference(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                  out: np.ndarray, slots: np.ndarray | None = None) -> np.ndarray:
        """__call__ as a Python loop over the chosen experts, one prepared linear per
        matrix and the activation in NumPy: the specification the compiled calls are tested
        against (the grouped one: the same bits; the one-token one: the same bits but the
        activation's exp), and the path of more than one token where NumPy's exp loop was
        not found."""
        T, K = ids.shape
        I, D = self.w_gate.rows, self.w_down.rows
        flat = ids.reshape(-1)
        rows = flat if slots is None else slots.reshape(-1)      # each expert's stack row
        order = np.argsort(flat, kind="stable")                   # (token, k) slots by expert
        by_expert = flat[order]
        edges = [0, *(np.flatnonzero(by_expert[1:] != by_expert[:-1]) + 1).tolist(), T * K]
        w_slot = weights.reshape(-1)
        acc = np.zeros((T, D), dtype=np.float32)
        for s0, s1 in zip(edges[:-1], edges[1:]):
            e, n, group = int(by_expert[s0]), s1 - s0, order[s0:s1]
            s = int(rows[group[0]])
            tokens = group // K                                   # ascending
            xs = x if T == 1 and n == 1 else np.ascontiguousarray(x[tokens])
            g = np.empty((n, I), dtype=np.float32)
            u = np.empty((n, I), dtype=np.float32)
            self._linear(0, e, n, s)(xs, g)
            self._linear(1, e, n, s)(xs, u)
            h = (_swigluoai_into(g, u, self.alpha, self.limit) if self.activation == "swigluoai"
                 else _silu_mul_into(g, u))
            y = np.empty((n, D), dtype=np.float32)
            self._linear(2, e, n, s)(h, y)
            y *= w_slot[group][:, None]
            if n == 1:
                acc[tokens[0]] += y[0]
            elif (tokens[1:] != tokens[:-1]).all():               # a token once per expert
                acc[tokens] += y
            else:                                                 # ids repeating an expert
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
