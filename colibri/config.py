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

__all__ = ["ModelConfig", "ConfigError", "ROUTERS", "QK_NORMS", "NORMS", "EXPERT_ACTIVATIONS"]

ROUTERS = (
    "softmax_topk",     # softmax over all E, then top-k [, renormalised]
    "topk_softmax",     # top-k of the logits, then softmax over the k (Granite-MoE, GPT-OSS)
    "sparsemixer",      # PhiMoE's top-2 sparsemixer (inference form), router_jitter_noise
    "softmax_group_topk",   # DeepSeek-V2 group_limited_greedy: softmax, best groups, top-k
    "sigmoid_group_topk",   # DeepSeek-V3, GLM-4-MoE: sigmoid + correction bias, groups, top-k
)
QK_NORMS = ("none", "full", "per_head")     # none | over the whole projection | per head
NORMS = ("rms_norm", "layer_norm")          # the model's norms: RMSNorm | LayerNorm
EXPERT_ACTIVATIONS = ("silu", "swigluoai")   # silu(g) * u | GPT-OSS's clamped (u + 1) * g * sigmoid(a g)


# Ranges beyond the types: values no released model uses and that a corrupted file or a
# hand-edited config.json produce (docs/safety.md).
MAX_DIM = (1 << 31) - 1                             # every size and count fits an int32 index
MAX_NORM_EPS = 1e-2                                 # released models use 1e-12 .. 1e-5
MIN_WINDOW = 2                                      # a window of 1 attends to the token alone


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
    rms_norm_eps: float = 1e-6                       # eps of every norm (RMSNorm or LayerNorm)
    norm: str = "rms_norm"                           # one of NORMS
    norm_bias: bool = False                          # LayerNorm biases (attn/ffn/final norms)
    attention_out_bias: bool = False                 # o_proj bias
    lm_head_bias: bool = False                       # head bias
    attention_multiplier: float | None = None        # softmax scale; None: head_dim^-0.5
    embedding_multiplier: float = 1.0                # embedding rows scaled by (muP)
    residual_multiplier: float = 1.0                 # both residual branches scaled by (muP)
    logits_scaling: float = 1.0                      # logits divided by (muP)
    router_jitter_noise: float = 0.0                 # sparsemixer's threshold is 2x this
    router_bias: bool = False                        # router logits + a bias (E,)
    expert_bias: bool = False                        # expert gate / up / down biases
    expert_activation: str = "silu"                  # one of EXPERT_ACTIVATIONS
    swiglu_alpha: float = 1.702                      # swigluoai: g * sigmoid(alpha * g)
    swiglu_limit: float = 7.0                        # swigluoai: g <= limit, |u| <= limit
    attention_sinks: bool = False                    # a learned logit per head in each softmax
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | tuple[int, ...] | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | tuple[int, ...] | None = None
    # multi-head latent attention (DeepSeek-V2/V3, colibri/engine/mla.py) when kv_lora_rank > 0:
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
        """Multi-head latent attention (colibri/engine/mla.py) instead of attention.Attention."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """MLA: Dn + Dr, the per-head query/key width (the softmax scale's dimension)."""
        return self.qk_nope_head_dim + self.head_dim

    @property
    def attention_scale(self) -> float:
        """The factor of q . k before the softmax."""
        if self.attention_multiplier is None:
            return self.head_dim ** -0.5
        return self.attention_multiplier

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


# Fields added after the first four families (the Granite-MoE, DBRX, PhiMoE, GPT-OSS,
# DeepSeek and GLM-4-MoE rules): stored only when they differ from the default (to_metadata).
LATER_FIELDS = frozenset({
    "norm", "norm_bias", "attention_out_bias", "lm_head_bias", "attention_multiplier",
    "embedding_multiplier", "residual_multiplier", "logits_scaling", "router_jitter_noise",
    "router_bias", "expert_bias", "expert_activation", "swiglu_alpha", "swiglu_limit",
    "attention_sinks",
    "n_group", "topk_group", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank",
    "qk_nope_head_dim", "v_head_dim"})


# --- field types and checks ------------------------------------------------------------------

_INT = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size", "max_position_embeddings")
_COUNT = ("shared_expert_intermediate_size", "dense_intermediate_size",      # may be 0
          "n_group", "topk_group", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
          "v_head_dim")
_BOOL = ("norm_topk_prob", "shared_expert_gate", "attention_bias", "tie_word_embeddings",
         "norm_bias", "attention_out_bias", "lm_head_bias", "router_bias", "expert_bias",
         "attention_sinks")
_FLOAT = ("rope_theta", "partial_rotary_factor", "rms_norm_eps", "embedding_multiplier",
          "residual_multiplier", "logits_scaling", "router_jitter_noise", "swiglu_alpha",
          "swiglu_limit", "routed_scaling_factor")
_OPTIONAL_FLOAT = ("clip_qkv", "attention_multiplier")          # a number or null
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
    elif name in _FLOAT or name in _OPTIONAL_FLOAT:
        if v is None and name in _OPTIONAL_FLOAT:
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
    elif name in ("family", "router", "qk_norm", "norm", "expert_activation"):
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
    for name in _INT + _COUNT:
        if getattr(c, name) > MAX_DIM:
            raise ConfigError(f"{name} {getattr(c, name)} is out of range (at most {MAX_DIM})")
    if not 0 < c.rms_norm_eps <= MAX_NORM_EPS:
        raise ConfigError(f"rms_norm_eps must be in (0, {MAX_NORM_EPS}], found "
                          f"{c.rms_norm_eps!r}")
    if not c.rope_theta > 0:
        raise ConfigError(f"rope_theta must be positive, found {c.rope_theta!r}")
    if not 0 < c.partial_rotary_factor <= 1:
        raise ConfigError(f"partial_rotary_factor must be in (0, 1], found "
                          f"{c.partial_rotary_factor!r}")
    for name in ("embedding_multiplier", "residual_multiplier"):
        if getattr(c, name) == 0:
            raise ConfigError(f"{name} must not be 0 (it would erase the model's input)")
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
    if c.norm not in NORMS:
        raise ConfigError(f"norm must be one of {', '.join(NORMS)}, found {c.norm!r}")
    if c.norm_bias and c.norm != "layer_norm":
        raise ConfigError(f"norm_bias needs norm 'layer_norm', found norm {c.norm!r}")
    if c.expert_activation not in EXPERT_ACTIVATIONS:
        raise ConfigError(f"expert_activation must be one of {', '.join(EXPERT_ACTIVATIONS)}, "
                          f"found {c.expert_activation!r}")
    if c.swiglu_limit <= 0:
        raise ConfigError(f"swiglu_limit must be positive, found {c.swiglu_limit!r}")
    if c.logits_scaling == 0:
        raise ConfigError("logits_scaling must not be 0 (the logits are divided by it)")
    if c.attention_multiplier is not None and not (math.isfinite(c.attention_multiplier)
                                                   and c.attention_multiplier > 0):
        raise ConfigError(f"attention_multiplier must be a positive number or null, found "
                          f"{c.attention_multiplier!r}")
    if c.router == "sparsemixer" and c.num_experts_per_tok != 2:
        raise ConfigError(f"router 'sparsemixer' routes to 2 experts, found "
                          f"num_experts_per_tok {c.num_experts_per_tok}")
    if c.router_jitter_noise < 0:
        raise ConfigError(f"router_jitter_noise must be >= 0, found {c.router_jitter_noise!r}")
    if c.clip_qkv is not None and not (math.isfinite(c.clip_qkv) and c.clip_qkv > 0):
        raise ConfigError(f"clip_qkv must be a positive number or null, found {c.clip_qkv!r}")
    if c.sliding_window is not None and (not _is_int(c.sliding_window)
                                         or not MIN_WINDOW <= c.sliding_window <= MAX_DIM):
        raise ConfigError(f"sliding_window must be an integer in [{MIN_WINDOW}, {MAX_DIM}] or "
                          f"null, found {c.sliding_window!r}")
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
