"""GLM-4-MoE (model_type "glm4_moe", GLM-4.5 / 4.5-Air): Llama-style GQA attention with
partial RoPE, optional q/k/v biases and per-head q/k RMSNorm, dense first layers, routed
experts + one ungated shared expert, DeepSeek-V3's sigmoid routing.

Checked against transformers 5.24 modeling_glm4_moe.py: RoPE rotates the first
head_dim * partial_rotary_factor dims of each head, half-split (rotate_half), the rest pass
(`partial_rotary_factor` lives in rope_parameters, default 0.5); q_norm / k_norm (when
`use_qk_norm`) are RMSNorms over head_dim with rms_norm_eps, before RoPE; `attention_bias`
gives q/k/v biases (o_proj has none). Router (Glm4MoeTopkRouter) "sigmoid_group_topk":
sigmoid scores, + e_score_correction_bias for the choice, groups scored by their top-2
sum, top-k, weights from the sigmoid scores, / (sum + 1e-20) when norm_topk_prob, times
routed_scaling_factor. Layers below `first_k_dense_replace` are dense (intermediate_size);
`n_shared_experts` shared experts form one SwiGLU of n_shared_experts * moe_intermediate_size.
The multi-token-prediction layers of a release checkpoint (model.layers.N, N >=
num_hidden_layers) are skipped.
"""
from __future__ import annotations

from ..config import ConfigError, ModelConfig
from . import deepseek_v3
from .base import DENSE_MLP_NAMES, LLAMA_NAMES, QK_NORM_NAMES, QWEN_EXPERT_NAMES, Family
from .config_json import HFConfig, build, experts, get_bool, get_float, get_int

NAME_MAP = {
    **LLAMA_NAMES,
    "attn.bq": "self_attn.q_proj.bias",
    "attn.bk": "self_attn.k_proj.bias",
    "attn.bv": "self_attn.v_proj.bias",
    **QK_NORM_NAMES,          # per head: (Dh,)
    **QWEN_EXPERT_NAMES,
    "moe.correction_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared.w_gate": "mlp.shared_experts.gate_proj.weight",
    "moe.shared.w_up": "mlp.shared_experts.up_proj.weight",
    "moe.shared.w_down": "mlp.shared_experts.down_proj.weight",
    **DENSE_MLP_NAMES,
}


def partial_rotary_factor(hf: HFConfig) -> float:
    """From rope_parameters (transformers 5) or the top level (older configs); 0.5 default."""
    params = hf.get("rope_parameters")
    value = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if value is None:
        value = hf.get("partial_rotary_factor", 0.5)
    factor = get_float({"partial_rotary_factor": value}, "partial_rotary_factor")
    if not 0 < factor <= 1:
        raise ConfigError(f"config.json: partial_rotary_factor must be in (0, 1], found "
                          f"{factor}")
    return factor


def model_config(hf: HFConfig) -> ModelConfig:
    # the defaults are Glm4MoeConfig's
    n_layers = get_int(hf, "num_hidden_layers")
    first_dense = get_int(hf, "first_k_dense_replace", 1, minimum=0)
    moe_size = get_int(hf, "moe_intermediate_size", 1408)
    shared = get_int(hf, "n_shared_experts", 1, minimum=0)
    dense = {} if first_dense == 0 else {
        "dense_intermediate_size": get_int(hf, "intermediate_size", 10944)}
    cfg = build(
        hf, family="glm4_moe",
        **experts(hf, ("n_routed_experts", "num_local_experts"), 128, default_top_k=8),
        moe_intermediate_size=moe_size,
        moe_layers=tuple(range(min(first_dense, n_layers), n_layers)),
        **dense,
        shared_expert_intermediate_size=shared * moe_size,
        router="sigmoid_group_topk",
        norm_topk_prob=get_bool(hf, "norm_topk_prob", True),
        n_group=get_int(hf, "n_group", 1),
        topk_group=get_int(hf, "topk_group", 1),
        routed_scaling_factor=get_float(hf, "routed_scaling_factor", 1.0),
        attention_bias=get_bool(hf, "attention_bias", False),
        qk_norm="per_head" if get_bool(hf, "use_qk_norm", False) else "none",
        partial_rotary_factor=partial_rotary_factor(hf),
    )
    if cfg.rope_scaling and "partial_rotary_factor" in cfg.rope_scaling:
        # the scaling rule's own fields only: the factor is a field of its own
        scaling = {k: v for k, v in cfg.rope_scaling.items() if k != "partial_rotary_factor"}
        cfg = cfg.replace(rope_scaling=scaling)
    return cfg


FAMILY = Family(
    model_type="glm4_moe",
    model_config=model_config,
    name_map=NAME_MAP,
    config_fields={"num_experts": "n_routed_experts",
                   "dense_intermediate_size": "intermediate_size",
                   "shared_expert_intermediate_size": "n_shared_experts*moe_intermediate_size"},
    description="GLM-4.5 / 4.5-Air (GLM-4-MoE): partial RoPE, sigmoid group routing",
    ignores=deepseek_v3.ignores,
)
