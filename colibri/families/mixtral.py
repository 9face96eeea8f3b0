"""Mixtral (model_type "mixtral"): 8 experts top-2, no shared expert, no biases, no q/k norm.

Router: softmax over all E in f32, top-k, renormalised to sum 1 (MixtralTopKRouter).
Config names differ from the canonical ones: `num_local_experts` is E and `intermediate_size`
is the expert size I. Every layer is an MoE layer.
"""
from __future__ import annotations

from typing import Any, Mapping

from .base import LLAMA_NAMES, Family, check_experts, common_arch, get_int

# canonical kind -> checkpoint key (per-layer keys relative to "model.layers.{i}.")
NAME_MAP = {
    **LLAMA_NAMES,
    # hub checkpoints say block_sparse_moe; transformers 5 module names say mlp
    "moe.router": ("block_sparse_moe.gate.weight", "mlp.gate.weight"),
    "moe.experts.w_gate": "block_sparse_moe.experts.{e}.w1.weight",
    "moe.experts.w_up": "block_sparse_moe.experts.{e}.w3.weight",
    "moe.experts.w_down": "block_sparse_moe.experts.{e}.w2.weight",
}


def arch(config: Mapping[str, Any]) -> dict:
    a = common_arch(config, family="mixtral", default_theta=1e6)
    n_experts = get_int(config, "num_local_experts", config.get("num_experts", 8))
    top_k = get_int(config, "num_experts_per_tok", 2)
    check_experts(n_experts, top_k, "num_local_experts")
    sliding = config.get("sliding_window") or None      # 0 and null both mean "none"
    a.update(
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=get_int(config, "intermediate_size"),
        norm_topk_prob=True,
        shared_expert_intermediate_size=0,
        shared_expert_gate=False,
        moe_layers=list(range(a["num_hidden_layers"])),
        dense_intermediate_size=0,
        attention_bias=False,
        qk_norm="none",
        clip_qkv=None,
        sliding_window=get_int({"sliding_window": sliding}, "sliding_window", None),
        layer_types=None,
    )
    return a


FAMILY = Family(
    model_type="mixtral",
    arch=arch,
    name_map=NAME_MAP,
    config_fields={"num_experts": "num_local_experts",
                   "moe_intermediate_size": "intermediate_size"},
    description="Mixtral-8x7B / 8x22B and Mixtral-architecture models",
)
