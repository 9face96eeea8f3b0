"""Granite-MoE (model_type "granitemoe", IBM Granite-3 MoE / PowerMoE): experts fused in the
checkpoint, top-k on the router logits then softmax over the k, and the muP multipliers.

Router (GraniteMoeTopKRouter): logits in f32, the k largest, weights = softmax over those k
(rule "topk_softmax"). The experts are stored fused as the checkpoint ships them:
`block_sparse_moe.input_linear.weight` (E, 2I, D), gate rows first, then up, and
`block_sparse_moe.output_linear.weight` (E, D, I); the router is `router.layer.weight`.
The muP multipliers: the embedding rows times `embedding_multiplier`, both residual branches
times `residual_multiplier`, `attention_multiplier` as the softmax scale in place of
1/sqrt(Dh), logits divided by `logits_scaling`. `attention_bias` adds q/k/v/o biases.
Granite-MoE-Shared (model_type "granitemoeshared") adds an ungated shared MLP whose gate and
up projections are fused too: `shared_mlp.input_linear.weight` (2Is, D), gate rows first.
"""
from __future__ import annotations

from ..config import ModelConfig
from .base import LLAMA_NAMES, Family, Rows
from .config_json import HFConfig, build, experts, get_bool, get_float, get_int

NAME_MAP = {
    **LLAMA_NAMES,
    "attn.bq": "self_attn.q_proj.bias",
    "attn.bk": "self_attn.k_proj.bias",
    "attn.bv": "self_attn.v_proj.bias",
    "attn.bo": "self_attn.o_proj.bias",
    "moe.router": "block_sparse_moe.router.layer.weight",
    # no per-expert keys: the experts are only in the fused tensors (FUSED_EXPERTS)
    "moe.experts.w_gate": (),
    "moe.experts.w_up": (),
    "moe.experts.w_down": (),
}
FUSED_EXPERTS = ("block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight")
SHARED_NAMES = {
    "moe.shared.w_gate": Rows("shared_mlp.input_linear.weight",
                              ("shared_expert_intermediate_size",) * 2, 0),
    "moe.shared.w_up": Rows("shared_mlp.input_linear.weight",
                            ("shared_expert_intermediate_size",) * 2, 1),
    "moe.shared.w_down": "shared_mlp.output_linear.weight",
}


def granite_fields(hf: HFConfig) -> dict:
    """The ModelConfig fields both Granite-MoE variants read."""
    bias = get_bool(hf, "attention_bias", False)
    return dict(
        **experts(hf, ("num_local_experts", "num_experts"), 8, default_top_k=2),
        moe_intermediate_size=get_int(hf, "intermediate_size"),
        router="topk_softmax",
        attention_bias=bias,
        attention_out_bias=bias,
        embedding_multiplier=get_float(hf, "embedding_multiplier", 1.0),
        attention_multiplier=get_float(hf, "attention_multiplier", 1.0),
        residual_multiplier=get_float(hf, "residual_multiplier", 1.0),
        logits_scaling=get_float(hf, "logits_scaling", 1.0),
    )


def model_config(hf: HFConfig) -> ModelConfig:
    return build(hf, family="granitemoe", **granite_fields(hf))


def shared_model_config(hf: HFConfig) -> ModelConfig:
    return build(hf, family="granitemoeshared", **granite_fields(hf),
                 shared_expert_intermediate_size=get_int(hf, "shared_intermediate_size", 0,
                                                         minimum=0))


CONFIG_FIELDS = {"num_experts": "num_local_experts", "moe_intermediate_size": "intermediate_size",
                 "shared_expert_intermediate_size": "shared_intermediate_size"}

FAMILY = Family(
    model_type="granitemoe",
    model_config=model_config,
    name_map=NAME_MAP,
    fused_experts=FUSED_EXPERTS,
    config_fields=CONFIG_FIELDS,
    description="Granite-MoE (Granite-3.x MoE, PowerMoE): fused experts, muP multipliers",
)

SHARED_FAMILY = Family(
    model_type="granitemoeshared",
    model_config=shared_model_config,
    name_map={**NAME_MAP, **SHARED_NAMES},
    fused_experts=FUSED_EXPERTS,
    config_fields=CONFIG_FIELDS,
    description="Granite-MoE with a shared expert (ungated, fused gate|up)",
)
