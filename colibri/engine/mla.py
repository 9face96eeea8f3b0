"""Multi-head latent attention (DeepSeek-V2 / V3), NumPy float32: one layer, two paths.

The maths follows transformers' DeepseekV2Attention / DeepseekV3Attention:
  - q = q_b(RMSNorm(q_a(x))) with a q LoRA (q_lora_rank), else q = q_proj(x): (H, Dn + Dr)
    per token, split into q_nope (Dn) and q_rope (Dr);
  - kv_a(x) = [c | k_rope]: the latent c (Rkv) is RMSNormed, the rotary key k_rope (Dr) is
    one head shared by all H heads; both RMSNorms of the attention use eps 1e-6 (the
    module default transformers keeps, not rms_norm_eps);
  - RoPE on q_rope and k_rope only. DeepSeek rotates interleaved pairs (x0, x1), (x2, x3),
    ...; the converter stores those rows de-interleaved (evens, then odds:
    families/deepseek.py) so the half-split
    rotation of colibri.engine.rope applies: q·k is the same sum over the same pairs;
  - kv_b(c) = [k_nope (Dn) | v (Dv)] per head; key = [k_nope | k_rope];
  - scores = q · key * scale, scale = (Dn + Dr)^-0.5, times mscale(factor, mscale_all_dim)^2
    under YaRN (softmax_scale), masked softmax, @ v, o_proj.

The KV cache stores what kv_a gives, not per-head keys and values: per layer one "head"
whose key plane holds c (Rkv) and whose value plane holds the rotated k_rope (Dr)
(kv_cache.KVCache with head_dim Rkv, value_dim Dr).

MLA.__call__, the general path (any B and S, masks), expands every cached latent through
kv_b into per-head keys and values, as transformers does. MLA.decode, one token of one
sequence through a cache without padding, never expands the cache: kv_b is absorbed into
the query and the output (q_nope · W_kb[h] is a query in latent space, the attention-weighted
latent times W_vb[h] the head's output), so a step costs O(L · H · (Rkv + Dr)) instead of
O(L · H · Rkv · (Dn + Dv)); the same sums in another order (within ~1e-6 of __call__). That
step is one compiled call (kernels.prepare_mla_absorbed, csrc/mla.h): the cache write, the
absorbed query, the latent attention over the cache and the W_vb products, on kv_b's own
bytes in the file's format (decoded exactly, f32 activations), threads over the heads; its
NumPy form is _reference.mla_absorbed_ref.
Shapes as in the package docstring, plus Rq / Rkv (q / kv LoRA ranks), Dn / Dr / Dv
(per-head key dims without / with RoPE, value dims).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .. import kernels
from ..config import ModelConfig
from ..kernels.weights import WeightRef
from .attention import Projection, attend
from .norms import rms_norm
from .rope import apply_rope
from .run_state import RunState

__all__ = ["MLA", "softmax_scale", "LATENT_NORM_EPS"]

# eps of q_a_layernorm and kv_a_layernorm: transformers builds them without the config's eps
LATENT_NORM_EPS = 1e-6

_rope_rows = kernels.rope_rows_into            # (x (N, Dr), cos, sin (Dr/2,)), in place


def softmax_scale(config: ModelConfig) -> float:
    """(Dn + Dr)^-0.5, times mscale^2 when a non-default RoPE scaling gives mscale_all_dim
    (mscale = 0.1 * mscale_all_dim * ln(factor) + 1 for factor > 1), as transformers'
    yarn_apply_mscale."""
    scale = config.qk_head_dim ** -0.5
    p: Mapping[str, Any] = config.rope_scaling or {}
    if p.get("rope_type", "default") != "default" and p.get("mscale_all_dim"):
        factor = float(p["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(p["mscale_all_dim"]) * math.log(factor) + 1.0
        scale = scale * m * m
    return scale


@dataclass
class MLA:
    """Weights and settings of one layer's latent attention.

    wq (H*(Dn+Dr), D), or wq_a (Rq, D) + q_a_norm (Rq,) + wq_b (H*(Dn+Dr), Rq); wkv_a
    (Rkv+Dr, D); kv_a_norm (Rkv,); wkv_b (H*(Dn+Dv), Rkv); wo (D, H*Dv): projections as
    attention.Attention's (x (N, C) -> (N, R), or into out). kv_b: the kv_b matrix as a
    WeightRef (the file's bytes, any format), which decode absorbs in the compiled step.
    """
    wq: Projection | None
    wq_a: Projection | None
    q_a_norm: np.ndarray | None
    wq_b: Projection | None
    wkv_a: Projection
    kv_a_norm: np.ndarray
    wkv_b: Projection
    wo: Projection
    kv_b: WeightRef
    n_heads: int
    nope_dim: int                      # Dn
    rope_dim: int                      # Dr
    v_dim: int                         # Dv
    kv_rank: int                       # Rkv
    scale: float
    threads: int = 1                   # of the compiled absorbed step
    window: int | None = None          # never set: MLA attends to every slot

    def __post_init__(self):
        if (self.wq is None) == (self.wq_b is None):
            raise ValueError("MLA needs either wq or wq_a + q_a_norm + wq_b")
        H, Dn, Dv, R = self.n_heads, self.nope_dim, self.v_dim, self.kv_rank
        if not isinstance(self.kv_b, WeightRef) or self.kv_b.shape != (H * (Dn + Dv), R):
            raise ValueError(f"kv_b must be a WeightRef of shape {(H * (Dn + Dv), R)}, found "
                             f"{getattr(self.kv_b, 'shape', type(self.kv_b).__name__)}")
        self._absorb = kernels.prepare_mla_absorbed(self.kv_b, H, Dn, Dv, threads=self.threads)
        self._scale = np.float32(self.scale)

    # -- the projections both paths share ------------------------------------------------------
    def _query(self, flat: np.ndarray) -> np.ndarray:
        """x float32 (T, D) -> q (T, H*(Dn+Dr)), before RoPE."""
        if self.wq is not None:
            return self.wq(flat)
        a = rms_norm(self.wq_a(flat), self.q_a_norm, LATENT_NORM_EPS)
        return self.wq_b(np.ascontiguousarray(a))

    def _latent(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x float32 (T, D) -> normed latent c (T, Rkv), k_rope (T, Dr) before RoPE."""
        ckv = self.wkv_a(flat)                                         # (T, Rkv + Dr)
        c = rms_norm(ckv[:, :self.kv_rank], self.kv_a_norm, LATENT_NORM_EPS)
        return c, ckv[:, self.kv_rank:]

    # -- the general path ----------------------------------------------------------------------
    def __call__(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mask: np.ndarray,
                 cache=None, layer: int = 0) -> np.ndarray:
        """x float32 (B, S, D) -> float32 (B, S, D), as attention.Attention.__call__.

        cos/sin from Rope.cos_sin (Dr/2 wide); mask bool (B, S, L); cache: a KVCache made
        for this model (latents and rotary keys of the new tokens written at its length) or
        None.
        """
        B, S, D = x.shape
        H, Dn, Dr, Dv, R = self.n_heads, self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank
        flat = x.reshape(B * S, D)
        q = self._query(flat).reshape(B, S, H, Dn + Dr).transpose(0, 2, 1, 3)   # (B, H, S, .)
        c, k_rope = self._latent(flat)
        c = c.reshape(B, 1, S, R)
        k_rope = apply_rope(k_rope.reshape(B, 1, S, Dr), cos, sin)           # (B, 1, S, Dr)
        q = np.concatenate([q[..., :Dn], apply_rope(q[..., Dn:], cos, sin)], axis=-1)
        if cache is not None:
            c, k_rope = cache.write(layer, c, k_rope)                      # (B, 1, L, .)
        o = self._expanded(q, c, k_rope, mask)                              # (B, S, H*Dv)
        return self.wo(o.reshape(B * S, H * Dv)).reshape(B, S, D)

    def _expanded(self, q: np.ndarray, c: np.ndarray, k_rope: np.ndarray, mask: np.ndarray
                  ) -> np.ndarray:
        """Attention with the latents expanded through kv_b: q (B, H, S, Dn+Dr) after RoPE,
        c (B, 1, L, Rkv), k_rope (B, 1, L, Dr) rotated, mask bool (B, S, L) -> (B, S, H*Dv)."""
        B, L = c.shape[0], c.shape[2]
        H, Dn, Dr, Dv, R = self.n_heads, self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank
        kv = self.wkv_b(np.ascontiguousarray(c.reshape(B * L, R)))        # (B*L, H*(Dn+Dv))
        kv = kv.reshape(B, L, H, Dn + Dv).transpose(0, 2, 1, 3)             # (B, H, L, Dn+Dv)
        k = np.concatenate([kv[..., :Dn], np.broadcast_to(k_rope, (B, H, L, Dr))], axis=-1)
        v = np.ascontiguousarray(kv[..., Dn:])                              # (B, H, L, Dv)
        return attend(np.ascontiguousarray(q), k, v, mask, self.scale)

    # -- the ragged step of continuous batching --------------------------------------------------
    def forward_segments(self, x: np.ndarray, segments: list, layer: int) -> np.ndarray:
        """attention.Attention.forward_segments for latent attention: x float32 (T, D), the
        rows of all segments -> float32 (T, D).

        The query, the latent and the output projection run over all T rows in one call
        each; RoPE, the cache write and the attention per segment: a decode segment
        absorbed as decode does it, any other expanded as __call__ does (its mask).
        """
        T = x.shape[0]
        H, Dn, Dr, Dv, R = self.n_heads, self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank
        q = self._query(x).reshape(T, H, Dn + Dr)
        c, k_rope = self._latent(x)                                        # (T, Rkv), (T, Dr)
        o = np.empty((T, H * Dv), dtype=np.float32)
        for seg in segments:
            a, b = seg.start, seg.start + seg.n
            if seg.decode:
                q_rope = np.ascontiguousarray(q[a, :, Dn:])                  # (H, Dr)
                _rope_rows(q_rope, seg.cos, seg.sin)
                kr = np.ascontiguousarray(k_rope[a:a + 1])                   # (1, Dr)
                _rope_rows(kr, seg.cos, seg.sin)
                self._absorbed(np.ascontiguousarray(q[a]), q_rope, c[a:a + 1], kr, seg.cache,
                               layer, o[a:a + 1])
                continue
            S = b - a
            qs = q[a:b].transpose(1, 0, 2)[None]                             # (1, H, S, .)
            qs = np.concatenate([qs[..., :Dn], apply_rope(qs[..., Dn:], seg.cos, seg.sin)],
                                axis=-1)
            kr = apply_rope(k_rope[a:b].reshape(1, 1, S, Dr), seg.cos, seg.sin)
            cc, kk = seg.cache.write(layer, c[a:b].reshape(1, 1, S, R), kr)  # (1, 1, L, .)
            o[a:b] = self._expanded(qs, cc, kk, seg.mask(None))[0]
        return self.wo(o)

    # -- one token of one sequence -------------------------------------------------------------
    def decode(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, cache, layer: int,
               s: RunState) -> np.ndarray:
        """__call__ for B = S = 1 through a KV cache none of whose slots is padding:
        float32 (1, D), the buffer s.o (valid until the next call).

        x float32 (1, D); cos/sin float32 (Dr/2,) of the token's position; the latent and
        rotary key go to slot cache.length of `layer`. kv_b absorbed (module docstring):
        scores[h, j] = (q_nope[h] W_kb[h]) · c_j + q_rope[h] · k_rope_j, out[h] =
        W_vb[h] (sum_j p[h, j] c_j).
        """
        H, Dn, Dr = self.n_heads, self.nope_dim, self.rope_dim
        q = self._query(x).reshape(H, Dn + Dr)
        q_rope = np.ascontiguousarray(q[:, Dn:])                           # (H, Dr)
        _rope_rows(q_rope, cos, sin)
        c, k_rope = self._latent(x)
        k_rope = np.ascontiguousarray(k_rope)                              # (1, Dr)
        _rope_rows(k_rope, cos, sin)
        o = np.empty((1, H * self.v_dim), dtype=np.float32)
        self.wo(self._absorbed(q, q_rope, c, k_rope, cache, layer, o), s.o)
        return s.o

    def _absorbed(self, q: np.ndarray, q_rope: np.ndarray, c: np.ndarray, k_rope: np.ndarray,
                  cache, layer: int, out: np.ndarray) -> np.ndarray:
        """One token's attention with kv_b absorbed, compiled (csrc/mla.h, one call): q (H,
        Dn+Dr) (q_nope its first Dn columns), q_rope (H, Dr) rotated, its latent c (1, Rkv)
        and rotated key k_rope (1, Dr) written to slot cache.length of `layer` -> the heads'
        output into out float32 (1, H*Dv). The NumPy form is _reference.mla_absorbed_ref."""
        self._absorb(q, q_rope, cache.k[layer], cache.v[layer], c, k_rope, cache.length,
                     self._scale, out)
        return out
