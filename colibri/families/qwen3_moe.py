"""Qwen3-MoE (model_type "qwen3_moe"): routed experts only, per-head q/k RMSNorm.

Router: as Qwen2-MoE (softmax over all E in f32, top-k, renormalised if `norm_topk_prob`).
q_norm / k_norm are RMSNorms over head_dim (Dh,), applied to each head after the projection.
Dense layers follow `mlp_only_layers` / `decoder_sparse_step` as in Qwen2-MoE. A sliding window,
when `use_sliding_window`, applies to every layer. transformers 5 writes the expert count as
`num_local_experts`, hub configs as `num_experts`.
"""
from __future__ import annotations

from typing import Any, Mapping

from .base import (DENSE_MLP_NAMES, LLAMA_NAMES, QK_NORM_NAMES, QWEN_EXPERT_NAMES, ConfigError,
                   Family, check_experts, common_arch, get_bool, get_int, sparse_layers)

NAME_MAP = {
    **LLAMA_NAMES,
    **QK_NORM_NAMES,          # per head: (Dh,)
    **QWEN_EXPERT_NAMES,
    **DENSE_MLP_NAMES,
}


def arch(config: Mapping[str, Any]) -> dict:
    a = common_arch(config, family="qwen3_moe", default_theta=10000.0)
    if get_bool(config, "attention_bias", False):
        # would add an o_proj bias too, which has no canonical tensor
        raise ConfigError("config.json: attention_bias=true is not supported for qwen3_moe")
    n_layers = a["num_hidden_layers"]
    experts_field = "num_experts" if "num_experts" in config else "num_local_experts"
    n_experts = get_int(config, experts_field, 128)
    top_k = get_int(config, "num_experts_per_tok", 8)
    check_experts(n_experts, top_k, experts_field)
    moe_layers = sparse_layers(config, n_layers)
    a.update(
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=get_int(config, "moe_intermediate_size"),
        norm_topk_prob=get_bool(config, "norm_topk_prob", False),
        shared_expert_intermediate_size=0,
        shared_expert_gate=False,
        moe_layers=moe_layers,
        dense_intermediate_size=(get_int(config, "intermediate_size")
                                 if len(moe_layers) < n_layers else 0),
        attention_bias=False,
        qk_norm="per_head",
        clip_qkv=None,
        sliding_window=(get_int(config, "sliding_window", None)
                        if get_bool(config, "use_sliding_window", False) else None),
        layer_types=None,
    )
    return a


FAMILY = Family(
    model_type="qwen3_moe",
    arch=arch,
    name_map=NAME_MAP,
    config_fields={"dense_intermediate_size": "intermediate_size"},
    description="Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): per-head q/k norm",
)
