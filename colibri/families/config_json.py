"""Reading a Hugging Face config.json into a `ModelConfig`: the fields every family reads the
same way, and the helpers a family uses for the rest.

    cfg = build(hf, family="mixtral", default_rope_theta=1e6, num_experts=..., ...)

Every problem is a ConfigError naming the config.json field: "config.json: field 'x' ...". A
field config.json does not have takes the family's default where the family gives one (its
expert count, top-k, rope theta), else ModelConfig's.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from ..config import ConfigError, ModelConfig

HFConfig = Mapping[str, Any]          # a parsed config.json

_MISSING = object()
REQUIRED = _MISSING       # as a getter's default: the field must be present


def get_int(hf: HFConfig, key: str, default: Any = _MISSING, *, minimum: int = 1) -> int:
    """hf[key] as an int >= minimum; a missing (or null) key takes `default`, or is an error."""
    value = hf.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise ConfigError(f"config.json: field {key!r} is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"config.json: field {key!r} must be an integer >= {minimum}, "
                          f"found {value!r}")
    return value


def get_float(hf: HFConfig, key: str, default: Any = _MISSING) -> float:
    value = hf.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise ConfigError(f"config.json: field {key!r} is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"config.json: field {key!r} must be a finite number, found {value!r}")
    return float(value)


def get_bool(hf: HFConfig, key: str, default: bool) -> bool:
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"config.json: field {key!r} must be true or false, found {value!r}")
    return value


def token_id(hf: HFConfig, key: str) -> int | tuple[int, ...] | None:
    """bos/eos/pad ids: an int, a list of ints (as a tuple) or None."""
    value = hf.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                       for v in value):
        return tuple(value)
    raise ConfigError(f"config.json: field {key!r} must be an int, a list of ints or null, "
                      f"found {value!r}")


def rope(hf: HFConfig, default_theta: float) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config style.

    transformers 5 writes `rope_parameters: {"rope_type": ..., "rope_theta": ...}`; older
    configs have a top-level `rope_theta` and an optional `rope_scaling` ({"type"|"rope_type",
    "factor", ...}). The scaling dict is returned with a "rope_type" key, or None for plain RoPE.
    """
    params = hf.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"config.json: field 'rope_parameters' must be an object, "
                          f"found {params!r}")
    params = dict(params or {})
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = hf.get("rope_theta", default_theta)
    theta = get_float({"rope_theta": theta}, "rope_theta")
    scaling = params if params else hf.get("rope_scaling")
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


def attention_dims(hf: HFConfig) -> tuple[int, int, int]:
    """(H, Hkv, Dh): head_dim may be absent or null, meaning hidden_size / num_attention_heads."""
    hidden = get_int(hf, "hidden_size")
    heads = get_int(hf, "num_attention_heads")
    kv_heads = get_int(hf, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ConfigError(f"config.json: num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {kv_heads}")
    head_dim = hf.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"config.json: head_dim is null and hidden_size {hidden} is not "
                              f"divisible by num_attention_heads {heads}")
        head_dim = hidden // heads
    head_dim = get_int({"head_dim": head_dim}, "head_dim")
    if head_dim % 2:
        raise ConfigError(f"config.json: head_dim {head_dim} must be even for RoPE")
    return heads, kv_heads, head_dim


def check_activation(hf: HFConfig) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config.json: hidden_act {act!r} is not supported "
                          f"(colibri runs SwiGLU experts: 'silu')")


def experts(hf: HFConfig, names: tuple[str, str], default: int, default_top_k: int
            ) -> dict[str, int]:
    """num_experts (E, under the first of `names` config.json has, else `default`) and
    num_experts_per_tok (K); hub configs and transformers 5 spell E differently."""
    name = next((n for n in names if hf.get(n) is not None), names[0])
    n_experts = get_int(hf, name, default)
    top_k = get_int(hf, "num_experts_per_tok", default_top_k)
    if top_k > n_experts:
        raise ConfigError(f"config.json: num_experts_per_tok {top_k} exceeds {name} "
                          f"{n_experts}")
    return {"num_experts": n_experts, "num_experts_per_tok": top_k}


def sparse_layers(hf: HFConfig) -> dict[str, Any]:
    """Qwen-style MoE layers: i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0;
    the other layers have a dense mlp of `intermediate_size`."""
    n_layers = get_int(hf, "num_hidden_layers")
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ConfigError(f"config.json: field 'mlp_only_layers' must be a list of layer "
                          f"indices, found {dense!r}")
    bad = [i for i in dense if not 0 <= i < n_layers]
    if bad:
        raise ConfigError(f"config.json: mlp_only_layers {bad} out of range for "
                          f"num_hidden_layers {n_layers}")
    step = get_int(hf, "decoder_sparse_step", 1)
    moe = tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)
    if len(moe) == n_layers:
        return {"moe_layers": moe}
    return {"moe_layers": moe, "dense_intermediate_size": get_int(hf, "intermediate_size")}


def qwen_window(hf: HFConfig) -> int | None:
    """The sliding window, which Qwen configs switch on with `use_sliding_window`."""
    if not get_bool(hf, "use_sliding_window", False):
        return None
    return get_int(hf, "sliding_window", None)


def refuse_attention_bias(hf: HFConfig, family: str) -> None:
    """attention_bias in these families adds an o_proj bias, which has no canonical tensor."""
    if get_bool(hf, "attention_bias", False):
        raise ConfigError(f"config.json: attention_bias=true is not supported for {family}")


def build(hf: HFConfig, *, family: str,
          default_rope_theta: float = ModelConfig.rope_theta,
          **family_fields: Any) -> ModelConfig:
    """The ModelConfig of `hf`: the fields every family reads the same way, then the
    family's own (`family_fields`, ModelConfig field names, overriding the shared ones);
    `default_rope_theta` applies when config.json has no rope theta."""
    check_activation(hf)
    heads, kv_heads, head_dim = attention_dims(hf)
    theta, scaling = rope(hf, default_rope_theta)
    n_layers = get_int(hf, "num_hidden_layers")
    fields = dict(
        family=family,
        vocab_size=get_int(hf, "vocab_size"),
        hidden_size=get_int(hf, "hidden_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=get_float(hf, "rms_norm_eps", ModelConfig.rms_norm_eps),
        max_position_embeddings=get_int(hf, "max_position_embeddings",
                                        ModelConfig.max_position_embeddings),
        tie_word_embeddings=get_bool(hf, "tie_word_embeddings", ModelConfig.tie_word_embeddings),
        bos_token_id=token_id(hf, "bos_token_id"),
        eos_token_id=token_id(hf, "eos_token_id"),
        pad_token_id=token_id(hf, "pad_token_id"),
        # converted files have always listed the MoE layers, all of them included
        moe_layers=tuple(range(n_layers)),
    )
    fields.update(family_fields)
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        raise ConfigError(f"config.json: {e}") from None
