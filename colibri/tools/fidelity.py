"""Routing fidelity: how far a quantized model's routing is from its base model's on the same text.

    fid = routing_fidelity("model-q4.colibri", "model-bf16.colibri", text)   # one pass of each
    fid = compare_routing(trace_q4, trace_base)     # two colibri.trace Traces of the same tokens
    fid.set_agreement   float64 (M,)   mean over tokens of |S_q ∩ S_base| / K
    fid.top1            float64 (M,)   share of tokens whose heaviest expert is the same
    fid.weight_error    float64 (M,)   mean |w_q - w_base| over the experts both chose
    fid.weight_l1       float64 (M,)   mean over tokens of || W_q - W_base ||_1 (dense (E,) weights)
    fid.prob_l1         float64 (M,)   mean over tokens of || p_q - p_base ||_1 (router softmax)
    fid.mean()          the same five, averaged over the layers (a dict)

`colibri perplexity MODEL -f FILE --kl-base BASE` prints this per layer (the routing section),
from the forward passes that give the KL: the routing of every position of every window.

Definitions, per token t and MoE layer m (S the set of the K experts chosen, w their combine
weights as the forward pass used them, W the dense (E,) vector that holds w at S and 0
elsewhere, p the softmax of the router logits over all E experts):
- set agreement |S_q ∩ S_b| / K: 1 when the same experts run, whatever their order;
- top-1: the heaviest expert (experts[..., 0]) is the same;
- weight error: mean over e in S_q ∩ S_b of |w_q(e) - w_b(e)|, averaged over the tokens with at
  least one shared expert (`n_shared` counts them; NaN for a layer without one);
- weight L1: sum_e |W_q(e) - W_b(e)|: 0 for identical routing, 2 at most for weights summing
  to 1 with disjoint sets; it folds the set changes and the weight changes into one number;
- probability L1: sum_e |p_q(e) - p_b(e)| (NaN when a trace has no router logits).

A model against itself gives 1, 1, 0, 0, 0. The result folds sums, so results over parts of
a text add up (`a + b`, as `routing_fidelity` and `perplexity` do window by window) to the
result over the whole.

Shapes in the package's alphabet (colibri): T tokens, M MoE layers, K experts per token,
E experts.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.kv_cache import DEFAULT_MAX_CTX
from ..engine.model import Model
from ..errors import ColibriError
from .trace import Trace, iter_trace

__all__ = ["RoutingFidelity", "compare_routing", "routing_fidelity", "fidelity_rows"]

METRICS = ("set_agreement", "top1", "weight_error", "weight_l1", "prob_l1")


@dataclass
class RoutingFidelity:
    """Sums over tokens per MoE layer (float64 (M,) each; n_shared int64 (M,)); the metrics
    are properties (module docstring). `model` and `base` name the two sides."""
    layers: list[int]
    top_k: int
    n_experts: int
    n_tokens: int = 0
    sum_set: np.ndarray = field(default=None, repr=False)
    sum_top1: np.ndarray = field(default=None, repr=False)
    sum_weight_error: np.ndarray = field(default=None, repr=False)
    n_shared: np.ndarray = field(default=None, repr=False)
    sum_weight_l1: np.ndarray = field(default=None, repr=False)
    sum_prob_l1: np.ndarray = field(default=None, repr=False)
    n_prob: int = 0
    model: str = ""
    base: str = ""

    def __post_init__(self) -> None:
        M = len(self.layers)
        for name in ("sum_set", "sum_top1", "sum_weight_error", "sum_weight_l1", "sum_prob_l1"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(M, np.float64))
        if self.n_shared is None:
            self.n_shared = np.zeros(M, np.int64)

    def __add__(self, other: "RoutingFidelity") -> "RoutingFidelity":
        if (self.layers, self.top_k, self.n_experts) != (
                other.layers, other.top_k, other.n_experts):
            raise ValueError(f"cannot add routing fidelity of layers {other.layers} (top-"
                             f"{other.top_k} of {other.n_experts}) to layers {self.layers} "
                             f"(top-{self.top_k} of {self.n_experts})")
        return RoutingFidelity(
            self.layers, self.top_k, self.n_experts, self.n_tokens + other.n_tokens,
            self.sum_set + other.sum_set, self.sum_top1 + other.sum_top1,
            self.sum_weight_error + other.sum_weight_error, self.n_shared + other.n_shared,
            self.sum_weight_l1 + other.sum_weight_l1, self.sum_prob_l1 + other.sum_prob_l1,
            self.n_prob + other.n_prob, self.model or other.model, self.base or other.base)

    def _per_token(self, total: np.ndarray, count) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(np.asarray(count) > 0, total / np.maximum(count, 1), np.nan)

    @property
    def set_agreement(self) -> np.ndarray:
        return self._per_token(self.sum_set, self.n_tokens)

    @property
    def top1(self) -> np.ndarray:
        return self._per_token(self.sum_top1, self.n_tokens)

    @property
    def weight_error(self) -> np.ndarray:
        return self._per_token(self.sum_weight_error, self.n_shared)

    @property
    def weight_l1(self) -> np.ndarray:
        return self._per_token(self.sum_weight_l1, self.n_tokens)

    @property
    def prob_l1(self) -> np.ndarray:
        return self._per_token(self.sum_prob_l1, self.n_prob)

    def mean(self) -> dict[str, float]:
        """Each metric averaged over the layers (NaN layers left out)."""
        out = {}
        for name in METRICS:
            v = getattr(self, name)
            out[name] = float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: per-layer lists and the means (NaN as None)."""
        def clean(x):
            return None if not np.isfinite(x) else float(x)
        out: dict[str, Any] = {"model": self.model, "base": self.base,
                               "n_tokens": self.n_tokens, "top_k": self.top_k,
                               "n_experts": self.n_experts, "layers": list(self.layers)}
        for name in METRICS:
            out[name] = [clean(x) for x in getattr(self, name)]
        out["mean"] = {k: clean(v) for k, v in self.mean().items()}
        return out


