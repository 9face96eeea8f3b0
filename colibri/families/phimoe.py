"""PhiMoE (model_type "phimoe", Phi-3.5-MoE): sparsemixer top-2 routing, LayerNorm with bias,
attention and head biases, LongRoPE.

Router: PhiMoE's sparsemixer at inference (rule "sparsemixer", transformers' sparsemixer with
training=False): the top expert, a softmax over the experts within a relative threshold
2 * router_jitter_noise of it, then the same for the second expert with the first masked;
not the softmax over the top-2 logits some engines approximate it with. Experts as Mixtral
(`block_sparse_moe.experts.{e}.w1/w3/w2`, router `block_sparse_moe.gate`). Norms are
nn.LayerNorm with weight and bias, eps `rms_norm_eps`; `attention_bias` adds q/k/v/o biases;
`lm_head_bias` the head's. RoPE scaling "longrope" (short/long factors and mscales); a
top-level `original_max_position_embeddings` fills in the scaling entry's when it lacks one.
A sliding window, when set, applies to every layer.
"""
from __future__ import annotations

from ..config import ModelConfig
from .base import LLAMA_NAMES, Family
from .config_json import HFConfig, build, experts, get_bool, get_float, get_int, rope

NAME_MAP = {
    **LLAMA_NAMES,
    "attn_norm_bias": "input_layernorm.bias",
    "ffn_norm_bias": "post_attention_layernorm.bias",
    "norm_bias": "model.norm.bias",
    "lm_head_bias": "lm_head.bias",
    "attn.bq": "self_attn.q_proj.bias",
    "attn.bk": "self_attn.k_proj.bias",
    "attn.bv": "self_attn.v_proj.bias",
    "attn.bo": "self_attn.o_proj.bias",
    "moe.router": "block_sparse_moe.gate.weight",
    "moe.experts.w_gate": "block_sparse_moe.experts.{e}.w1.weight",
    "moe.experts.w_up": "block_sparse_moe.experts.{e}.w3.weight",
    "moe.experts.w_down": "block_sparse_moe.experts.{e}.w2.weight",
}


def model_config(hf: HFConfig) -> ModelConfig:
    bias = get_bool(hf, "attention_bias", False)
    _, scaling = rope(hf, 1e6)
    fields = {}
    if scaling is not None and scaling.get("rope_type") in ("longrope", "su"):
        if "original_max_position_embeddings" not in scaling:
            scaling["original_max_position_embeddings"] = get_int(
                hf, "original_max_position_embeddings")
        fields["rope_scaling"] = scaling
    window = hf.get("sliding_window") or None
    return build(
        hf, family="phimoe", default_rope_theta=1e6,
        **experts(hf, ("num_local_experts", "num_experts"), 16, default_top_k=2),
        moe_intermediate_size=get_int(hf, "intermediate_size"),
        router="sparsemixer",
        router_jitter_noise=get_float(hf, "router_jitter_noise", 0.01),
        norm="layer_norm",
        norm_bias=True,
        rms_norm_eps=get_float(hf, "rms_norm_eps", 1e-5),
        attention_bias=bias,
        attention_out_bias=bias,
        lm_head_bias=get_bool(hf, "lm_head_bias", False),
        sliding_window=get_int({"sliding_window": window}, "sliding_window", None),
        **fields,
    )


FAMILY = Family(
    model_type="phimoe",
    model_config=model_config,
    name_map=NAME_MAP,
    fused_experts=None,
    config_fields={"num_experts": "num_local_experts",
                   "moe_intermediate_size": "intermediate_size"},
    description="PhiMoE (Phi-3.5-MoE): sparsemixer routing, LayerNorm with bias, LongRoPE",
)
