"""Plain-NumPy twins of the kernels in colibri.kernels: the specification and the test oracle.

Each ``<name>_ref`` computes what ``kernels.<name>`` computes, the slow and obvious way:
weights are decoded from the raw bytes of a WeightRef (independently of quant.py), matrix
products run in float64 and are rounded to float32 once at the end. The kernels accumulate
in float32, so they agree with these up to rounding; where a rule is discrete (which experts
a token picks, how ties break, how tokens are grouped) they agree exactly.

The quantized-activation twins (``quantize_activations_ref``, ``*_iact_ref``, for
activations="int8" with bits=8 and "int16" with bits=16) follow the same rule: the
quantization is float32 arithmetic done exactly as the kernels do it (bit-identical results),
the integer dot products are exact, and only the float part (block scales times integer
sums) runs in float64. ``linear_igemm_ref`` is the exception: the integer GEMM path's
float part in its own float32 order (one fused multiply-add per block), bit for bit.

Shapes as in the package docstring: T token rows, D hidden, I expert intermediate, E experts,
K experts per token, R rows (outputs) and C columns (inputs) of one weight matrix, Q group size.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .. import dtypes

if TYPE_CHECKING:                                   # no runtime import: weights imports _kernels
    from .weights import WeightRef

__all__ = [
    "dequantize_ref", "linear_ref", "route_topk_ref", "route_group_ref", "sparsemixer_ref",
    "gumbel_ref",
    "group_by_expert_ref",
    "expert_ffn_ref", "swiglu_ref", "silu_ref", "quantize_activations_ref",
    "linear_iact_ref", "linear_igemm_ref", "expert_ffn_iact_ref", "swiglu_iact_ref",
    "rms_norm_rows_ref", "rope_rows_ref", "mla_absorbed_ref",
    "swigluoai_ref", "biased_experts_ref",
]

F32 = np.float32


def _rows(w: "WeightRef", expert: int) -> np.ndarray:
    """The stored bytes of one expert's matrix: uint8 (R, row bytes), a copy."""
    rb = dtypes.row_stride(w.dtype, w.cols, w.group_size)           # the packed row
    start = w.offset + expert * w.expert_stride
    idx = start + np.arange(w.rows, dtype=np.int64)[:, None] * w.row_stride + np.arange(rb)
    return np.asarray(w.buf)[idx]


