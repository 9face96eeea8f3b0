"""What every MoE family shares: config parsing helpers, canonical tensors, the Family record.

A family is data, not code paths: `arch(config)` turns a Hugging Face config.json into the
normalized "arch" dict the runtime reads (SPEC §3), and `name_map` says which checkpoint key
holds each canonical tensor (SPEC §1.7). Which canonical tensors a model has, and their shapes,
follow from the arch dict alone and are the same for every family (`canonical_tensors`).

Shape alphabet: V vocab, D hidden, H / Hkv heads, Dh head dim, E experts, I expert
intermediate, Is shared-expert intermediate, Id dense-mlp intermediate.

Arch fields the runtime must honour (beyond their names):
- `moe_layers`: layers with a routed MoE (router + experts, plus the shared expert when
  `shared_expert_intermediate_size > 0`); every other layer has a dense SwiGLU `mlp` of size
  `dense_intermediate_size`.
- `sliding_window` (int | None) with `layer_types` (list | None): when `layer_types` is None the
  window (if any) applies to every layer; otherwise only to layers whose type is
  "sliding_attention".
- `rope_scaling`: None for plain RoPE, else the Hugging Face rope parameters with a
  "rope_type" key (e.g. "yarn", "linear", "dynamic", "llama3").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..errors import ColibriError


# Checkpoint names the families share (per-layer keys relative to "model.layers.{i}."); each
# family's NAME_MAP is these plus its own, so a family module shows only what is its own.
LLAMA_NAMES = {
    "tok_embeddings": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "attn.wq": "self_attn.q_proj.weight",
    "attn.wk": "self_attn.k_proj.weight",
    "attn.wv": "self_attn.v_proj.weight",
    "attn.wo": "self_attn.o_proj.weight",
}
QK_NORM_NAMES = {
    "attn.q_norm": "self_attn.q_norm.weight",
    "attn.k_norm": "self_attn.k_norm.weight",
}
# Qwen-style routed experts (Qwen2-MoE, Qwen3-MoE, OLMoE)
QWEN_EXPERT_NAMES = {
    "moe.router": "mlp.gate.weight",
    "moe.experts.w_gate": "mlp.experts.{e}.gate_proj.weight",
    "moe.experts.w_up": "mlp.experts.{e}.up_proj.weight",
    "moe.experts.w_down": "mlp.experts.{e}.down_proj.weight",
}
DENSE_MLP_NAMES = {
    "mlp.w_gate": "mlp.gate_proj.weight",
    "mlp.w_up": "mlp.up_proj.weight",
    "mlp.w_down": "mlp.down_proj.weight",
}

LAYER_PREFIX = "model.layers.{i}."
EXPERT_PROJS = ("w_gate", "w_up", "w_down")

# Keys a checkpoint may carry that hold no weights the runtime needs (buffers saved by old
# transformers versions). Matched with str.endswith.
IGNORABLE_SUFFIXES = (".rotary_emb.inv_freq",)


class ConfigError(ColibriError):
    """config.json lacks a field, or a field has a value this family cannot run."""


_MISSING = object()


def get_int(config: Mapping[str, Any], key: str, default: Any = _MISSING, *,
            minimum: int = 1) -> int:
    """config[key] as an int >= minimum; a missing key takes `default` (or is an error)."""
    value = config.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise ConfigError(f"config.json: field {key!r} is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"config.json: field {key!r} must be an integer >= {minimum}, "
                          f"found {value!r}")
    return value


def get_float(config: Mapping[str, Any], key: str, default: Any = _MISSING) -> float:
    value = config.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise ConfigError(f"config.json: field {key!r} is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"config.json: field {key!r} must be a finite number, found {value!r}")
    return float(value)


def get_bool(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"config.json: field {key!r} must be true or false, found {value!r}")
    return value


def token_id(config: Mapping[str, Any], key: str) -> int | list[int] | None:
    """bos/eos/pad ids pass through as int, list of ints or None."""
    value = config.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                       for v in value):
        return list(value)
    raise ConfigError(f"config.json: field {key!r} must be an int, a list of ints or null, "
                      f"found {value!r}")


def rope(config: Mapping[str, Any], default_theta: float) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config style.

    transformers 5 writes `rope_parameters: {"rope_type": ..., "rope_theta": ...}`; older
    configs have a top-level `rope_theta` and an optional `rope_scaling` ({"type"|"rope_type",
    "factor", ...}). The scaling dict is returned with a "rope_type" key, or None for plain RoPE.
    """
    params = config.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"config.json: field 'rope_parameters' must be an object, "
                          f"found {params!r}")
    params = dict(params or {})
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = config.get("rope_theta", default_theta)
    theta = get_float({"rope_theta": theta}, "rope_theta")
    scaling = params if params else config.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(f"config.json: field 'rope_scaling' must be an object or null, "
                          f"found {scaling!r}")
    if scaling:
        scaling = dict(scaling)
        scaling.pop("rope_theta", None)
        kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        if kind == "default":
            return theta, None
        return theta, {"rope_type": kind, **scaling}
    return theta, None


