"""OLMoE (model_type "olmoe"): routed experts only, full-width q/k RMSNorm, optional clip_qkv.

Router: softmax over all E in f32, top-k, renormalised only if `norm_topk_prob` (default
False). q_norm (H*Dh,) and k_norm (Hkv*Dh,) normalise the whole projection output *before* the
split into heads (unlike Qwen3); then q, k and v are clamped to [-clip_qkv, clip_qkv] when set.
`intermediate_size` is the expert size; every layer is an MoE layer.
"""
from __future__ import annotations

from typing import Any, Mapping

from .base import (LLAMA_NAMES, QK_NORM_NAMES, QWEN_EXPERT_NAMES, ConfigError, Family,
                   check_experts, common_arch, get_bool, get_float, get_int)

NAME_MAP = {
    **LLAMA_NAMES,
    **QK_NORM_NAMES,          # over the whole projection: (H*Dh,), (Hkv*Dh,)
    **QWEN_EXPERT_NAMES,
}


def arch(config: Mapping[str, Any]) -> dict:
    a = common_arch(config, family="olmoe", default_theta=10000.0)
    if get_bool(config, "attention_bias", False):
        raise ConfigError("config.json: attention_bias=true is not supported for olmoe")
    n_experts = get_int(config, "num_experts", config.get("num_local_experts", 64))
    top_k = get_int(config, "num_experts_per_tok", 8)
    check_experts(n_experts, top_k, "num_experts")
    clip = get_float(config, "clip_qkv", None)
    if clip is not None and clip <= 0:
        raise ConfigError(f"config.json: clip_qkv must be positive or null, found {clip}")
    a.update(
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=get_int(config, "intermediate_size"),
        norm_topk_prob=get_bool(config, "norm_topk_prob", False),
        shared_expert_intermediate_size=0,
        shared_expert_gate=False,
        moe_layers=list(range(a["num_hidden_layers"])),
        dense_intermediate_size=0,
        attention_bias=False,
        qk_norm="full",
        clip_qkv=clip,
        sliding_window=None,
        layer_types=None,
    )
    return a


FAMILY = Family(
    model_type="olmoe",
    arch=arch,
    name_map=NAME_MAP,
    config_fields={"moe_intermediate_size": "intermediate_size"},
    description="OLMoE (OLMoE-1B-7B): full-width q/k norm, clip_qkv",
)
