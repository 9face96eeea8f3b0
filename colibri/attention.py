"""Self-attention in NumPy, float32: RMSNorm, RoPE, causal/padded/sliding masks, GQA.

The maths follows transformers' Llama-family code (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE):
  - RMSNorm: x * rsqrt(mean(x^2) + eps) * weight, in float32;
  - RoPE: the "half split" rotation (rotate_half), cos/sin = cat(freqs, freqs) with
    freqs = position * inv_freq, computed in float32 as transformers does;
  - q/k norm: OLMoE normalises the whole projection (H*Dh) before the head split ("full"),
    Qwen3 each head over Dh ("per_head"); OLMoE then clamps q, k, v to +-clip_qkv;
  - scores = (q @ k^T) * Dh^-0.5, masked, softmax in float32, @ v; kv heads shared by
    H / Hkv query heads (GQA) without materialising repeated K/V.
The projections are callables (x (N, C) -> (N, R)) supplied by the model, so this module knows
nothing about weight formats or kernels.

Decode fast path: Attention.decode runs one token of one sequence through a KV cache when no
slot is padding: no mask (a sliding window is a view of the last slots), q/k/v in one buffer,
RoPE in place and every intermediate in a DecodeWork preallocated once per cache. The
attention over the cache is the `attend_one` callable the model supplies (its compiled
kernel: within ~1e-6 of __call__'s NumPy maths, not bit for bit), or, without one, __call__'s
own operations on the same shapes (the same bits). The q/k norms and RoPE run as compiled row
operations when the model supplies them in the DecodeWork (NumPy's operations and summation
order in one call each: the same bits), else as the NumPy calls here.

Shape alphabet: B batch, T new tokens, L keys attended (cache length + T), D hidden,
H / Hkv heads, G = H / Hkv, Dh head dim, R rotary dims.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "rms_norm",
    "rms_norm_row",
    "Rope",
    "rope_inv_freq",
    "apply_rope",
    "build_mask",
    "attend",
    "Attention",
    "DecodeWork",
]

# Cap on the float32 score block (B * H * T_chunk * L) of one attention step; a long prefill is
# processed in query chunks so the scores never need more than this many bytes.
_SCORE_BYTES = 64 * 2**20


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float,
             out: np.ndarray | None = None) -> np.ndarray:
    """RMSNorm over the last axis: x (..., N) f32, weight (N,) f32 -> (..., N) f32.

    out: float32 array of x's shape to write into (may be x itself). The operations are those
    of weight * (x * (1 / sqrt(mean(x^2) + eps))) in float32, with fewer temporaries.
    """
    x = np.asarray(x, dtype=np.float32)
    var = np.add.reduce(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    # np.mean's division, exactly: by the count as an intp, into the float32 sum
    np.true_divide(var, np.intp(x.shape[-1]), out=var, casting="unsafe")
    np.add(var, np.float32(eps), out=var)
    np.sqrt(var, out=var)
    np.true_divide(np.float32(1.0), var, out=var)
    out = np.multiply(x, var, out=out)
    return np.multiply(weight, out, out=out)


def rms_norm_row(x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray,
                 tmp: np.ndarray) -> np.ndarray:
    """rms_norm of one contiguous row x (N,) (or (1, N)) into out, bit-identical to rms_norm.

    eps: np.float32; tmp: float32 scratch of x's shape. The statistics are numpy float32
    scalars (a float32 sum divided by N is the same float32 whether divided in float32 or,
    as np.mean does, in float64 and rounded: double rounding is innocuous for division).
    """
    np.square(x, out=tmp)
    inv = np.float32(1.0) / np.sqrt(np.add.reduce(tmp, axis=None) / x.shape[-1] + eps)
    np.multiply(x, inv, out=out)
    return np.multiply(weight, out, out=out)


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------

def _rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None,
                  partial_rotary_factor: float = 1.0,
                  max_position_embeddings: int | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies float32 (R/2,) and the cos/sin scale factor, as transformers computes them.

    Supported `scaling` types (the "rope_type"/"type" field of rope_scaling / rope_parameters):
    default, linear, llama3, yarn. Others raise NotImplementedError naming the type.
    """
    dim = int(head_dim * partial_rotary_factor)
    if dim % 2 or dim <= 0:
        raise ValueError(f"rotary dimension {dim} (head_dim {head_dim} x partial_rotary_factor "
                         f"{partial_rotary_factor}) must be a positive even number")
    kind = _rope_type(scaling)
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(theta), exponents, dtype=np.float32)   # theta^(2i/dim)
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_ff, high_ff = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low_ff, old_ctx / high_ff
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq)
        smooth = (np.float32(old_ctx) / wavelen - np.float32(low_ff)) / np.float32(high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(pos_freqs, dim, float(theta), scaling, max_position_embeddings)
    raise NotImplementedError(
        f"RoPE scaling type {kind!r} is not supported (supported: default, linear, llama3, yarn)")


def _yarn_inv_freq(pos_freqs: np.ndarray, dim: int, base: float, p: dict,
                   max_position_embeddings: int | None) -> tuple[np.ndarray, float]:
    """YaRN inverse frequencies and attention factor (transformers' _compute_yarn_parameters)."""
    original = p["original_max_position_embeddings"]
    factor = p.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    factor = float(factor)

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    extrapolation = 1 - ramp
    inv_extra = np.float32(1.0) / pos_freqs
    inv_inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


class Rope:
    """cos/sin tables for given positions; `Rope.from_arch(arch)` reads the §3 arch fields."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None,
                 partial_rotary_factor: float = 1.0, max_position_embeddings: int | None = None):
        self.head_dim = head_dim
        self.inv_freq, self.attention_factor = rope_inv_freq(
            head_dim, theta, scaling, partial_rotary_factor, max_position_embeddings)
        self.rot_dim = 2 * self.inv_freq.shape[0]                            # R

    @classmethod
    def from_arch(cls, arch: dict) -> "Rope":
        scaling = arch.get("rope_scaling")
        if _rope_type(scaling) == "default":
            scaling = None
        return cls(int(arch["head_dim"]), float(arch.get("rope_theta", 10000.0)), scaling,
                   float(arch.get("partial_rotary_factor") or 1.0),
                   arch.get("max_position_embeddings"))

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """positions int (B, T) -> cos, sin float32 (B, 1, T, R/2) (broadcast over heads)."""
        freqs = positions.astype(np.float32)[..., None] * self.inv_freq        # (B, T, R/2)
        cos, sin = np.cos(freqs), np.sin(freqs)
        if self.attention_factor != 1.0:
            cos = cos * np.float32(self.attention_factor)
            sin = sin * np.float32(self.attention_factor)
        return cos[:, None], sin[:, None]


    def cos_sin_one(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin float32 (R/2,) of one position: cos_sin's values (the same operations)."""
        freqs = np.float32(position) * self.inv_freq                           # (R/2,)
        cos, sin = np.cos(freqs), np.sin(freqs)
        if self.attention_factor != 1.0:
            cos = cos * np.float32(self.attention_factor)
            sin = sin * np.float32(self.attention_factor)
        return cos, sin


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate x float32 (B, H, T, Dh) by the half-split rule on its first R dims.

    out[:h] = x1*c - x2*s, out[h:R] = x2*c + x1*s with h = R/2 (rotate_half); dims past R pass.
    """
    h = cos.shape[-1]
    x1, x2 = x[..., :h], x[..., h:2 * h]
    out = np.empty_like(x)
    np.subtract(x1 * cos, x2 * sin, out=out[..., :h])
    np.add(x2 * cos, x1 * sin, out=out[..., h:2 * h])
    if 2 * h < x.shape[-1]:
        out[..., 2 * h:] = x[..., 2 * h:]
    return out


# ---------------------------------------------------------------------------------------------
# masks and the attention core
# ---------------------------------------------------------------------------------------------

def build_mask(valid: np.ndarray, n_new: int, window: int | None = None) -> np.ndarray:
    """bool (B, T, L): may query t (the t-th of the last T slots) attend to key slot j.

    valid bool (B, L): slots holding real tokens (False = padding). Causal by slot index; with a
    sliding window only the last `window` slots (the query's own included) are visible, the rule
    transformers uses (kv > q - window).
    """
    L = valid.shape[1]
    q_slot = np.arange(L - n_new, L)[:, None]                                 # (T, 1)
    kv_slot = np.arange(L)[None, :]                                           # (1, L)
    allowed = kv_slot <= q_slot
    if window:
        allowed = allowed & (kv_slot > q_slot - window)
    return allowed[None] & valid[:, None, :]


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
    """Scaled dot-product attention with GQA.

    q (B, H, T, Dh), k/v (B, Hkv, L, Dh) float32, mask bool (B, T, L) -> float32 (B, T, H*Dh).
    A query row with no visible key (left padding) gets zeros instead of NaN.
    """
    B, H, T, Dh = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = H // Hkv
    out = np.empty((B, Hkv, G, T, Dh), dtype=np.float32)
    qg = q.reshape(B, Hkv, G, T, Dh)
    kt = k.transpose(0, 1, 3, 2)[:, :, None]                                 # (B, Hkv, 1, Dh, L)
    vv = v[:, :, None]                                                        # (B, Hkv, 1, L, Dh)
    chunk = max(1, _SCORE_BYTES // max(1, B * H * L * 4))
    s32 = np.float32(scale)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        scores = np.matmul(qg[:, :, :, t0:t1], kt) * s32                      # (B, Hkv, G, t, L)
        m = mask[:, None, None, t0:t1]                                        # (B, 1, 1, t, L)
        scores = np.where(m, scores, np.float32(-np.inf))
        top = scores.max(axis=-1, keepdims=True)
        top = np.where(np.isfinite(top), top, np.float32(0.0))
        p = np.exp(scores - top)
        denom = p.sum(axis=-1, keepdims=True)
        p /= np.where(denom > 0, denom, np.float32(1.0))
        np.matmul(p, vv, out=out[:, :, :, t0:t1])
    # (B, Hkv, G, T, Dh) -> (B, T, H*Dh), head order h = kv_head * G + g as in repeat_kv
    return out.reshape(B, H, T, Dh).transpose(0, 2, 1, 3).reshape(B, T, H * Dh)


# ---------------------------------------------------------------------------------------------
# one attention layer
# ---------------------------------------------------------------------------------------------

Projection = Callable[[np.ndarray], np.ndarray]       # x (N, C) float32 -> (N, R) float32


@dataclass
class Attention:
    """Weights and settings of one layer's self-attention.

    wq/wk/wv/wo: projections (biases included by the callables); q_norm/k_norm: float32
    weights of shape (H*Dh,)/(Hkv*Dh,) for qk_norm "full" or (Dh,) for "per_head".
    wqkv: optionally the three input projections as one, x (N, C) -> [q | k | v] (N, H*Dh +
    2*Hkv*Dh), used instead of wq/wk/wv (one pass over x, one call); it must give the same
    values as the three.
    """
    wq: Projection
    wk: Projection
    wv: Projection
    wo: Projection
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float = 1e-6
    qk_norm: str = "none"                      # "none" | "full" | "per_head"
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    clip_qkv: float | None = None
    window: int | None = None                  # sliding window (slots), None = full attention
    wqkv: Projection | None = None
    # the decode fast path's attention over the cache, (q (H, Dh), k, v (Hkv, L, Dh), scale,
    # out (H, Dh)) -> out: supplied by the model (a compiled kernel); None: NumPy (_attend_one)
    attend_one: Callable[..., np.ndarray] | None = None

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"num_attention_heads {self.n_heads} is not a multiple of "
                             f"num_key_value_heads {self.n_kv_heads}")
        if self.qk_norm not in ("none", "full", "per_head"):
            raise ValueError(f"qk_norm must be 'none', 'full' or 'per_head', got {self.qk_norm!r}")
        if self.qk_norm != "none" and (self.q_norm is None or self.k_norm is None):
            raise ValueError(f"qk_norm {self.qk_norm!r} needs q_norm and k_norm weights")
        self.scale = self.head_dim ** -0.5

    def project_qkv(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x float32 (B, T, D) -> q (B, H, T, Dh), k, v (B, Hkv, T, Dh), before RoPE."""
        B, T, D = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        flat = x.reshape(B * T, D)
        if self.wqkv is not None:
            qkv = self.wqkv(flat)                                             # (B*T, N)
            nq, nk = H * Dh, Hkv * Dh
            q, k, v = qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]
        else:
            q, k, v = self.wq(flat), self.wk(flat), self.wv(flat)             # (B*T, H*Dh) ...
        if self.qk_norm == "full":                 # OLMoE: over the whole projection
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        if self.clip_qkv is not None:
            c = np.float32(self.clip_qkv)
            q, k, v = np.clip(q, -c, c), np.clip(k, -c, c), np.clip(v, -c, c)
        q = q.reshape(B, T, H, Dh)
        k = k.reshape(B, T, Hkv, Dh)
        if self.qk_norm == "per_head":             # Qwen3: each head over Dh
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        v = v.reshape(B, T, Hkv, Dh)
        return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def __call__(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mask: np.ndarray,
                 cache=None, layer: int = 0) -> np.ndarray:
        """x float32 (B, T, D) -> float32 (B, T, D).

        cos/sin from Rope.cos_sin for the T new positions; mask bool (B, T, L) from build_mask;
        cache: a KVCache (keys/values of the new tokens are written at its current length and
        everything up to it is attended) or None (attend to the T new tokens only).
        """
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write(layer, k, v)                                   # (B, Hkv, L, Dh)
        o = attend(q, k, v, mask, self.scale)                                 # (B, T, H*Dh)
        return self.wo(o.reshape(B * T, -1)).reshape(B, T, -1)

    # -- the decode fast path ------------------------------------------------------------------
    def decode(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, cache, layer: int,
               w: "DecodeWork") -> np.ndarray:
        """One new token of one sequence through a KV cache, nothing masked: float32 (1, D).

        The fast path of __call__ for B = T = 1 when every cached slot holds a real token (no
        padding): no mask is built (a sliding window is a view of the last `window` slots) and
        every intermediate lives in the preallocated buffers of `w` (DecodeWork). x float32
        (1, D); cos/sin float32 (R/2,) of the token's position (Rope.cos_sin(pos)[0, 0, 0]); the
        key and value go to slot cache.length. The result is w.o, valid until the next call.

        With attend_one (the model's compiled kernel) the attention over the cache sums in
        its own order: within ~1e-6 relative of __call__. Without it the operations are
        __call__'s, on the same shapes (one matmul per query head), so the result is
        bit-identical to it, except with a sliding window shorter than the context: there
        the hidden slots are left out instead of masked to exp(-inf) = 0, which changes the
        order of the softmax and value sums (rounding, ~1e-7 relative). (A score that
        overflows to inf makes its head NaN in both paths; the masked path's guard of the max
        only matters for fully masked rows, which this path never has.)
        """
        if self.wqkv is not None and w.proj_out:
            self.wqkv(x, out=w.qkv_row)
        elif w.proj_out:                                  # kernels.linear-style: write in place
            self.wq(x, out=w.q_out)
            self.wk(x, out=w.k_out)
            self.wv(x, out=w.v_out)
        elif self.wqkv is not None:
            w.qkv_row[...] = self.wqkv(x)
        else:
            w.q_out[...] = self.wq(x)
            w.k_out[...] = self.wk(x)
            w.v_out[...] = self.wv(x)
        norm_rows = w.norm_rows
        if self.qk_norm == "full":                        # OLMoE: over the whole projection
            if norm_rows is not None:
                norm_rows(w.q_out, self.q_norm, w.eps, w.q_out)
                norm_rows(w.k_out, self.k_norm, w.eps, w.k_out)
            else:
                rms_norm_row(w.q_out, self.q_norm, w.eps, w.q_out, w.tmp_q)
                rms_norm_row(w.k_out, self.k_norm, w.eps, w.k_out, w.tmp_k)
        if self.clip_qkv is not None:
            c = np.float32(self.clip_qkv)
            np.clip(w.qkv, -c, c, out=w.qkv)
        if self.qk_norm == "per_head":                    # Qwen3: each head over Dh
            if norm_rows is not None:
                norm_rows(w.q_heads, self.q_norm, w.eps, w.q_heads)
                norm_rows(w.k_heads, self.k_norm, w.eps, w.k_heads)
            else:
                _rms_norm_rows(w.q_heads, self.q_norm, w.eps, w.tmp_q_heads, w.var_q)
                _rms_norm_rows(w.k_heads, self.k_norm, w.eps, w.tmp_k_heads, w.var_k)
        # RoPE on the q and k heads at once, in place (apply_rope's operations)
        if w.rope_rows is not None:
            w.rope_rows(w.qk_rows, cos, sin)
        else:
            _rope_numpy(w, cos, sin)
        n = cache.length + 1                              # slots attended, the new one included
        start = n - self.window if self.window and n > self.window else 0
        if self.attend_one is not None and w.attend_cached is not None:
            # the cache write and the kernel of attend_one in one call
            w.attend_cached(w.q_heads, cache.k[layer], cache.v[layer], w.k_heads, w.v_heads,
                            n - 1, start, w.scale, w.att_heads)
        else:
            k, v = cache.write_one(layer, w.k_heads, w.v_heads, start)     # (Hkv, L, Dh)
            if self.attend_one is not None:               # one call, the cache read in place
                self.attend_one(w.q_heads, k, v, w.scale, out=w.att_heads)  # (H, Dh)
            else:
                _attend_one(w, k, v, n - start)
        if w.proj_out:
            return self.wo(w.att_row, out=w.o)
        w.o[...] = self.wo(w.att_row)
        return w.o


def _rope_numpy(w: "DecodeWork", cos: np.ndarray, sin: np.ndarray) -> None:
    """RoPE of the q and k heads of w.qkv in place, apply_rope's operations in NumPy."""
    x1, x2, ta, tb, tc = w.x1, w.x2, w.ta, w.tb, w.tc
    np.multiply(x1, cos, out=ta)
    np.multiply(x2, sin, out=tb)
    np.multiply(x1, sin, out=tc)
    np.multiply(x2, cos, out=x2)
    np.add(x2, tc, out=x2)                            # x2*cos + x1*sin
    np.subtract(ta, tb, out=x1)                       # x1*cos - x2*sin


def _attend_one(w: "DecodeWork", k: np.ndarray, v: np.ndarray, n: int) -> None:
    """w.att = softmax(scale * q k^T) v for the token's query heads (w.q_groups) over n
    cached keys / values k, v (Hkv, n, Dh), in NumPy (__call__'s operations, no mask)."""
    s = w.scores(n)                                                     # (Hkv, G, 1, n)
    np.matmul(w.q_groups, k[:, None].swapaxes(2, 3), out=s)
    np.multiply(s, w.scale, out=s)
    np.maximum.reduce(s, axis=-1, keepdims=True, out=w.top)
    np.subtract(s, w.top, out=s)
    np.exp(s, out=s)
    np.add.reduce(s, axis=-1, keepdims=True, out=w.denom)
    np.true_divide(s, w.denom, out=s)
    np.matmul(s, v[:, None], out=w.att)                                 # (Hkv, G, 1, Dh)


def _rms_norm_rows(x: np.ndarray, weight: np.ndarray, eps: np.float32, sq: np.ndarray,
                   var: np.ndarray) -> None:
    """rms_norm(x, weight, eps, out=x) (same operations) with scratch sq (x's shape) and
    var (..., 1) instead of temporaries."""
    np.square(x, out=sq)
    np.add.reduce(sq, axis=-1, keepdims=True, dtype=np.float32, out=var)
    np.true_divide(var, np.intp(x.shape[-1]), out=var, casting="unsafe")
    np.add(var, eps, out=var)
    np.sqrt(var, out=var)
    np.true_divide(np.float32(1.0), var, out=var)
    np.multiply(x, var, out=x)
    np.multiply(weight, x, out=x)


class DecodeWork:
    """Preallocated buffers of the decode fast path (Attention.decode), shared by the layers.

    One set per KV cache (KVCache.scratch), so two caches decoding in two threads never share
    a buffer. Besides attention's, it holds the model's per-layer vectors: the normed inputs
    of attention and FFN (xa, xf), the FFN output (y) and a norm scratch (tmp).
    norm_rows / rope_rows: optional compiled row operations, supplied by the model (the
    kernels' rms_norm_rows_into (x (N, C), weight (C,), eps, out) and rope_rows_into (x (N, Dh),
    cos, sin), NumPy's operations in one call each); None: the NumPy code here.
    attend_cached: optionally KVCache.write_one and the layer's attend_one in one call
    (q, k_cache, v_cache, k_new, v_new, slot, start, scale, out), used with attend_one only.
    Shape alphabet as in the module docstring; N = H*Dh + 2*Hkv*Dh.
    """

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 rot_half: int, ctx: int, eps: float, proj_out: bool,
                 norm_rows: Callable[..., None] | None = None,
                 rope_rows: Callable[..., None] | None = None,
                 attend_cached: Callable[..., None] | None = None):
        D, H, Hkv, Dh, h = hidden, n_heads, n_kv_heads, head_dim, rot_half
        G, nq, nk = H // Hkv, H * Dh, Hkv * Dh
        f32 = np.float32
        self.key = (D, H, Hkv, Dh, h, float(eps), bool(proj_out), norm_rows, rope_rows,
                    attend_cached)
        self.norm_rows, self.rope_rows, self.attend_cached = norm_rows, rope_rows, attend_cached
        self.eps = f32(eps)
        self.scale = f32(Dh ** -0.5)
        self.proj_out = proj_out
        self.h = np.empty((1, D), f32)                # the residual stream (Model._decode_step)
        self.xa = np.empty((1, D), f32)               # attention input (normed)
        self.xf = np.empty((1, D), f32)               # FFN input (normed)
        self.y = np.empty((1, D), f32)                # FFN output
        self.o = np.empty((1, D), f32)                # attention output
        self.tmp = np.empty((1, D), f32)              # norm scratch
        self.qkv = np.empty(nq + 2 * nk, f32)         # q | k | v of the new token
        self.qkv_row = self.qkv.reshape(1, nq + 2 * nk)
        self.q_out = self.qkv[:nq].reshape(1, nq)
        self.k_out = self.qkv[nq:nq + nk].reshape(1, nk)
        self.v_out = self.qkv[nq + nk:].reshape(1, nk)
        self.tmp_q = np.empty((1, nq), f32)
        self.tmp_k = np.empty((1, nk), f32)
        self.tmp_q_heads, self.tmp_k_heads = self.tmp_q.reshape(H, Dh), self.tmp_k.reshape(Hkv, Dh)
        self.var_q, self.var_k = np.empty((H, 1), f32), np.empty((Hkv, 1), f32)
        self.q_heads = self.qkv[:nq].reshape(H, Dh)
        self.k_heads = self.qkv[nq:nq + nk].reshape(Hkv, Dh)
        self.v_heads = self.qkv[nq + nk:].reshape(Hkv, Dh)
        self.q_groups = self.qkv[:nq].reshape(Hkv, G, 1, Dh)
        self.qk_rows = self.qkv[:nq + nk].reshape(H + Hkv, Dh)   # the rows RoPE rotates
        self.x1, self.x2 = self.qk_rows[:, :h], self.qk_rows[:, h:2 * h]
        self.ta, self.tb, self.tc = (np.empty((H + Hkv, h), f32) for _ in range(3))
        self._scores = np.empty(H * ctx, f32)
        self._n, self._s = -1, None
        self.top = np.empty((Hkv, G, 1, 1), f32)
        self.denom = np.empty((Hkv, G, 1, 1), f32)
        self.att = np.empty((Hkv, G, 1, Dh), f32)       # head h = kv_head * G + g, as attend
        self.att_row = self.att.reshape(1, nq)
        self.att_heads = self.att.reshape(H, Dh)

    def scores(self, n: int) -> np.ndarray:
        """A contiguous (Hkv, G, 1, n) view of the score buffer (kept while n stays the same)."""
        if n != self._n:
            Hkv, G = self.top.shape[:2]
            self._s = self._scores[:Hkv * G * n].reshape(Hkv, G, 1, n)
            self._n = n
        return self._s
