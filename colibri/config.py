"""The model's geometry and rules, typed: `ModelConfig`.

A .colibri file stores these fields as the "arch" object of its metadata (docs/format.md §5);
the converter's family modules build one from a Hugging Face config.json, stating only what
differs from the defaults below; the model reads every dimension and switch from it.
Field names are Hugging Face's where transformers has one.

    cfg = ModelConfig.from_metadata(colibri_file.arch, source="model.colibri")
    cfg.hidden_size, cfg.layer_window(3), cfg.is_moe_layer(0)
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import ColibriError

__all__ = ["ModelConfig", "ConfigError", "ROUTERS", "QK_NORMS"]

ROUTERS = (
    "softmax_topk",     # softmax over all E, then top-k [, renormalised]
    "softmax_group_topk",   # DeepSeek-V2 group_limited_greedy: softmax, best groups, top-k
    "sigmoid_group_topk",   # DeepSeek-V3, GLM-4-MoE: sigmoid + correction bias, groups, top-k
)
QK_NORMS = ("none", "full", "per_head")     # none | over the whole projection | per head


class ConfigError(ColibriError, ValueError):
    """A model config field is missing, has the wrong type or an impossible value."""



@dataclass(frozen=True)
class ModelConfig:
    """Geometry and rules of one model. Shapes as in the package docstring (colibri)."""
    family: str
    vocab_size: int                                  # V
    hidden_size: int                                 # D
    num_hidden_layers: int
    num_attention_heads: int                         # H
    num_key_value_heads: int                         # Hkv
    head_dim: int                                    # Dh
    num_experts: int                                 # E
    num_experts_per_tok: int                         # K
    moe_intermediate_size: int                       # I
    router: str = "softmax_topk"                     # one of ROUTERS (kernels.route_topk)
    norm_topk_prob: bool = False                     # renormalise the top-k weights to sum 1
    n_group: int = 1                                 # expert groups of the group routers
    topk_group: int = 1                              # groups kept per token
    routed_scaling_factor: float = 1.0               # multiplies the routed weights
    shared_expert_intermediate_size: int = 0         # Is; 0: no shared expert
    shared_expert_gate: bool = False                 # shared expert scaled by sigmoid(x . g)
    moe_layers: tuple[int, ...] | None = None        # None: every layer is an MoE layer
    dense_intermediate_size: int = 0                 # the SwiGLU mlp of the other layers
    attention_bias: bool = False                     # q/k/v biases
    qk_norm: str = "none"                            # one of QK_NORMS
    clip_qkv: float | None = None                    # clamp q, k, v to +-clip_qkv
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None       # None: the window (if any) is everywhere
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = field(default=None, hash=False)
    partial_rotary_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | tuple[int, ...] | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | tuple[int, ...] | None = None
    # multi-head latent attention (DeepSeek-V2/V3, colibri/mla.py) when kv_lora_rank > 0:
    # head_dim is then the rotary key dim (qk_rope_head_dim), as transformers sets it
    kv_lora_rank: int = 0                            # Rkv, the cached latent's width
    q_lora_rank: int = 0                             # Rq; 0: q is one projection
    qk_nope_head_dim: int = 0                        # Dn, the per-head key dims without RoPE
    v_head_dim: int = 0                              # Dv

    def __post_init__(self):
        _check(self)

    # -- derived ------------------------------------------------------------------------------
    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """The layers with routed experts, ascending."""
        if self.moe_layers is None:
            return tuple(range(self.num_hidden_layers))
        return self.moe_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layer_ids

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer` in slots, or None for full attention."""
        if not self.sliding_window:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (colibri/mla.py) instead of attention.Attention."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """MLA: Dn + Dr, the per-head query/key width (the softmax scale's dimension)."""
        return self.qk_nope_head_dim + self.head_dim

    @property
    def kv_group(self) -> int:
        """G = H / Hkv: query heads per kv head."""
        return self.num_attention_heads // self.num_key_value_heads

    # -- the file's "arch" object ---------------------------------------------------------------
    @classmethod
    def from_metadata(cls, arch: Mapping[str, Any], source: str = "model file") -> "ModelConfig":
        """The config stored as a file's "arch" object; ConfigError naming `source` and the
        field when one is missing, unknown or of the wrong type."""
        if not isinstance(arch, Mapping):
            raise ConfigError(f"{source}: metadata 'arch' must be an object, "
                              f"found {type(arch).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(arch) - set(known))
        if unknown:
            raise ConfigError(f"{source}: metadata 'arch' has unknown field(s) "
                              f"{', '.join(map(repr, unknown))}")
        values = {}
        for name, f in known.items():
            if name not in arch:
                if f.default is dataclasses.MISSING:
                    raise ConfigError(f"{source}: metadata 'arch' lacks the field {name!r}")
                continue
            values[name] = _coerce(name, arch[name], source)
        try:
            return cls(**values)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_metadata(self) -> dict[str, Any]:
        """The "arch" object to store (JSON types: tuples become lists). The fields of
        LATER_FIELDS are left out at their defaults: a file of a family that does not use
        them is what it was before they existed, and older readers still open it."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in LATER_FIELDS and v == f.default:
                continue
            if isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, Mapping):
                v = dict(v)
            out[f.name] = v
        return out

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# Fields added after the first four families (the DeepSeek / GLM-4-MoE rules): stored only
# when they differ from the default (to_metadata).
LATER_FIELDS = frozenset({
    "n_group", "topk_group", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank",
    "qk_nope_head_dim", "v_head_dim"})


# --- field types and checks ------------------------------------------------------------------

_INT = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size", "max_position_embeddings")
_COUNT = ("shared_expert_intermediate_size", "dense_intermediate_size",      # may be 0
          "n_group", "topk_group", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
          "v_head_dim")
_BOOL = ("norm_topk_prob", "shared_expert_gate", "attention_bias", "tie_word_embeddings")
_FLOAT = ("rope_theta", "partial_rotary_factor", "rms_norm_eps", "routed_scaling_factor")
_TOKEN = ("bos_token_id", "eos_token_id", "pad_token_id")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _coerce(name: str, v: Any, source: str) -> Any:
    """JSON value -> field value (lists to tuples), or ConfigError naming the field."""
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{source}: metadata 'arch' field {name!r} must be {expected}, "
                           f"found {v!r}")
    if name in _INT or name in _COUNT:
        if not _is_int(v):
            raise bad("an integer")
    elif name in _BOOL:
        if not isinstance(v, bool):
            raise bad("true or false")
    elif name in _FLOAT or name == "clip_qkv":
        if v is None and name == "clip_qkv":
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad("a number")
        return float(v)
    elif name in _TOKEN:
        if v is None or _is_int(v):
            return v
        if isinstance(v, list) and all(_is_int(i) for i in v):
            return tuple(v)
        raise bad("an integer, a list of integers or null")
    elif name in ("family", "router", "qk_norm"):
        if not isinstance(v, str):
            raise bad("a string")
    elif name == "sliding_window":
        if v is not None and not _is_int(v):
            raise bad("an integer or null")
    elif name == "moe_layers":
        if v is None:
            return None
        if not isinstance(v, list) or not all(_is_int(i) for i in v):
            raise bad("a list of layer numbers")
        return tuple(v)
    elif name == "layer_types":
        if v is None:
            return None
        if not isinstance(v, list) or not all(isinstance(i, str) for i in v):
            raise bad("a list of strings or null")
        return tuple(v)
    elif name == "rope_scaling":
        if v is not None and not isinstance(v, Mapping):
            raise bad("an object or null")
    return v


def _check(c: ModelConfig) -> None:
    """Values that cannot describe a model; the messages name the field and the value."""
    for name in _INT:
        v = getattr(c, name)
        if not _is_int(v) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, found {v!r}")
    for name in _COUNT:
        v = getattr(c, name)
        if not _is_int(v) or v < 0:
            raise ConfigError(f"{name} must be an integer >= 0, found {v!r}")
    for name in _FLOAT:
        v = getattr(c, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ConfigError(f"{name} must be a finite number, found {v!r}")
    if c.num_attention_heads % c.num_key_value_heads:
        raise ConfigError(f"num_attention_heads {c.num_attention_heads} is not a multiple of "
                          f"num_key_value_heads {c.num_key_value_heads}")
    if c.num_experts_per_tok > c.num_experts:
        raise ConfigError(f"num_experts_per_tok {c.num_experts_per_tok} exceeds num_experts "
                          f"{c.num_experts}")
    if c.router not in ROUTERS:
        raise ConfigError(f"router {c.router!r} is not supported (supported: "
                          f"{', '.join(ROUTERS)})")
    _check_groups(c)
    _check_mla(c)
    if c.qk_norm not in QK_NORMS:
        raise ConfigError(f"qk_norm must be one of {', '.join(QK_NORMS)}, found {c.qk_norm!r}")
    if c.clip_qkv is not None and not (math.isfinite(c.clip_qkv) and c.clip_qkv > 0):
        raise ConfigError(f"clip_qkv must be a positive number or null, found {c.clip_qkv!r}")
    if c.sliding_window is not None and (not _is_int(c.sliding_window) or c.sliding_window < 1):
        raise ConfigError(f"sliding_window must be a positive integer or null, found "
                          f"{c.sliding_window!r}")
    n = c.num_hidden_layers
    if c.moe_layers is not None:
        bad = [i for i in c.moe_layers if not 0 <= i < n]
        if bad or list(c.moe_layers) != sorted(set(c.moe_layers)):
            raise ConfigError(f"moe_layers must list distinct layers in [0, {n}) in order, "
                              f"found {list(c.moe_layers)}")
        if len(c.moe_layers) < n and c.dense_intermediate_size < 1:
            raise ConfigError(f"layers {sorted(set(range(n)) - set(c.moe_layers))} are dense "
                              f"but dense_intermediate_size is {c.dense_intermediate_size}")
    if c.layer_types is not None and len(c.layer_types) != n:
        raise ConfigError(f"layer_types must list {n} entries (num_hidden_layers), found "
                          f"{len(c.layer_types)}")
    rot = int(c.head_dim * c.partial_rotary_factor)
    if rot <= 0 or rot % 2:
        raise ConfigError(f"rotary dimension {rot} (head_dim {c.head_dim} x "
                          f"partial_rotary_factor {c.partial_rotary_factor}) must be a positive "
                          f"even number")


def _check_groups(c: ModelConfig) -> None:
    """The group routers' settings (kernels.route_topk checks them again per call)."""
    E, K = c.num_experts, c.num_experts_per_tok
    if c.n_group < 1 or E % c.n_group:
        raise ConfigError(f"n_group {c.n_group} must be a positive divisor of num_experts {E}")
    if not 1 <= c.topk_group <= c.n_group:
        raise ConfigError(f"topk_group {c.topk_group} must be in 1..n_group {c.n_group}")
    if c.router.endswith("_group_topk") and K > c.topk_group * (E // c.n_group):
        raise ConfigError(f"num_experts_per_tok {K} exceeds the {c.topk_group * (E // c.n_group)} "
                          f"experts of topk_group {c.topk_group} groups of {E // c.n_group}")
    if c.router == "sigmoid_group_topk" and E // c.n_group < 2:
        raise ConfigError(f"router sigmoid_group_topk scores a group by its two best experts: "
                          f"num_experts {E} / n_group {c.n_group} leaves groups of one")
    if not c.routed_scaling_factor > 0:
        raise ConfigError(f"routed_scaling_factor must be positive, found "
                          f"{c.routed_scaling_factor!r}")


def _check_mla(c: ModelConfig) -> None:
    if not c.is_mla:
        if c.q_lora_rank or c.qk_nope_head_dim or c.v_head_dim:
            raise ConfigError("q_lora_rank, qk_nope_head_dim and v_head_dim are MLA fields: "
                              "they need kv_lora_rank > 0")
        return
    for name in ("qk_nope_head_dim", "v_head_dim"):
        if getattr(c, name) < 1:
            raise ConfigError(f"MLA (kv_lora_rank {c.kv_lora_rank}) needs {name} >= 1, found "
                              f"{getattr(c, name)}")
    if c.num_key_value_heads != c.num_attention_heads:
        raise ConfigError(f"MLA expands the latent into every head: num_key_value_heads "
                          f"{c.num_key_value_heads} must equal num_attention_heads "
                          f"{c.num_attention_heads}")
    if c.partial_rotary_factor != 1.0 or c.attention_bias or c.qk_norm != "none" \
            or c.clip_qkv is not None or c.sliding_window:
        raise ConfigError("MLA takes no partial_rotary_factor, attention_bias, qk_norm, "
                          "clip_qkv or sliding_window")