def attention_dims(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """(H, Hkv, Dh): head_dim may be absent or null, meaning hidden_size / num_attention_heads."""
    hidden = get_int(config, "hidden_size")
    heads = get_int(config, "num_attention_heads")
    kv_heads = get_int(config, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ConfigError(f"config.json: num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {kv_heads}")
    head_dim = config.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"config.json: head_dim is null and hidden_size {hidden} is not "
                              f"divisible by num_attention_heads {heads}")
        head_dim = hidden // heads
    head_dim = get_int({"head_dim": head_dim}, "head_dim")
    if head_dim % 2:
        raise ConfigError(f"config.json: head_dim {head_dim} must be even for RoPE")
    return heads, kv_heads, head_dim


def check_activation(config: Mapping[str, Any]) -> None:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config.json: hidden_act {act!r} is not supported "
                          f"(colibri runs SwiGLU experts: 'silu')")


def check_experts(n_experts: int, top_k: int, experts_field: str) -> None:
    if top_k > n_experts:
        raise ConfigError(f"config.json: num_experts_per_tok {top_k} exceeds "
                          f"{experts_field} {n_experts}")


def sparse_layers(config: Mapping[str, Any], n_layers: int) -> list[int]:
    """Qwen-style MoE layers: i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ConfigError(f"config.json: field 'mlp_only_layers' must be a list of layer "
                          f"indices, found {dense!r}")
    bad = [i for i in dense if not 0 <= i < n_layers]
    if bad:
        raise ConfigError(f"config.json: mlp_only_layers {bad} out of range for "
                          f"num_hidden_layers {n_layers}")
    step = get_int(config, "decoder_sparse_step", 1)
    return [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]


def common_arch(config: Mapping[str, Any], *, family: str, default_theta: float) -> dict:
    """Fields read the same way by every family; the family fills in the rest (SPEC §3)."""
    check_activation(config)
    heads, kv_heads, head_dim = attention_dims(config)
    theta, scaling = rope(config, default_theta)
    return {
        "family": family,
        "vocab_size": get_int(config, "vocab_size"),
        "hidden_size": get_int(config, "hidden_size"),
        "num_hidden_layers": get_int(config, "num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "router": "softmax_topk",
        "rope_theta": theta,
        "rope_scaling": scaling,
        "partial_rotary_factor": 1.0,
        "rms_norm_eps": get_float(config, "rms_norm_eps", 1e-6),
        "max_position_embeddings": get_int(config, "max_position_embeddings", 4096),
        "tie_word_embeddings": get_bool(config, "tie_word_embeddings", False),
        "bos_token_id": token_id(config, "bos_token_id"),
        "eos_token_id": token_id(config, "eos_token_id"),
        "pad_token_id": token_id(config, "pad_token_id"),
    }


# --- canonical tensors (SPEC §1.7), family-independent ---------------------------------------

# Each dimension is a product of arch fields (or integer literals); kept as text so a shape
# mismatch can say which config fields it came from.
_DIMS: dict[str, tuple[str, ...]] = {
    "tok_embeddings": ("vocab_size", "hidden_size"),                      # (V, D)
    "norm": ("hidden_size",),                                             # (D,)
    "lm_head": ("vocab_size", "hidden_size"),                             # (V, D)
    "attn_norm": ("hidden_size",),
    "ffn_norm": ("hidden_size",),
    "attn.wq": ("num_attention_heads*head_dim", "hidden_size"),          # (H*Dh, D)
    "attn.wk": ("num_key_value_heads*head_dim", "hidden_size"),          # (Hkv*Dh, D)
    "attn.wv": ("num_key_value_heads*head_dim", "hidden_size"),          # (Hkv*Dh, D)
    "attn.wo": ("hidden_size", "num_attention_heads*head_dim"),          # (D, H*Dh)
    "attn.bq": ("num_attention_heads*head_dim",),
    "attn.bk": ("num_key_value_heads*head_dim",),
    "attn.bv": ("num_key_value_heads*head_dim",),
    "attn.q_norm/full": ("num_attention_heads*head_dim",),               # OLMoE
    "attn.k_norm/full": ("num_key_value_heads*head_dim",),
    "attn.q_norm/per_head": ("head_dim",),                               # Qwen3
    "attn.k_norm/per_head": ("head_dim",),
    "moe.router": ("num_experts", "hidden_size"),                        # (E, D)
    "moe.experts.w_gate": ("moe_intermediate_size", "hidden_size"),      # (I, D)
    "moe.experts.w_up": ("moe_intermediate_size", "hidden_size"),        # (I, D)
    "moe.experts.w_down": ("hidden_size", "moe_intermediate_size"),      # (D, I)
    "moe.shared.w_gate": ("shared_expert_intermediate_size", "hidden_size"),  # (Is, D)
    "moe.shared.w_up": ("shared_expert_intermediate_size", "hidden_size"),
    "moe.shared.w_down": ("hidden_size", "shared_expert_intermediate_size"),
    "moe.shared_gate": ("1", "hidden_size"),                             # (1, D)
    "mlp.w_gate": ("dense_intermediate_size", "hidden_size"),            # (Id, D)
    "mlp.w_up": ("dense_intermediate_size", "hidden_size"),
    "mlp.w_down": ("hidden_size", "dense_intermediate_size"),            # (D, Id)
}


def eval_dim(expr: str, arch: Mapping[str, Any]) -> int:
    out = 1
    for factor in expr.split("*"):
        out *= int(factor) if factor.isdigit() else int(arch[factor])
    return out


@dataclass(frozen=True)
class CanonicalTensor:
    """One tensor of the .colibri file, as the arch dict implies it."""
    name: str                      # e.g. "layers.3.moe.experts.5.w_up"
    shape: tuple[int, ...]
    dims: tuple[str, ...]          # arch-field expression behind each dimension
    kind: str                      # key of the name map: "attn.wq", "moe.experts.w_up", ...
    layer: int | None = None
    expert: int | None = None
    proj: str | None = None        # "w_gate" | "w_up" | "w_down" for routed experts


def canonical_tensors(arch: Mapping[str, Any]) -> list[CanonicalTensor]:
    """Every tensor a model with this arch has, in model order (embedding, layers, head)."""
    out: list[CanonicalTensor] = []

    def add(name: str, kind: str, dims_key: str | None = None, **where: Any) -> None:
        dims = _DIMS[dims_key or kind]
        out.append(CanonicalTensor(name, tuple(eval_dim(d, arch) for d in dims), dims, kind,
                                   **where))

    add("tok_embeddings", "tok_embeddings")
    moe_layers = set(arch["moe_layers"])
    for i in range(arch["num_hidden_layers"]):
        p = f"layers.{i}."
        add(p + "attn_norm", "attn_norm", layer=i)
        for w in ("wq", "wk", "wv", "wo"):
            add(p + "attn." + w, "attn." + w, layer=i)
        if arch["attention_bias"]:
            for b in ("bq", "bk", "bv"):
                add(p + "attn." + b, "attn." + b, layer=i)
        if arch["qk_norm"] != "none":
            for n in ("q_norm", "k_norm"):
                add(p + "attn." + n, "attn." + n, f"attn.{n}/{arch['qk_norm']}", layer=i)
        add(p + "ffn_norm", "ffn_norm", layer=i)
        if i in moe_layers:
            add(p + "moe.router", "moe.router", layer=i)
            for e in range(arch["num_experts"]):
                for w in EXPERT_PROJS:
                    add(f"{p}moe.experts.{e}.{w}", "moe.experts." + w, layer=i, expert=e, proj=w)
            if arch["shared_expert_intermediate_size"]:
                for w in EXPERT_PROJS:
                    add(p + "moe.shared." + w, "moe.shared." + w, layer=i)
                if arch["shared_expert_gate"]:
                    add(p + "moe.shared_gate", "moe.shared_gate", layer=i)
        else:
            for w in EXPERT_PROJS:
                add(p + "mlp." + w, "mlp." + w, layer=i)
    add("norm", "norm")
    if not arch["tie_word_embeddings"]:
        add("lm_head", "lm_head")
    return out


# --- the family record ----------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """Where a canonical tensor's values are in the checkpoint.

    `index` is applied to the checkpoint tensor (numpy basic indexing) when one checkpoint
    tensor holds several canonical ones (fused experts); `shape` is then the expected shape of
    the whole checkpoint tensor and `dims` its arch-field expressions.
    """
    key: str
    index: tuple = ()
    shape: tuple[int, ...] | None = None
    dims: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Family:
    """A model family: config → arch, and the checkpoint name of every canonical tensor.

    name_map: canonical kind → checkpoint key template, or a tuple of alternative templates
      (the first one present in the checkpoint is used). Templates may use {i} (layer) and
      {e} (expert); per-layer keys are relative to `layer_prefix`, the others absolute.
    fused_experts: (gate_up, down) checkpoint keys relative to `layer_prefix`, holding all
      experts of a layer as gate_up (E, 2I, D), gate rows first, and down (E, D, I); accepted
      as an alternative to the per-expert keys.
    config_fields: arch field → config.json field, where the names differ (error messages).
    """
    model_type: str
    arch: Callable[[Mapping[str, Any]], dict]
    name_map: Mapping[str, str | tuple[str, ...]]
    fused_experts: tuple[str, str] | None = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    layer_prefix: str = LAYER_PREFIX
    config_fields: Mapping[str, str] = field(default_factory=dict)
    description: str = ""

    def expected_shapes(self, arch: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        """canonical name → shape implied by config.json."""
        return {t.name: t.shape for t in canonical_tensors(arch)}

    def sources(self, t: CanonicalTensor, arch: Mapping[str, Any]) -> tuple[Source, ...]:
        """Alternative checkpoint locations of canonical tensor `t`, preferred first."""
        templates = self.name_map.get(t.kind)
        if templates is None:
            raise ColibriError(f"family {self.model_type!r} has no checkpoint name for "
                               f"{t.name!r}")
        if isinstance(templates, str):
            templates = (templates,)
        prefix = self.layer_prefix.format(i=t.layer) if t.layer is not None else ""
        subs = {"i": t.layer, "e": t.expert}
        found = [Source(prefix + tpl.format(**subs)) for tpl in templates]
        if t.expert is not None and self.fused_experts is not None:
            found.append(self._fused_source(t, prefix, arch))
        return tuple(found)

    def _fused_source(self, t: CanonicalTensor, prefix: str, arch: Mapping[str, Any]) -> Source:
        n_exp, inter, hidden = (arch["num_experts"], arch["moe_intermediate_size"],
                                arch["hidden_size"])
        gate_up, down = self.fused_experts
        if t.proj == "w_down":                                   # (E, D, I)
            return Source(prefix + down, (t.expert,), (n_exp, hidden, inter),
                          ("num_experts", "hidden_size", "moe_intermediate_size"))
        rows = slice(0, inter) if t.proj == "w_gate" else slice(inter, 2 * inter)
        return Source(prefix + gate_up, (t.expert, rows), (n_exp, 2 * inter, hidden),
                      ("num_experts", "2*moe_intermediate_size", "hidden_size"))

    def tensor_map(self, arch: Mapping[str, Any]) -> list[tuple[str, str]]:
        """(checkpoint_key, canonical_name) pairs with the preferred (per-expert) keys."""
        return [(self.sources(t, arch)[0].key, t.name) for t in canonical_tensors(arch)]

    def explain(self, dims: tuple[str, ...], arch: Mapping[str, Any]) -> str:
        """'num_attention_heads*head_dim=4*16, hidden_size=32' with config.json field names."""
        parts = []
        for expr in dims:
            factors = expr.split("*")
            names = "*".join(self.config_fields.get(f, f) for f in factors)
            values = "*".join(f if f.isdigit() else str(arch[f]) for f in factors)
            parts.append(f"{names}={values}")
        return ", ".join(parts)
