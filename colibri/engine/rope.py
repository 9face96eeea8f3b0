"""RoPE: the rotary position embedding's tables and its rotation, in NumPy, float32.

The maths follows transformers: inv_freq = 1 / theta^(2i/Dr) over the Dr = head_dim *
partial_rotary_factor rotary dims, rescaled by the rope_scaling rule (default, linear,
llama3, yarn, longrope); cos/sin = cos/sin(position * inv_freq) [* yarn's or longrope's
attention factor], computed in float32; the "half split" rotation (rotate_half) of the first
Dr dims of each head. LongRoPE (Phi-3 / PhiMoE, "su" in old configs) has two tables: the
short factors while the call's longest sequence (max position + 1) is within
original_max_position_embeddings, the long factors beyond, each with its own scale
(short_mscale / long_mscale when the config gives them, else the attention factor).
The decode step rotates with the compiled twin of apply_rope (kernels.rope_rows_into:
NumPy's float32 operations, the same bits) on the tables of cos_sin_one.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..config import ModelConfig

__all__ = ["Rope", "rope_inv_freq", "apply_rope"]


def _rope_type(scaling: Mapping[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None,
                  partial_rotary_factor: float = 1.0,
                  max_position_embeddings: int | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies float32 (Dr/2,) and the cos/sin scale factor, as transformers
    computes them.

    Supported `scaling` types (the "rope_type"/"type" field of rope_scaling / rope_parameters):
    default, linear, llama3, yarn, longrope (its short table; Rope keeps the long one).
    Others raise NotImplementedError naming the type.
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
    if kind in ("longrope", "su"):
        short, _, scale, _, _ = longrope_tables(pos_freqs, scaling, max_position_embeddings)
        return short, scale
    raise NotImplementedError(
        f"RoPE scaling type {kind!r} is not supported (supported: default, linear, llama3, "
        f"yarn, longrope)")


def longrope_tables(pos_freqs: np.ndarray, p: Mapping[str, Any],
                    max_position_embeddings: int | None
                    ) -> tuple[np.ndarray, np.ndarray, float, float, int]:
    """LongRoPE (transformers' _compute_longrope_parameters; PhiMoE's short/long mscale):
    (short inv_freq, long inv_freq float32 (Dr/2,), short scale, long scale, original
    context). inv_freq = 1 / (factor_i * theta^(2i/Dr)) with the short or long factors."""
    missing = [k for k in ("short_factor", "long_factor", "original_max_position_embeddings")
               if p.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling of type longrope lacks {', '.join(missing)}")
    original = int(p["original_max_position_embeddings"])
    half = pos_freqs.shape[0]
    tables = []
    for name in ("short_factor", "long_factor"):
        ext = np.asarray(p[name], dtype=np.float32)
        if ext.shape != (half,):
            raise ValueError(f"rope_scaling {name} must list {half} numbers (rotary dims / 2), "
                             f"found {ext.shape[0] if ext.ndim == 1 else ext.shape}")
        tables.append((np.float32(1.0) / (ext * pos_freqs)).astype(np.float32))
    factor = p.get("factor")
    if factor is None:
        factor = (max_position_embeddings or original) / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0 else
                            math.sqrt(1 + math.log(factor) / math.log(original)))
    short = float(p.get("short_mscale", attention_factor))
    long = float(p.get("long_mscale", attention_factor))
    return tables[0], tables[1], short, long, original


def _yarn_inv_freq(pos_freqs: np.ndarray, dim: int, base: float, p: Mapping[str, Any],
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
    """cos/sin tables of a model's rotary embedding; `Rope.from_config(config)`."""

    def __init__(self, head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None,
                 partial_rotary_factor: float = 1.0, max_position_embeddings: int | None = None):
        self.head_dim = head_dim
        self.inv_freq, self.attention_factor = rope_inv_freq(
            head_dim, theta, scaling, partial_rotary_factor, max_position_embeddings)
        self.rot_dim = 2 * self.inv_freq.shape[0]                            # Dr
        # LongRoPE: the long table and its scale, used when the sequence exceeds `_original`
        self._long = None
        if _rope_type(scaling) in ("longrope", "su"):
            dim = self.rot_dim
            exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
            pos_freqs = np.power(np.float32(theta), exponents, dtype=np.float32)
            _, long_inv, _, long_scale, self._original = longrope_tables(
                pos_freqs, scaling, max_position_embeddings)
            self._long = (long_inv, long_scale)

    def _table(self, seq_len: int) -> tuple[np.ndarray, float]:
        """inv_freq and cos/sin scale for a call whose longest sequence is seq_len tokens."""
        if self._long is not None and seq_len > self._original:
            return self._long
        return self.inv_freq, self.attention_factor

    @classmethod
    def from_config(cls, config: ModelConfig) -> "Rope":
        """The tables of a model: head_dim, rope_theta, rope_scaling, partial_rotary_factor,
        max_position_embeddings of its config (a "default" scaling entry is no scaling)."""
        scaling = config.rope_scaling
        if _rope_type(scaling) == "default":
            scaling = None
        return cls(config.head_dim, config.rope_theta, scaling, config.partial_rotary_factor,
                   config.max_position_embeddings)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """positions int (B, S) -> cos, sin float32 (B, 1, S, Dr/2) (broadcast over heads)."""
        inv_freq, factor = self._table(int(positions.max()) + 1 if positions.size else 0)
        freqs = positions.astype(np.float32)[..., None] * inv_freq             # (B, S, Dr/2)
        cos, sin = np.cos(freqs), np.sin(freqs)
        if factor != 1.0:
            cos = cos * np.float32(factor)
            sin = sin * np.float32(factor)
        return cos[:, None], sin[:, None]

    def cos_sin_one(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin float32 (Dr/2,) of one position: cos_sin's values (the same operations)."""
        inv_freq, factor = self._table(position + 1)
        freqs = np.float32(position) * inv_freq                                # (Dr/2,)
        cos, sin = np.cos(freqs), np.sin(freqs)
        if factor != 1.0:
            cos = cos * np.float32(factor)
            sin = sin * np.float32(factor)
        return cos, sin


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate x float32 (B, H, S, Dh) by the half-split rule on its first Dr dims.

    cos, sin float32 (B, 1, S, Dr/2) from Rope.cos_sin. out[:h] = x1*c - x2*s,
    out[h:Dr] = x2*c + x1*s with h = Dr/2 (rotate_half); dims past Dr pass unchanged.
    """
    h = cos.shape[-1]
    x1, x2 = x[..., :h], x[..., h:2 * h]
    out = np.empty_like(x)
    np.subtract(x1 * cos, x2 * sin, out=out[..., :h])
    np.add(x2 * cos, x1 * sin, out=out[..., h:2 * h])
    if 2 * h < x.shape[-1]:
        out[..., 2 * h:] = x[..., 2 * h:]
    return out