def _dense(experts: np.ndarray, weights: np.ndarray, n_experts: int) -> np.ndarray:
    """(T, M, K) ids and weights -> float64 (T, M, E) with w at the chosen ids, 0 elsewhere."""
    T, M, _ = experts.shape
    W = np.zeros((T, M, n_experts), np.float64)
    np.put_along_axis(W, experts.astype(np.int64), weights.astype(np.float64), axis=-1)
    return W


def compare_routing(model: Trace, base: Trace) -> RoutingFidelity:
    """The routing fidelity of `model` against `base`, two Traces of the same T tokens.

    Raises ValueError naming what differs when the traces do not cover the same tokens, MoE
    layers, top-k or expert count.
    """
    T, M, K = model.experts.shape
    if base.experts.shape != (T, M, K):
        raise ValueError(f"routing traces differ in shape (tokens, MoE layers, top-k): model "
                         f"{(T, M, K)}, base {base.experts.shape}")
    if model.layers != base.layers:
        raise ValueError(f"routing traces cover different MoE layers: model {model.layers}, "
                         f"base {base.layers}")
    if model.n_experts != base.n_experts:
        raise ValueError(f"routing traces have different expert counts: model "
                         f"{model.n_experts}, base {base.n_experts}")
    known = (model.token_ids >= 0) & (base.token_ids >= 0)
    if (model.token_ids[known] != base.token_ids[known]).any():
        first = int(np.flatnonzero(known & (model.token_ids != base.token_ids))[0])
        raise ValueError(f"routing traces are of different tokens: first difference at token "
                         f"{first} (model {int(model.token_ids[first])}, base "
                         f"{int(base.token_ids[first])})")
    E = model.n_experts
    Wq = _dense(model.experts, model.weights, E)                          # (T, M, E)
    Wb = _dense(base.experts, base.weights, E)
    chosen_q = np.zeros((T, M, E), bool)
    chosen_b = np.zeros((T, M, E), bool)
    np.put_along_axis(chosen_q, model.experts.astype(np.int64), True, axis=-1)
    np.put_along_axis(chosen_b, base.experts.astype(np.int64), True, axis=-1)
    both = chosen_q & chosen_b                                            # (T, M, E)
    n_both = both.sum(axis=-1)                                            # (T, M)
    diff = np.abs(Wq - Wb)
    err = np.where(both, diff, 0.0).sum(axis=-1)                          # (T, M)
    has = n_both > 0
    res = RoutingFidelity(list(model.layers), K, E, T)
    res.sum_set = (n_both / K).sum(axis=0)
    res.sum_top1 = (model.experts[..., 0] == base.experts[..., 0]).sum(axis=0).astype(np.float64)
    res.sum_weight_error = np.where(has, err / np.maximum(n_both, 1), 0.0).sum(axis=0)
    res.n_shared = has.sum(axis=0).astype(np.int64)
    res.sum_weight_l1 = diff.sum(axis=-1).sum(axis=0)
    if model.probs is not None and base.probs is not None:
        res.sum_prob_l1 = np.abs(model.probs.astype(np.float64) - base.probs).sum(axis=-1) \
            .sum(axis=0)
        res.n_prob = T
    return res


