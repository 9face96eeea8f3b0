"""Self-attention in NumPy, float32: causal/padded/sliding masks, GQA, one attention layer.

The maths follows transformers' Llama-family code (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE):
  - q/k norm: OLMoE normalises the whole projection (H*Dh) before the head split ("full"),
    Qwen3 each head over Dh ("per_head"); OLMoE then clamps q, k, v to +-clip_qkv;
  - RoPE on q and k (colibri.engine.rope);
  - scores = (q @ k^T) * Dh^-0.5, masked, softmax in float32, @ v; kv heads shared by
    G = H / Hkv query heads (GQA) without materialising repeated K/V.
The projections are callables supplied by the model (x (N, C) -> (N, R), or written into
out (N, R)), so this module knows nothing about weight formats.

Three ways through a layer: Attention.__call__, the general path (any B and S, padding,
masks, with or without a KV cache); Attention.forward_segments, the ragged step of continuous
batching (several sequences of different lengths, each through its own cache: the
projections over all their rows at once, RoPE, the cache write and the attention per
Segment, a one-token segment through the decode step's compiled call); and
Attention.decode, one new token of one sequence through a cache with no padding: no mask (a sliding window is the last slots), every vector in the
step's RunState, norms and RoPE as compiled row operations (the same bits as the NumPy
ones here), the cache write and the attention over the cache in one compiled call
(kernels.attend_cached_into, or attend_cached_sinks_into with GPT-OSS's sinks: its own
summation order, within ~1e-6 of attend).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .. import kernels
from ..config import QK_NORMS
from .norms import rms_norm
from .rope import apply_rope
from .run_state import RunState

__all__ = ["build_mask", "attend", "Attention", "Segment"]

# Cap on the float32 score block (B * H * S_chunk * L) of one attention step; a long prefill
# is processed in query chunks so the scores never need more than this many bytes.
_SCORE_BYTES = 64 * 2**20

_norm_rows = kernels.rms_norm_rows_into        # (x (N, C), weight (C,), eps, out (N, C))
_rope_rows = kernels.rope_rows_into            # (x (N, Dh), cos, sin (Dr/2,)), in place
_attend_cached = kernels.attend_cached_into    # cache write + attention, see Attention.decode
_attend_cached_sinks = kernels.attend_cached_sinks_into      # ... with attention sinks


# ---------------------------------------------------------------------------------------------
# masks and the attention core
# ---------------------------------------------------------------------------------------------

def build_mask(valid: np.ndarray, n_new: int, window: int | None = None) -> np.ndarray:
    """bool (B, S, L): may query s (the s-th of the last S slots) attend to key slot j.

    valid bool (B, L): slots holding real tokens (False = padding). Causal by slot index; with a
    sliding window only the last `window` slots (the query's own included) are visible, the rule
    transformers uses (kv > q - window).
    """
    L = valid.shape[1]
    q_slot = np.arange(L - n_new, L)[:, None]                                 # (S, 1)
    kv_slot = np.arange(L)[None, :]                                           # (1, L)
    allowed = kv_slot <= q_slot
    if window:
        allowed = allowed & (kv_slot > q_slot - window)
    return allowed[None] & valid[:, None, :]


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float,
           sinks: np.ndarray | None = None) -> np.ndarray:
    """Scaled dot-product attention with GQA.

    q (B, H, S, Dh), k (B, Hkv, L, Dh), v (B, Hkv, L, Dv) float32 (Dv = Dh but for MLA),
    mask bool (B, S, L) -> float32 (B, S, H*Dv).
    A query row with no visible key (left padding) gets zeros instead of NaN.
    sinks: float32 (H,) or None; a head's sink is one more logit in its softmax whose value
    row is zero (GPT-OSS): it takes probability mass without adding to the output.
    """
    B, H, S, Dq = q.shape
    Hkv, L, Dh = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv
    out = np.empty((B, Hkv, G, S, Dh), dtype=np.float32)
    qg = q.reshape(B, Hkv, G, S, Dq)
    kt = k.transpose(0, 1, 3, 2)[:, :, None]                                 # (B, Hkv, 1, Dh, L)
    vv = v[:, :, None]                                                        # (B, Hkv, 1, L, Dh)
    chunk = max(1, _SCORE_BYTES // max(1, B * H * L * 4))
    s32 = np.float32(scale)
    sink = None if sinks is None else sinks.astype(np.float32).reshape(1, Hkv, G, 1, 1)
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        scores = np.matmul(qg[:, :, :, s0:s1], kt) * s32                      # (B, Hkv, G, s, L)
        m = mask[:, None, None, s0:s1]                                        # (B, 1, 1, s, L)
        scores = np.where(m, scores, np.float32(-np.inf))
        top = scores.max(axis=-1, keepdims=True)
        if sink is not None:
            top = np.maximum(top, sink)
        top = np.where(np.isfinite(top), top, np.float32(0.0))
        p = np.exp(scores - top)
        denom = p.sum(axis=-1, keepdims=True)
        if sink is not None:
            denom = denom + np.exp(sink - top)
        p /= np.where(denom > 0, denom, np.float32(1.0))
        np.matmul(p, vv, out=out[:, :, :, s0:s1])
    # (B, Hkv, G, S, Dh) -> (B, S, H*Dh), head order h = kv_head * G + g as in repeat_kv
    return out.reshape(B, H, S, Dh).transpose(0, 2, 1, 3).reshape(B, S, H * Dh)


# ---------------------------------------------------------------------------------------------
# one sequence's rows in a ragged step
# ---------------------------------------------------------------------------------------------

@dataclass
class Segment:
    """S consecutive rows [start, start + S) of a ragged step: new tokens of one sequence,
    written to and attending over its own cache (a KVCache of batch 1).

    positions int64 (S,): their RoPE positions; cos/sin: float32 (Dr/2,) of the one position
    when decode (S = 1 and no padding in the cache: the compiled attention call), else
    Rope.cos_sin's (1, 1, S, Dr/2); masks: build_mask per sliding window, made on first use.
    row_tables: for a short segment over a cache with no padding (speculative decoding's
    verification, a short prompt chunk), [(cos, sin) (Dr/2,)] per row: Attention runs its
    rows one after another through the decode step's compiled attention (the same bits as
    feeding them one by one), None otherwise.
    """
    cache: object
    start: int
    n: int
    positions: np.ndarray
    decode: bool
    cos: np.ndarray
    sin: np.ndarray
    masks: dict = field(default_factory=dict)
    row_tables: list | None = None

    def mask(self, window: int | None) -> np.ndarray:
        """bool (1, S, L) for the cache's slots plus the S new ones."""
        if window not in self.masks:
            c = self.cache
            valid = np.concatenate([c.valid[:, :c.length], np.ones((1, self.n), bool)], axis=1)
            self.masks[window] = build_mask(valid, self.n, window)
        return self.masks[window]


