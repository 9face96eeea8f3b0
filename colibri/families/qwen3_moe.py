"""Qwen3-MoE (model_type "qwen3_moe"): routed experts only, per-head q/k RMSNorm.

Router: as Qwen2-MoE (softmax over all E in f32, top-k, renormalised if `norm_topk_prob`).
q_norm / k_norm are RMSNorms over head_dim (Dh,), applied to each head after the projection.
Dense layers follow `mlp_only_layers` / `decoder_sparse_step` as in Qwen2-MoE. A sliding window,
when `use_sliding_window`, applies to every layer. transformers 5 writes the expert count as
`num_local_experts`, hub configs as `num_experts`.
"""
from __future__ import annotations

from ..config import ModelConfig
from .base import DENSE_MLP_NAMES, LLAMA_NAMES, QK_NORM_NAMES, QWEN_EXPERT_NAMES, Family
from .config_json import (HFConfig, build, experts, get_bool, get_int, qwen_window,
                          refuse_attention_bias, sparse_layers)

NAME_MAP = {
    **LLAMA_NAMES,
    **QK_NORM_NAMES,          # per head: (Dh,)
    **QWEN_EXPERT_NAMES,
    **DENSE_MLP_NAMES,
}


def model_config(hf: HFConfig) -> ModelConfig:
    refuse_attention_bias(hf, "qwen3_moe")
    return build(
        hf, family="qwen3_moe",
        **experts(hf, ("num_experts", "num_local_experts"), 128, default_top_k=8),
        **sparse_layers(hf),
        moe_intermediate_size=get_int(hf, "moe_intermediate_size"),
        norm_topk_prob=get_bool(hf, "norm_topk_prob", False),
        qk_norm="per_head",
        sliding_window=qwen_window(hf),
    )


FAMILY = Family(
    model_type="qwen3_moe",
    model_config=model_config,
    name_map=NAME_MAP,
    config_fields={"dense_intermediate_size": "intermediate_size"},
    description="Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): per-head q/k norm",
)
