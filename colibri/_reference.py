"""Plain-NumPy twins of the kernels in colibri.kernels: the specification and the test oracle.

Each ``<name>_ref`` computes what ``kernels.<name>`` computes, the slow and obvious way:
weights are decoded from the raw bytes of a WeightRef (independently of quant.py), matrix
products run in float64 and are rounded to float32 once at the end. The kernels accumulate
in float32, so they agree with these up to rounding; where a rule is discrete (which experts
a token picks, how ties break, how tokens are grouped) they agree exactly.

Shapes: T tokens, D hidden, I expert intermediate, E experts, K experts per token,
R rows (outputs) and C columns (inputs) of one weight matrix, G group size.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:                                   # no runtime import: kernels imports _kernels
    from .kernels import WeightRef

__all__ = [
    "dequantize_ref", "linear_ref", "route_topk_ref", "gumbel_ref", "group_by_expert_ref",
    "expert_ffn_ref", "swiglu_ref", "silu_ref",
]

_PLAIN_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}


def _row_bytes(dtype: str, cols: int, group_size: int) -> int:
    if dtype in _PLAIN_ITEMSIZE:
        return cols * _PLAIN_ITEMSIZE[dtype]
    quant = cols if dtype == "q8" else cols // 2
    return quant + 2 * (cols // group_size)


def _rows(w: "WeightRef", expert: int) -> np.ndarray:
    """The stored bytes of one expert's matrix: uint8 (R, row bytes), a copy."""
    rb = _row_bytes(w.dtype, w.cols, w.group_size)
    start = w.offset + expert * w.expert_stride
    idx = start + np.arange(w.rows, dtype=np.int64)[:, None] * w.row_stride + np.arange(rb)
    return np.asarray(w.buf)[idx]


