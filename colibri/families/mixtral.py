"""Mixtral (model_type "mixtral"): 8 experts top-2, no shared expert, no biases, no q/k norm.

Router: softmax over all E in f32, top-k, renormalised to sum 1 (MixtralTopKRouter).
Config names differ from the canonical ones: `num_local_experts` is E and `intermediate_size`
is the expert size I. Every layer is an MoE layer; a sliding window applies to every layer.
"""
from __future__ import annotations

from ..config import ModelConfig
from .base import LLAMA_NAMES, Family
from .config_json import HFConfig, build, experts, get_int

# canonical kind -> checkpoint key (per-layer keys relative to "model.layers.{i}.")
NAME_MAP = {
    **LLAMA_NAMES,
    # hub checkpoints say block_sparse_moe; transformers 5 module names say mlp
    "moe.router": ("block_sparse_moe.gate.weight", "mlp.gate.weight"),
    "moe.experts.w_gate": "block_sparse_moe.experts.{e}.w1.weight",
    "moe.experts.w_up": "block_sparse_moe.experts.{e}.w3.weight",
    "moe.experts.w_down": "block_sparse_moe.experts.{e}.w2.weight",
}


def model_config(hf: HFConfig) -> ModelConfig:
    window = hf.get("sliding_window") or None          # 0 and null both mean "none"
    return build(
        hf, family="mixtral", default_rope_theta=1e6,
        **experts(hf, ("num_local_experts", "num_experts"), 8, default_top_k=2),
        moe_intermediate_size=get_int(hf, "intermediate_size"),
        norm_topk_prob=True,
        sliding_window=get_int({"sliding_window": window}, "sliding_window", None),
    )


FAMILY = Family(
    model_type="mixtral",
    model_config=model_config,
    name_map=NAME_MAP,
    config_fields={"num_experts": "num_local_experts",
                   "moe_intermediate_size": "intermediate_size"},
    description="Mixtral-8x7B / 8x22B and Mixtral-architecture models",
)
