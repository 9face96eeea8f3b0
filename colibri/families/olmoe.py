"""OLMoE (model_type "olmoe"): routed experts only, full-width q/k RMSNorm, optional clip_qkv.

Router: softmax over all E in f32, top-k, renormalised only if `norm_topk_prob` (default
False). q_norm (H*Dh,) and k_norm (Hkv*Dh,) normalise the whole projection output *before* the
split into heads (unlike Qwen3); then q, k and v are clamped to [-clip_qkv, clip_qkv] when set.
`intermediate_size` is the expert size; every layer is an MoE layer.
"""
from __future__ import annotations

from ..config import ConfigError, ModelConfig
from .base import LLAMA_NAMES, QK_NORM_NAMES, QWEN_EXPERT_NAMES, Family
from .config_json import (HFConfig, build, experts, get_bool, get_float, get_int,
                          refuse_attention_bias)

NAME_MAP = {
    **LLAMA_NAMES,
    **QK_NORM_NAMES,          # over the whole projection: (H*Dh,), (Hkv*Dh,)
    **QWEN_EXPERT_NAMES,
}


def model_config(hf: HFConfig) -> ModelConfig:
    refuse_attention_bias(hf, "olmoe")
    clip = get_float(hf, "clip_qkv", None)
    if clip is not None and clip <= 0:
        raise ConfigError(f"config.json: clip_qkv must be positive or null, found {clip}")
    return build(
        hf, family="olmoe",
        **experts(hf, ("num_experts", "num_local_experts"), 64, default_top_k=8),
        moe_intermediate_size=get_int(hf, "intermediate_size"),
        norm_topk_prob=get_bool(hf, "norm_topk_prob", False),
        qk_norm="full",
        clip_qkv=clip,
    )


FAMILY = Family(
    model_type="olmoe",
    model_config=model_config,
    name_map=NAME_MAP,
    config_fields={"moe_intermediate_size": "intermediate_size"},
    description="OLMoE (OLMoE-1B-7B): full-width q/k norm, clip_qkv",
)
