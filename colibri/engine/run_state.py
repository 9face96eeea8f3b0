"""RunState: the preallocated buffers of a decode step (llama2.c's RunState).

A decode step (one new token of one sequence, a cache without padding) writes every
per-layer vector into these buffers instead of allocating: the residual stream, the normed
inputs of attention and FFN, q | k | v of the token side by side (one fused projection
writes them), the attention heads' output. One RunState per KV cache (kept in
KVCache.run_state), so two caches decoding in two threads never share a buffer. The logits
are not here: each step returns its own array.

Shapes as in the package docstring; N = H*Dh + 2*Hkv*Dh.
"""
from __future__ import annotations

import numpy as np

__all__ = ["RunState"]


class RunState:
    """Buffers of one decode step, float32, reused from step to step.

    h (1, D) the residual stream (updated in place), xa / xf (1, D) the normed inputs of
    attention and FFN, o (1, D) the attention output, y (1, D) the FFN output; qkv (N,) with
    the views qkv_row (1, N), q_out (1, H*Dh), k_out / v_out (1, Hkv*Dh), q_heads (H, Dh),
    k_heads / v_heads (Hkv, Dh), qk_rows (H + Hkv, Dh) (the rows RoPE rotates); att_heads
    (H, Dh) / att_row (1, H*Dh) the attention over the cache (head h = kv_head * G + g, as
    attention.attend orders them). scale = Dh^-0.5 and eps as float32 scalars.
    key: the geometry it was made for (the model remakes it when that changes).
    """

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, eps: float):
        D, H, Hkv, Dh = hidden, n_heads, n_kv_heads, head_dim
        nq, nk = H * Dh, Hkv * Dh
        f32 = np.float32
        self.key = (D, H, Hkv, Dh, float(eps))
        self.eps = f32(eps)
        self.scale = f32(Dh ** -0.5)
        self.h = np.empty((1, D), f32)
        self.xa = np.empty((1, D), f32)
        self.xf = np.empty((1, D), f32)
        self.o = np.empty((1, D), f32)
        self.y = np.empty((1, D), f32)
        self.qkv = np.empty(nq + 2 * nk, f32)
        self.qkv_row = self.qkv.reshape(1, nq + 2 * nk)
        self.q_out = self.qkv[:nq].reshape(1, nq)
        self.k_out = self.qkv[nq:nq + nk].reshape(1, nk)
        self.v_out = self.qkv[nq + nk:].reshape(1, nk)
        self.q_heads = self.qkv[:nq].reshape(H, Dh)
        self.k_heads = self.qkv[nq:nq + nk].reshape(Hkv, Dh)
        self.v_heads = self.qkv[nq + nk:].reshape(Hkv, Dh)
        self.qk_rows = self.qkv[:nq + nk].reshape(H + Hkv, Dh)
        self.att_heads = np.empty((H, Dh), f32)
        self.att_row = self.att_heads.reshape(1, nq)