# ---------------------------------------------------------------------------------------------
# one attention layer
# ---------------------------------------------------------------------------------------------

# x (N, C) float32 -> (N, R) float32; called as p(x, out) it writes into out (N, R) instead
Projection = Callable[..., np.ndarray]


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
    qk_norm: str = "none"                      # one of config.QK_NORMS
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    clip_qkv: float | None = None
    window: int | None = None                  # sliding window (slots), None = full attention
    wqkv: Projection | None = None
    threads: int = 1                           # of the compiled attention in decode
    scale: float | None = None                 # of q . k; None: head_dim^-0.5
    sinks: np.ndarray | None = None            # float32 (H,): attention sinks (GPT-OSS)

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"num_attention_heads {self.n_heads} is not a multiple of "
                             f"num_key_value_heads {self.n_kv_heads}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {', '.join(QK_NORMS)}, got {self.qk_norm!r}")
        if self.qk_norm != "none" and (self.q_norm is None or self.k_norm is None):
            raise ValueError(f"qk_norm {self.qk_norm!r} needs q_norm and k_norm weights")
        if self.scale is None:
            self.scale = self.head_dim ** -0.5
        self._scale32 = np.float32(self.scale)      # the decode step's (the same value)
        self._sinks32 = (None if self.sinks is None
                         else np.ascontiguousarray(self.sinks, dtype=np.float32))

    def project_qkv(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x float32 (B, S, D) -> q (B, H, S, Dh), k, v (B, Hkv, S, Dh), before RoPE."""
        B, S, D = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        flat = x.reshape(B * S, D)
        if self.wqkv is not None:
            qkv = self.wqkv(flat)                                             # (T, N)
            nq, nk = H * Dh, Hkv * Dh
            q, k, v = qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]
        else:
            q, k, v = self.wq(flat), self.wk(flat), self.wv(flat)             # (T, H*Dh) ...
        if self.qk_norm == "full":                 # OLMoE: over the whole projection
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        if self.clip_qkv is not None:
            c = np.float32(self.clip_qkv)
            q, k, v = np.clip(q, -c, c), np.clip(k, -c, c), np.clip(v, -c, c)
        q = q.reshape(B, S, H, Dh)
        k = k.reshape(B, S, Hkv, Dh)
        if self.qk_norm == "per_head":             # Qwen3: each head over Dh
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        v = v.reshape(B, S, Hkv, Dh)
        return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def __call__(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mask: np.ndarray,
                 cache=None, layer: int = 0) -> np.ndarray:
        """x float32 (B, S, D) -> float32 (B, S, D).

        cos/sin from Rope.cos_sin for the S new positions; mask bool (B, S, L) from build_mask;
        cache: a KVCache (keys/values of the new tokens are written at its current length and
        everything up to it is attended) or None (attend to the S new tokens only).
        """
        B, S, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write(layer, k, v)                                   # (B, Hkv, L, Dh)
        o = attend(q, k, v, mask, self.scale, self.sinks)                     # (B, S, H*Dh)
        return self.wo(o.reshape(B * S, -1)).reshape(B, S, -1)

    # -- several sequences, each through its own cache ------------------------------------------
    def forward_segments(self, x: np.ndarray, segments: list[Segment], layer: int
                         ) -> np.ndarray:
        """The ragged step: x float32 (T, D), the rows of all segments -> float32 (T, D).

        q/k/v and the output projection run over all T rows in one call each; RoPE, the
        cache write (at each cache's length, committed by the caller) and the attention run
        per segment: a decode segment as Attention.decode does it (compiled, the same bits),
        any other as __call__ does (NumPy over its mask). Row for row the values of running
        each segment alone through __call__ / decode, up to the projections' summation
        order (kernels.linear's GEMM path from gemm_min_tokens rows on).
        """
        H, Dh = self.n_heads, self.head_dim
        q, k, v = self.project_qkv(x[None])          # (1, H, T, Dh), (1, Hkv, T, Dh) x 2
        o = np.empty((x.shape[0], H * Dh), dtype=np.float32)                  # (T, H*Dh)
        for seg in segments:
            a, b = seg.start, seg.start + seg.n
            cache = seg.cache
            if seg.decode:
                qk = np.concatenate([q[0, :, a], k[0, :, a]])                 # (H + Hkv, Dh)
                _rope_rows(qk, seg.cos, seg.sin)
                vh = np.ascontiguousarray(v[0, :, a])                         # (Hkv, Dh)
                slot = cache.length
                start = slot + 1 - self.window if self.window and slot >= self.window else 0
                self._attend_one(qk[:H], cache, layer, qk[H:], vh, slot, start,
                                 o[a].reshape(H, Dh))
                continue
            if seg.row_tables is not None:       # row by row, each as a decode step
                for j, (cos, sin) in enumerate(seg.row_tables):
                    r = a + j
                    qk = np.concatenate([q[0, :, r], k[0, :, r]])             # (H + Hkv, Dh)
                    _rope_rows(qk, cos, sin)
                    slot = cache.length + j
                    start = slot + 1 - self.window if self.window and slot >= self.window else 0
                    self._attend_one(qk[:H], cache, layer, qk[H:],
                                     np.ascontiguousarray(v[0, :, r]), slot, start,
                                     o[r].reshape(H, Dh))
                continue
            qs = apply_rope(q[:, :, a:b], seg.cos, seg.sin)
            ks = apply_rope(k[:, :, a:b], seg.cos, seg.sin)
            kk, vv = cache.write(layer, ks, v[:, :, a:b])                     # (1, Hkv, L, Dh)
            o[a:b] = attend(qs, kk, vv, seg.mask(self.window), self.scale, self.sinks)[0]
        return self.wo(o)

    # -- one token of one sequence -------------------------------------------------------------
    def decode(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, cache, layer: int,
               s: RunState) -> np.ndarray:
        """__call__ for B = S = 1 through a KV cache none of whose slots is padding:
        float32 (1, D), the buffer s.o (valid until the next call).

        x float32 (1, D); cos/sin float32 (Dr/2,) of the token's position
        (Rope.cos_sin_one); the key and value go to slot cache.length of `layer`. No mask is
        built: a sliding window attends to the last `window` slots. The projections write
        into s's buffers, the q/k norms and RoPE are the compiled row operations (NumPy's
        arithmetic, the same bits as __call__'s), and the cache write and the attention
        are one compiled call, which sums in its own order: within ~1e-6 relative of
        __call__ (a score that overflows to inf makes its head NaN on both paths).
        """
        if self.wqkv is not None:
            self.wqkv(x, s.qkv_row)
        else:
            self.wq(x, s.q_out)
            self.wk(x, s.k_out)
            self.wv(x, s.v_out)
        if self.qk_norm == "full":                        # OLMoE: over the whole projection
            _norm_rows(s.q_out, self.q_norm, s.eps, s.q_out)
            _norm_rows(s.k_out, self.k_norm, s.eps, s.k_out)
        if self.clip_qkv is not None:
            c = np.float32(self.clip_qkv)
            np.clip(s.qkv, -c, c, out=s.qkv)
        if self.qk_norm == "per_head":                    # Qwen3: each head over Dh
            _norm_rows(s.q_heads, self.q_norm, s.eps, s.q_heads)
            _norm_rows(s.k_heads, self.k_norm, s.eps, s.k_heads)
        _rope_rows(s.qk_rows, cos, sin)                   # the q and k heads, in place
        slot = cache.length                               # the new token's; L = slot + 1
        start = slot + 1 - self.window if self.window and slot >= self.window else 0
        self._attend_one(s.q_heads, cache, layer, s.k_heads, s.v_heads, slot, start,
                         s.att_heads)
        self.wo(s.att_row, s.o)
        return s.o

    def _attend_one(self, q_heads: np.ndarray, cache, layer: int, k_new: np.ndarray,
                    v_new: np.ndarray, slot: int, start: int, out: np.ndarray) -> None:
        """The compiled cache write and attention of one token: q_heads (H, Dh) after RoPE,
        k_new / v_new (Hkv, Dh) to slot `slot`, slots start..slot attended, into out (H, Dh);
        with the layer's sinks (GPT-OSS) in the same call (kernels.attend_cached_sinks_into:
        a sink is one more softmax logit per head whose value row is zero)."""
        if self.sinks is None:
            _attend_cached(q_heads, cache.k[layer], cache.v[layer], k_new, v_new, slot, start,
                           self._scale32, out, self.threads)
        else:
            _attend_cached_sinks(q_heads, cache.k[layer], cache.v[layer], k_new, v_new, slot,
                                 start, self._scale32, self._sinks32, out, self.threads)