def dequantize_ref(w: "WeightRef", expert: int = 0) -> np.ndarray:
    """Decode one expert's matrix from the bytes (SPEC 1.5) -> float32 (R, C).

    Exact: every format's value is representable in float32.
    """
    if not 0 <= expert < w.n_experts:
        raise ValueError(f"expert {expert} out of range for {w.n_experts} experts")
    raw = _rows(w, expert)                                            # (R, row bytes)
    R, C, G = w.rows, w.cols, w.group_size
    if w.dtype == "f32":
        return raw.view("<f4").astype(np.float32)
    if w.dtype == "f16":
        return raw.view("<f2").astype(np.float32)
    if w.dtype == "bf16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    if w.dtype == "q8":
        q = raw[:, :C].view(np.int8).astype(np.float32)                # (R, C)
        scales = raw[:, C:].copy().view("<f2").astype(np.float32)     # (R, C/G)
    elif w.dtype == "q4":
        packed = raw[:, :C // 2].reshape(R, C // 32, 16)               # 16 bytes per 32 elements
        nib = np.concatenate([packed & 0x0F, packed >> 4], axis=2)    # (R, C/32, 32) in order
        q = nib.reshape(R, C).astype(np.float32) - 8.0
        scales = raw[:, C // 2:].copy().view("<f2").astype(np.float32)
    else:
        raise ValueError(f"unknown weight dtype {w.dtype!r}")
    return (q.reshape(R, C // G, G) * scales[:, :, None]).reshape(R, C)


def linear_ref(x: np.ndarray, w: "WeightRef", bias: np.ndarray | None = None, *,
               expert: int = 0) -> np.ndarray:
    """y = x @ W.T (+ bias): x float32 (T, C) or (C,) -> float32 (T, R) or (R,)."""
    W = dequantize_ref(w, expert).astype(np.float64)                  # (R, C)
    y = np.asarray(x, dtype=np.float64) @ W.T
    if bias is not None:
        y = y + np.asarray(bias, dtype=np.float64)
    return y.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# routing

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MASK64 = (1 << 64) - 1


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def gumbel_ref(seed: int, T: int, E: int) -> np.ndarray:
    """Gumbel(0, 1) noise float32 (T, E): a pure function of (seed, token, expert).

    key_t = mix64(seed + GOLDEN * (t + 1)); bits = mix64(key_t + GOLDEN * (e + 1));
    u = (bits >> 40 + 0.5) / 2^24 in (0, 1); g = -log(-log(u)) in float64, rounded to float32.
    """
    with np.errstate(over="ignore"):
        s = np.array([int(seed) & _MASK64], dtype=np.uint64)
        t = np.arange(1, T + 1, dtype=np.uint64)[:, None]
        e = np.arange(1, E + 1, dtype=np.uint64)[None, :]
        key = _mix64(s + _GOLDEN * t)                                  # (T, 1)
        bits = _mix64(key + _GOLDEN * e)                               # (T, E)
    u = ((bits >> np.uint64(40)).astype(np.float64) + 0.5) / 16777216.0
    return (-np.log(-np.log(u))).astype(np.float32)


def _softmax_f32(v: np.ndarray) -> np.ndarray:
    """Softmax of a float32 vector, max-subtracted, never NaN for non-NaN input.

    All -inf -> uniform; any +inf -> uniform over the +inf entries (the limits).
    exp in float32, the sum in float64.
    """
    m = v.max()
    if m == -np.inf:
        return np.full(v.shape, 1.0 / v.size, dtype=np.float32)
    if m == np.inf:
        top = v == np.inf
        return np.where(top, np.float32(1.0 / top.sum()), np.float32(0.0)).astype(np.float32)
    with np.errstate(over="ignore", under="ignore"):
        e = np.exp((v - m).astype(np.float32))
    return (e / e.sum(dtype=np.float64)).astype(np.float32)


def _top(key: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest keys, largest first, ties -> lower index (a stable sort)."""
    return np.argsort(-key.astype(np.float64), kind="stable")[:k]


def route_topk_ref(logits: np.ndarray, k: int, *, rule: str = "softmax_topk",
                   norm_topk_prob: bool = False, noise_seed: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Router weights: logits float32 (T, E) -> ids int32 (T, K), weights float32 (T, K).

    "softmax_topk": p = softmax over all E; top-k by p (ties -> lower expert index);
        weights = p[ids], divided by their sum when norm_topk_prob.
    "topk_softmax": top-k by logit; weights = softmax over the k chosen logits.
    noise_seed: the top-k selects on logits + gumbel_ref(seed) instead (sampling-time routing);
        the weights come from the un-noised logits.
    Each row of ids is listed by descending weight, ties -> lower expert index.
    """
    logits = np.asarray(logits, dtype=np.float32)
    T, E = logits.shape
    if rule not in ("softmax_topk", "topk_softmax"):
        raise ValueError(f"unknown routing rule {rule!r}")
    noise = gumbel_ref(noise_seed, T, E) if noise_seed is not None else None
    ids = np.empty((T, k), dtype=np.int32)
    wts = np.empty((T, k), dtype=np.float32)
    for t in range(T):
        l = logits[t]
        if rule == "softmax_topk":
            p = _softmax_f32(l)
            sel = _top(p if noise is None else l + noise[t], k)
            w = p[sel]
            if norm_topk_prob:
                w = (w / w.sum(dtype=np.float64)).astype(np.float32)
        else:
            sel = _top(l if noise is None else l + noise[t], k)
            w = _softmax_f32(l[sel])
        order = np.lexsort((sel, -w.astype(np.float64)))              # weight desc, id asc
        ids[t], wts[t] = sel[order], w[order]
    return ids, wts


def group_by_expert_ref(ids: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """ids int (T, K) -> offsets int64 (E+1,), slots int32 (T*K,).

    slots[offsets[e]:offsets[e+1]] are the flat slots t*K+k with ids[t, k] == e, ascending.
    """
    flat = np.asarray(ids).reshape(-1).astype(np.int64)
    counts = np.bincount(flat, minlength=n_experts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    slots = np.argsort(flat, kind="stable").astype(np.int32)
    return offsets, slots


def silu_ref(g: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return g / (1.0 + np.exp(-g))


def expert_ffn_ref(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, w_gate: "WeightRef",
                   w_up: "WeightRef", w_down: "WeightRef") -> np.ndarray:
    """Routed SwiGLU experts: x float32 (T, D) -> y float32 (T, D).

    y[t] = sum_k weights[t,k] * W_down[e] @ (silu(W_gate[e] @ x[t]) * (W_up[e] @ x[t])),
    e = ids[t, k]. Only the experts in ids are decoded.
    """
    x64 = np.asarray(x, dtype=np.float64)
    T, D = x64.shape
    y = np.zeros((T, D), dtype=np.float64)
    cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for t in range(T):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e not in cache:
                cache[e] = tuple(dequantize_ref(w, e).astype(np.float64)
                                 for w in (w_gate, w_up, w_down))
            Wg, Wu, Wd = cache[e]
            h = silu_ref(Wg @ x64[t]) * (Wu @ x64[t])                  # (I,)
            y[t] += float(weights[t, k]) * (Wd @ h)
    return y.astype(np.float32)


def swiglu_ref(x: np.ndarray, w_gate: "WeightRef", w_up: "WeightRef", w_down: "WeightRef"
               ) -> np.ndarray:
    """Dense SwiGLU FFN: x float32 (T, D) -> float32 (T, D), W_down @ (silu(W_gate x) * W_up x)."""
    x64 = np.asarray(x, dtype=np.float64)
    Wg, Wu, Wd = (dequantize_ref(w).astype(np.float64) for w in (w_gate, w_up, w_down))
    h = silu_ref(x64 @ Wg.T) * (x64 @ Wu.T)                            # (T, I)
    return (h @ Wd.T).astype(np.float32)