def routing_fidelity(model, base, data, *, batch_size: int = 256,
                     max_tokens: int | None = None, window: int | None = None,
                     threads: int | None = None, activations: str = "f32") -> RoutingFidelity:
    """Run `data` through `model` and `base` (one pass each, the same calls) and compare their
    routing (compare_routing, folded call by call: memory of one call's routing).

    model, base: Models (used as they are) or .colibri paths (opened with `threads`; `model`
        with `activations`, "f32" by default so that only the weights differ; the base f32;
        both with an f32 KV cache).
    data: text, a list of texts, a pathlib.Path of a text file, or token ids (as colibri.trace);
        text is tokenized by each model, so different tokenizers fail on the first token that
        differs.
    batch_size, max_tokens, window: as colibri.trace (window defaults to the shorter context).
    Raises ColibriError naming both files when the routing or the tokens differ in shape.
    """
    m, own_m = (model, False) if isinstance(model, Model) else (
        Model(model, threads=threads, activations=activations, kv_dtype="f32"), True)
    try:
        b, own_b = (base, False) if isinstance(base, Model) else (
            Model(base, threads=threads, activations="f32", kv_dtype="f32"), True)
    except BaseException:
        if own_m:
            m.close()
        raise
    try:
        if window is None:
            window = min(m.max_context, b.max_context, DEFAULT_MAX_CTX)
        total = None
        parts = zip(iter_trace(m, data, batch_size=batch_size, max_tokens=max_tokens,
                               window=window),
                    iter_trace(b, data, batch_size=batch_size, max_tokens=max_tokens,
                               window=window))
        for tq, tb in parts:
            try:
                part = compare_routing(tq, tb)
            except ValueError as e:
                raise ColibriError(f"{b.file.path} and {m.file.path}: {e}") from None
            total = part if total is None else total + part
        if total is None:
            raise ValueError("the input has no tokens")
        total.model, total.base = str(m.file.path), str(b.file.path)
        return total
    finally:
        if own_m:
            m.close()
        if own_b:
            b.close()


def fidelity_rows(fid: RoutingFidelity) -> tuple[str, list[str], list[list[str]]]:
    """(title, header, rows) of the routing table: one row per MoE layer, then the mean over
    layers (colibri.tools.perplexity.format_markdown renders it)."""
    header = ["MoE layer", "top-k set", "top-1", "Δw shared", "‖ΔW‖₁", "‖Δp‖₁"]

    def row(label: str, vals: Sequence[float]) -> list[str]:
        return [label] + [("n/a" if not np.isfinite(v) else
                           f"{100 * v:.2f}%" if i < 2 else f"{v:.4f}")
                          for i, v in enumerate(vals)]
    rows = [row(str(layer), [getattr(fid, n)[j] for n in METRICS])
            for j, layer in enumerate(fid.layers)]
    mean = fid.mean()
    rows.append(row("mean", [mean[n] for n in METRICS]))
    title = (f"routing of {Path(fid.model).name or 'model'} against "
             f"{Path(fid.base).name or 'base'}: {fid.n_tokens} tokens, top-{fid.top_k} of "
             f"{fid.n_experts} experts")
    return title, header, rows
