"""Qwen2-MoE (model_type "qwen2_moe", Qwen1.5-MoE): routed experts + one sigmoid-gated shared
expert, q/k/v biases, optional dense layers.

Router: softmax over all E in f32, top-k, renormalised only if `norm_topk_prob`. The MoE output
is routed + sigmoid(x · shared_expert_gate) * shared_expert(x). A layer is an MoE layer unless
it is in `mlp_only_layers` or (i + 1) % `decoder_sparse_step` != 0; dense layers have an mlp of
size `intermediate_size`. Sliding-window attention applies only when `use_sliding_window`, and
then to the layers whose `layer_types` entry is "sliding_attention".
"""
from __future__ import annotations

from ..config import ConfigError, ModelConfig
from .base import DENSE_MLP_NAMES, LLAMA_NAMES, QWEN_EXPERT_NAMES, Family
from .config_json import (HFConfig, build, experts, get_bool, get_int, qwen_window,
                          sparse_layers)

NAME_MAP = {
    **LLAMA_NAMES,
    "attn.bq": "self_attn.q_proj.bias",
    "attn.bk": "self_attn.k_proj.bias",
    "attn.bv": "self_attn.v_proj.bias",
    **QWEN_EXPERT_NAMES,
    "moe.shared.w_gate": "mlp.shared_expert.gate_proj.weight",
    "moe.shared.w_up": "mlp.shared_expert.up_proj.weight",
    "moe.shared.w_down": "mlp.shared_expert.down_proj.weight",
    "moe.shared_gate": "mlp.shared_expert_gate.weight",
    **DENSE_MLP_NAMES,
}


def layer_types(hf: HFConfig) -> tuple[str, ...]:
    """Per-layer attention type, as Qwen2MoeConfig derives it when config.json has none."""
    n_layers = get_int(hf, "num_hidden_layers")
    types = hf.get("layer_types")
    if types is None:
        use = get_bool(hf, "use_sliding_window", False)
        max_window = get_int(hf, "max_window_layers", 28, minimum=0)
        types = ["sliding_attention" if use and (i + 1) % 2 and i < max_window
                 else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers:
        raise ConfigError(f"config.json: layer_types must list {n_layers} entries "
                          f"(num_hidden_layers), found {types!r}")
    return tuple(types)


def model_config(hf: HFConfig) -> ModelConfig:
    shared = get_int(hf, "shared_expert_intermediate_size", 0, minimum=0)
    return build(
        hf, family="qwen2_moe",
        **experts(hf, ("num_experts", "num_local_experts"), 60, default_top_k=4),
        **sparse_layers(hf),
        moe_intermediate_size=get_int(hf, "moe_intermediate_size"),
        norm_topk_prob=get_bool(hf, "norm_topk_prob", False),
        shared_expert_intermediate_size=shared,
        shared_expert_gate=shared > 0,
        # Qwen1.5 always has q/k/v biases; transformers 5 names the switch qkv_bias
        attention_bias=get_bool(hf, "qkv_bias", True),
        sliding_window=qwen_window(hf),
        layer_types=layer_types(hf),
    )


FAMILY = Family(
    model_type="qwen2_moe",
    model_config=model_config,
    name_map=NAME_MAP,
    config_fields={"dense_intermediate_size": "intermediate_size",
                   "attention_bias": "qkv_bias"},
    description="Qwen1.5-MoE (Qwen2-MoE): shared expert, q/k/v biases",
)