def dequantize_ref(w: "WeightRef", expert: int = 0) -> np.ndarray:
    """Decode one expert's matrix from the bytes (docs/format.md §6) -> float32 (R, C).

    Exact: every format's value is representable in float32.
    """
    if not 0 <= expert < w.n_experts:
        raise ValueError(f"expert {expert} out of range for {w.n_experts} experts")
    raw = _rows(w, expert)                                            # (R, row bytes)
    R, C, Q = w.rows, w.cols, w.group_size
    if w.dtype == "f32":
        return raw.view("<f4").astype(np.float32)
    if w.dtype == "f16":
        return raw.view("<f2").astype(np.float32)
    if w.dtype == "bf16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    if w.dtype == "q8":
        q = raw[:, :C].view(np.int8).astype(np.float32)                # (R, C)
        scales = raw[:, C:].copy().view("<f2").astype(np.float32)     # (R, C/Q)
    elif w.dtype == "q4":
        packed = raw[:, :C // 2].reshape(R, C // 32, 16)               # 16 bytes per 32 elements
        nib = np.concatenate([packed & 0x0F, packed >> 4], axis=2)    # (R, C/32, 32) in order
        q = nib.reshape(R, C).astype(np.float32) - 8.0
        scales = raw[:, C // 2:].copy().view("<f2").astype(np.float32)
    elif w.dtype == "mxfp4":
        # byte j: element 2j low nibble, 2j + 1 high; E2M1: sign bit 3, exponent bits 2..1,
        # mantissa bit 0 (subnormal at exponent 0); block scale 2^(byte - 127)
        packed = raw[:, :C // 2]
        nib = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(R, C).astype(np.int64)
        e, m = (nib >> 1) & 3, nib & 1
        mag = np.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * 2.0 ** (e - 1))
        q = np.where(nib & 8, -mag, mag).astype(np.float32)
        scales = np.exp2(raw[:, C // 2:].astype(np.float64) - 127).astype(np.float32)
    else:
        raise ValueError(f"unknown weight dtype {w.dtype!r}")
    return (q.reshape(R, C // Q, Q) * scales[:, :, None]).reshape(R, C)


def linear_ref(x: np.ndarray, w: "WeightRef", bias: np.ndarray | None = None, *,
               expert: int = 0) -> np.ndarray:
    """y = x @ W.T (+ bias): x float32 (T, C) or (C,) -> float32 (T, R) or (R,)."""
    W = dequantize_ref(w, expert).astype(np.float64)                  # (R, C)
    y = np.asarray(x, dtype=np.float64) @ W.T
    if bias is not None:
        y = y + np.asarray(bias, dtype=np.float64)
    return y.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# quantized activations (activations="int8": bits 8, "int16": bits 16)


def quantize_activations_ref(x: np.ndarray, bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """x float32 (T, C), C a multiple of 32 -> q int8 / int16 (T, C), d float32 (T, C/32).

    Per block of 32: amax = max |x|; d = amax / qmax (127 for bits 8, 32767 for 16); id = 1 / d
    (0 if d == 0); q = rint(x * id), every operation in float32 (so the kernels match bit for
    bit). A block with a NaN or inf: d = NaN, q = 0. A block whose 1 / d overflows (d <
    2^-128): d = 0, q = 0.
    """
    qmax = {8: 127, 16: 32767}[bits]
    x = np.asarray(x, dtype=np.float32)
    T, C = x.shape
    if C % 32:
        raise ValueError(f"x has {C} columns, not a multiple of 32")
    xb = x.reshape(T, C // 32, 32)
    bad = ~np.isfinite(xb).all(axis=2)                                 # (T, C/32)
    amax = np.where(np.isfinite(xb), np.abs(xb), F32(0)).max(axis=2, initial=F32(0))
    d = (amax / F32(qmax)).astype(F32)
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0)).astype(F32)
    zero = bad | ~np.isfinite(inv)
    inv = np.where(zero, F32(0), inv)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.rint((xb * inv[:, :, None]).astype(F32))
    q = np.where(zero[:, :, None], 0, np.clip(q, -qmax, qmax))
    q = q.astype(np.int8 if bits == 8 else np.int16).reshape(T, C)
    d = np.where(bad, F32(np.nan), np.where(zero, F32(0), d)).astype(F32)
    return q, d


def _codes_scales(w: "WeightRef", expert: int) -> tuple[np.ndarray, np.ndarray]:
    """Integer codes int64 (R, C) (q8: the int8, q4: nibble - 8, mxfp4: 2 * FP4) and scales
    float32 (R, C/Q)."""
    raw = _rows(w, expert)
    R, C = w.rows, w.cols
    if w.dtype == "q8":
        codes = raw[:, :C].view(np.int8).astype(np.int64)
        scales = raw[:, C:].copy().view("<f2").astype(F32)
    elif w.dtype == "q4":
        packed = raw[:, :C // 2].reshape(R, C // 32, 16)
        nib = np.concatenate([packed & 0x0F, packed >> 4], axis=2)
        codes = nib.reshape(R, C).astype(np.int64) - 8
        scales = raw[:, C // 2:].copy().view("<f2").astype(F32)
    elif w.dtype == "mxfp4":
        # twice an FP4 value is an integer: codes 2 * FP4 (0, +-1, .., +-12), scales 2^(e-127) / 2
        packed = raw[:, :C // 2]
        nib = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(R, C).astype(np.int64)
        e, m = (nib >> 1) & 3, nib & 1
        mag2 = np.where(e == 0, m, (2 + m) << np.maximum(e - 1, 0))
        codes = np.where(nib & 8, -mag2, mag2)
        scales = (np.exp2(raw[:, C // 2:].astype(np.float64) - 127) / 2).astype(F32)
    else:
        raise ValueError(f"{w.dtype} has no integer codes")
    return codes, scales


def _matmul_act(x32: np.ndarray, w: "WeightRef", expert: int, bits: int) -> np.ndarray:
    """x float32 (T, C) @ W[expert].T as float64 (T, R): the quantized-activation path of
    `bits` (8, 16) for a q4/q8/mxfp4 weight, else (or bits 0) the exact product."""
    if not (bits and w.dtype in ("q8", "q4", "mxfp4")):
        return x32.astype(np.float64) @ dequantize_ref(w, expert).astype(np.float64).T
    isum, d, s_blk = _block_sums(x32, w, expert, bits)
    with np.errstate(invalid="ignore"):
        return np.einsum("rb,tb,trb->tr", s_blk.astype(np.float64), d.astype(np.float64),
                         isum.astype(np.float64))


def _block_sums(x32: np.ndarray, w: "WeightRef", expert: int, bits: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The exact integer dot of every 32-column block of the quantized x (T, C) with the
    weight codes -> isum int64 (T, R, C/32), the activation scales d float32 (T, C/32), the
    weight scale of each block float32 (R, C/32)."""
    q, d = quantize_activations_ref(x32, bits)
    codes, scales = _codes_scales(w, expert)
    T, C = q.shape
    R, nb = w.rows, C // 32
    isum = np.einsum("tbi,rbi->trb", q.reshape(T, nb, 32).astype(np.int64),
                     codes.reshape(R, nb, 32))
    return isum, d, np.repeat(scales, w.group_size // 32, axis=1)


def linear_iact_ref(x: np.ndarray, w: "WeightRef", bias: np.ndarray | None = None, *,
                    expert: int = 0, bits: int = 8) -> np.ndarray:
    """linear with activations="int8" (bits 8) or "int16" (bits 16): x float32 (T, C) or (C,)
    -> float32 (T, R) or (R,).

    q4/q8/mxfp4 weights: y[t, r] = sum_b (s_r,g(b) * d_t,b) * isum_t,r,b with (q, d) =
    quantize_activations_ref(x, bits) and isum the exact integer dot of the block's codes
    with q; the float part in float64. Other formats: linear_ref.
    """
    x32 = np.asarray(x, dtype=F32)
    one = x32.ndim == 1
    y = _matmul_act(np.atleast_2d(x32), w, expert, bits)
    if bias is not None:
        y = y + np.asarray(bias, dtype=np.float64)
    y = y.astype(F32)
    return y[0] if one else y


def fmaf_ref(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """C's fmaf on float32 arrays: a * b + c rounded once to float32.

    a * b is exact in float64 (24 + 24 significant bits); the float64 sum s of it and c,
    rounded, then rounded again to float32 could differ from one rounding only where s lands
    exactly on a float32 midpoint (rounding is monotonic and the midpoints are float64
    numbers); there s moves one float64 step towards the exact sum (its TwoSum error) first.
    """
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c64
        bp = s - p
        err = (p - (s - bp)) + (c64 - bp)                  # exact: s + err = p + c
        r = s.astype(F32)
        r64 = r.astype(np.float64)
        other = np.nextafter(r, np.where(r64 < s, F32(np.inf), F32(-np.inf))).astype(np.float64)
        tie = np.isfinite(s) & (s != r64) & (s == (r64 + other) / 2) & (err != 0)
    if tie.any():
        s = np.where(tie, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        r = s.astype(F32)
    return r


def linear_igemm_ref(x: np.ndarray, w: "WeightRef", bias: np.ndarray | None = None, *,
                     expert: int = 0, bits: int = 8) -> np.ndarray:
    """linear on the integer GEMM path (activations "int8" bits 8 / "int16" bits 16, q4 / q8 /
    mxfp4 weights, from runtime.igemm_min_tokens() tokens), bit for bit: x float32 (T, C) ->
    float32 (T, R).

    Per (token t, row r): acc = 0; per block b in order acc = fmaf(float32(isum_b),
    float32(s_r,g(b) * d_t,b), acc), isum_b the exact integer dot of the block's codes
    (csrc/igemm.h); then + bias[r] (float32).
    """
    x32 = np.atleast_2d(np.asarray(x, dtype=F32))
    isum, d, s_blk = _block_sums(x32, w, expert, bits)
    T, R, nb = isum.shape
    acc = np.zeros((T, R), dtype=F32)
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(nb):
            sd = (s_blk[None, :, b] * d[:, None, b]).astype(F32)       # (T, R)
            acc = fmaf_ref(isum[:, :, b].astype(F32), sd, acc)
    if bias is not None:
        acc = (acc + np.asarray(bias, dtype=F32)).astype(F32)
    return acc


def _ffn_iact(x32: np.ndarray, w_gate, w_up, w_down, expert: int, bits: int) -> np.ndarray:
    """One expert's SwiGLU on rows x float32 (n, D) with quantized activations of `bits`
    -> float64 (n, D). h is rounded to float32 (as the kernels hold it) before it is
    quantized for w_down."""
    g = _matmul_act(x32, w_gate, expert, bits)
    u = _matmul_act(x32, w_up, expert, bits)
    h = (silu_ref(g) * u).astype(F32)
    return _matmul_act(h, w_down, expert, bits)


def expert_ffn_iact_ref(x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                        w_gate: "WeightRef", w_up: "WeightRef", w_down: "WeightRef", *,
                        bits: int = 8) -> np.ndarray:
    """expert_ffn with activations="int8" (bits 8) / "int16" (bits 16): x float32 (T, D) ->
    float32 (T, D)."""
    x32 = np.asarray(x, dtype=F32)
    T, D = x32.shape
    y = np.zeros((T, D), dtype=np.float64)
    for e in np.unique(np.asarray(ids)):
        tk = np.argwhere(np.asarray(ids) == e)                       # (n, 2): token, slot
        out = _ffn_iact(x32[tk[:, 0]], w_gate, w_up, w_down, int(e), bits)
        for (t, k), row in zip(tk, out):
            y[t] += float(weights[t, k]) * row
    return y.astype(F32)


def swiglu_iact_ref(x: np.ndarray, w_gate: "WeightRef", w_up: "WeightRef",
                    w_down: "WeightRef", *, bits: int = 8) -> np.ndarray:
    """swiglu with activations="int8" (bits 8) / "int16" (bits 16): x float32 (T, D) ->
    float32 (T, D)."""
    return _ffn_iact(np.asarray(x, dtype=F32), w_gate, w_up, w_down, 0, bits).astype(F32)


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


def sparsemixer_ref(z: np.ndarray, jitter_eps: float) -> tuple[np.ndarray, np.ndarray]:
    """PhiMoE's sparsemixer at inference (transformers' sparsemixer, training=False), one
    token: logits z float32 (E,) -> (experts int (2,), weights float32 (2,)), in choice order.

    e1 = argmax z; every j with (z[e1] - z_j) / max(|z_j|, z[e1]) > 2 * jitter_eps is masked
    out and w1 = softmax(z over the rest)[e1]. Then e1 is masked too, e2 = argmax of the rest,
    the same mask with z[e2] in place of z[e1] (denominators from the original z) and
    w2 = softmax over the survivors at e2. f32 arithmetic, as torch.
    """
    z = np.asarray(z, dtype=np.float32)
    thresh = np.float32(2.0 * jitter_eps)
    scores, ids, ws = z.copy(), [], []
    with np.errstate(invalid="ignore", divide="ignore"):
        for _ in range(2):
            e = int(np.argmax(scores))
            m = scores[e]
            masked = np.where((m - z) / np.maximum(np.abs(z), m) > thresh, -np.inf, scores)
            ids.append(e)
            ws.append(_softmax_f32(masked.astype(np.float32))[e])
            scores = scores.copy()
            scores[e] = -np.inf
    return np.array(ids), np.array(ws, dtype=np.float32)


def route_topk_ref(logits: np.ndarray, k: int, *, rule: str = "softmax_topk",
                   norm_topk_prob: bool = False, noise_seed: int | None = None,
                   bias: np.ndarray | None = None, n_group: int = 1, topk_group: int = 1,
                   jitter_eps: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Router weights: logits float32 (T, E) -> ids int32 (T, K), weights float32 (T, K).

    "softmax_topk": p = softmax over all E; top-k by p (ties -> lower expert index);
        weights = p[ids], divided by their sum when norm_topk_prob.
    "topk_softmax": top-k by logit; weights = softmax over the k chosen logits.
    "sparsemixer": PhiMoE's top-2 (sparsemixer_ref), k = 2, jitter_eps its threshold / 2.
    noise_seed: the top-k selects on logits + gumbel_ref(seed) instead (sampling-time routing);
        the weights come from the un-noised logits.
    "softmax_group_topk" / "sigmoid_group_topk": route_group_ref (n_group, topk_group, bias).
    Each row of ids is listed by descending weight, ties -> lower expert index.
    """
    logits = np.asarray(logits, dtype=np.float32)
    T, E = logits.shape
    if rule in ("softmax_group_topk", "sigmoid_group_topk"):
        return route_group_ref(logits, k, rule=rule, norm_topk_prob=norm_topk_prob,
                               bias=bias, n_group=n_group, topk_group=topk_group)
    if rule not in ("softmax_topk", "topk_softmax", "sparsemixer"):
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
        elif rule == "sparsemixer":
            sel, w = sparsemixer_ref(l, jitter_eps)
        else:
            sel = _top(l if noise is None else l + noise[t], k)
            w = _softmax_f32(l[sel])
        order = np.lexsort((sel, -w.astype(np.float64)))              # weight desc, id asc
        ids[t], wts[t] = sel[order], w[order]
    return ids, wts


def _kept_experts(gscore: np.ndarray, n_group: int, topk_group: int, E: int) -> np.ndarray:
    """bool (E,): the experts of the topk_group groups of largest gscore (ties -> lower)."""
    keep = np.zeros(n_group, dtype=bool)
    keep[_top(gscore, topk_group)] = True
    return np.repeat(keep, E // n_group)


def route_group_ref(logits: np.ndarray, k: int, *, rule: str, norm_topk_prob: bool = False,
                    bias: np.ndarray | None = None, n_group: int = 1, topk_group: int = 1
                    ) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's group-limited routing: logits float32 (T, E) -> ids int32 (T, K), weights
    float32 (T, K), listed by descending weight (ties -> lower expert index).

    The E experts form n_group groups of E / n_group consecutive experts; the topk_group
    best groups are kept, then the top k of their experts are taken.
    "softmax_group_topk" (V2 group_limited_greedy): p = softmax(logits); group score = max p
        of the group; experts of other groups get p = 0; top-k by p; weights = p[ids].
    "sigmoid_group_topk" (V3, GLM-4-MoE): s = sigmoid(logits) (float32), c = s + bias;
        group score = the sum of the group's two largest c; other groups' c = -inf; top-k by
        c; weights = s[ids], / (sum + 1e-20) in float32 when norm_topk_prob.
    """
    logits = np.asarray(logits, dtype=np.float32)
    T, E = logits.shape
    size = E // n_group
    ids = np.empty((T, k), dtype=np.int32)
    wts = np.empty((T, k), dtype=np.float32)
    for t in range(T):
        if rule == "softmax_group_topk":
            p = _softmax_f32(logits[t])
            keep = _kept_experts(p.reshape(n_group, size).max(axis=1), n_group, topk_group, E)
            key = np.where(keep, p, np.float32(0.0)).astype(np.float32)
            sel = _top(key, k)
            w = key[sel]
        elif rule == "sigmoid_group_topk":
            with np.errstate(over="ignore"):
                s = (np.float32(1.0) / (np.float32(1.0) + np.exp(-logits[t]))).astype(np.float32)
            c = (s + np.asarray(bias, dtype=np.float32)).astype(np.float32)
            top2 = -np.sort(-c.reshape(n_group, size), axis=1)[:, :2]
            gscore = (top2[:, 0] + top2[:, 1]).astype(np.float32)
            keep = _kept_experts(gscore, n_group, topk_group, E)
            sel = _top(np.where(keep, c, np.float32(-np.inf)), k)
            w = s[sel]
            if norm_topk_prob:
                total = np.float32(0.0)
                for v in w:                          # in order, in float32, as the kernel
                    total = np.float32(total + v)
                w = (w / np.float32(total + np.float32(1e-20))).astype(np.float32)
        else:
            raise ValueError(f"unknown group routing rule {rule!r}")
        order = np.lexsort((sel, -w.astype(np.float64)))
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


def attend_decode_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                      sinks: np.ndarray | None = None) -> np.ndarray:
    """float64 softmax attention of one token: q (H, Dh), k / v (Hkv, n, Dh) -> (H, Dh);
    head h reads kv head h // (H / Hkv). sinks (H,) or None: one more logit per head whose
    value row is zero (GPT-OSS)."""
    q64, k64, v64 = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    g = q64.shape[0] // k64.shape[0]
    kh, vh = np.repeat(k64, g, axis=0), np.repeat(v64, g, axis=0)          # (H, n, Dh)
    s = np.einsum("hd,hnd->hn", q64, kh) * float(scale)
    top = s.max(axis=1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, np.asarray(sinks, dtype=np.float64)[:, None])
    e = np.exp(s - top)
    denom = e.sum(axis=1, keepdims=True)
    if sinks is not None:
        denom = denom + np.exp(np.asarray(sinks, dtype=np.float64)[:, None] - top)
    return np.einsum("hn,hnd->hd", e / denom, vh)


def swigluoai_ref(g: np.ndarray, u: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """GPT-OSS's expert activation in float64 (csrc/swigluoai.h): g clamped to <= limit, u to
    [-limit, limit]; (u + 1) * g * sigmoid(alpha * g)."""
    g64 = np.minimum(np.asarray(g, dtype=np.float64), float(limit))
    u64 = np.clip(np.asarray(u, dtype=np.float64), -float(limit), float(limit))
    return (u64 + 1.0) * g64 / (1.0 + np.exp(-float(alpha) * g64))


def biased_experts_ref(x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                       w_gate: "WeightRef", w_up: "WeightRef", w_down: "WeightRef",
                       b_gate: np.ndarray | None, b_up: np.ndarray | None,
                       b_down: np.ndarray | None, activation: str, alpha: float = 1.702,
                       limit: float = 7.0) -> np.ndarray:
    """Routed experts with biases and swigluoai or silu (BiasedExperts) in float64: x
    (T, D) -> float32 (T, D), y[t] = sum_k weights[t, k] * (W_down[e] @ act(W_gate[e] @ x[t]
    + b_gate[e], W_up[e] @ x[t] + b_up[e]) + b_down[e]), e = ids[t, k]."""
    x64 = np.asarray(x, dtype=np.float64)
    y = np.zeros(x64.shape, dtype=np.float64)

    def bias(b, e):
        return 0.0 if b is None else np.asarray(b[e], dtype=np.float64)
    for t in range(x64.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            Wg, Wu, Wd = (dequantize_ref(w, e).astype(np.float64) for w in (w_gate, w_up, w_down))
            g, u = Wg @ x64[t] + bias(b_gate, e), Wu @ x64[t] + bias(b_up, e)
            h = swigluoai_ref(g, u, alpha, limit) if activation == "swigluoai" else silu_ref(g) * u
            y[t] += float(weights[t, k]) * (Wd @ h + bias(b_down, e))
    return y.astype(np.float32)


def mla_absorbed_ref(q_nope: np.ndarray, q_rope: np.ndarray, kv_b: np.ndarray,
                     lat: np.ndarray, rot: np.ndarray, scale: float) -> np.ndarray:
    """float64 absorbed latent attention of one token (csrc/mla.h): q_nope (H, Dn), q_rope
    (H, Dr) rotated, kv_b (H*(Dn+Dv), Rkv) decoded, lat (n, Rkv) latents, rot (n, Dr)
    rotated keys -> (H*Dv,): per head q_lat = q_nope W_kb, p = softmax(scale * (q_lat lat^T
    + q_rope rot^T)), out = W_vb (p lat)."""
    q64, r64, lat64, rot64 = (np.asarray(a, dtype=np.float64) for a in (q_nope, q_rope, lat, rot))
    H, Dn = q64.shape
    w = np.asarray(kv_b, dtype=np.float64).reshape(H, -1, lat64.shape[1])   # (H, Dn+Dv, R)
    q_lat = np.einsum("hd,hdr->hr", q64, w[:, :Dn])
    s = (q_lat @ lat64.T + r64 @ rot64.T) * float(scale)                       # (H, n)
    s = np.exp(s - s.max(axis=1, keepdims=True))
    p = s / s.sum(axis=1, keepdims=True)
    return np.einsum("hvr,hr->hv", w[:, Dn:], p @ lat64).reshape(-1)


def rms_norm_rows_ref(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each row in float64: x (N, C), weight (C,) -> float32 (N, C),
    weight * x / sqrt(mean(x^2) + eps)."""
    x64 = np.asarray(x, dtype=np.float64)
    r = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + float(eps))
    return (np.asarray(weight, dtype=np.float64) * (x64 * r)).astype(np.float32)


def rope_rows_ref(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Half-split rotary embedding of rows in float64: x (N, Dh), cos / sin (h,) ->
    float32 (N, Dh); pairs (i, h + i) for i < h rotated, columns past 2h unchanged."""
    x64 = np.array(x, dtype=np.float64)
    h = len(cos)
    c, s = np.asarray(cos, dtype=np.float64), np.asarray(sin, dtype=np.float64)
    x1, x2 = x64[:, :h].copy(), x64[:, h:2 * h].copy()
    x64[:, :h], x64[:, h:2 * h] = x1 * c - x2 * s, x2 * c + x1 * s
    return x64.astype(np.float32)
