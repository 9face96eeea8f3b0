"""BiasedExperts: routed experts with biases and / or GPT-OSS's swigluoai activation, over the
compiled calls (pyx/biased_experts.pxi for one token, pyx/biased_grouped.pxi for many) and
their specification, a Python loop of prepared linears (BiasedExperts.reference).

A MoE layer (colibri.engine.moe) takes one instead of the fused expert kernel
(kernels.prepare_expert_ffn) when its family has expert biases or swigluoai; so do an expert
cache's arena (colibri.experts.expert_cache) and an expert shard (colibri.experts.shard_worker),
which is why it lives here, below the engine and the expert sources both.

Shapes as in the package docstring (T token rows, E, K, I, D).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import kernels
from .weights import WeightRef

__all__ = ["BiasedExperts", "swigluoai"]


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
