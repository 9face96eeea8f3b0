"""DeepSeek-V3 (model_type "deepseek_v3", DeepSeek-V3 / R1, Moonlight, Kimi-K2): DeepSeek-V2's
layers (deepseek.py) with sigmoid routing.

Router (DeepseekV3TopkRouter, transformers 5.24), "sigmoid_group_topk": s = sigmoid(logits)
in f32; choice scores c = s + `e_score_correction_bias` (E,); a group scores the sum of its
two largest c; the `topk_group` best of `n_group` groups are kept; top-k of c; the weights
are s (not c) of those, divided by (their sum + 1e-20) when `norm_topk_prob`, times
`routed_scaling_factor`. RoPE pairs are interleaved when `rope_interleave` (default true;
the converter de-interleaves), else half-split. Layers past num_hidden_layers in a release
checkpoint (multi-token prediction) are not part of the model and are skipped.
"""
from __future__ import annotations

import re

from ..config import ModelConfig
from . import deepseek
from .base import Family
from .config_json import HFConfig, get_bool, get_int

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


# DeepseekV3Config's defaults of the fields a config.json may leave out
DEFAULTS = dict(first_k_dense_replace=3, moe_intermediate_size=2048, n_shared_experts=1,
                intermediate_size=18432, q_lora_rank=1536, n_routed_experts=256,
                num_experts_per_tok=8, routed_scaling_factor=2.5, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def model_config(hf: HFConfig) -> ModelConfig:
    return deepseek.model_config(
        hf, "deepseek_v3", DEFAULTS, router="sigmoid_group_topk",
        norm_topk_prob=get_bool(hf, "norm_topk_prob", True),
        n_group=get_int(hf, "n_group", 8), topk_group=get_int(hf, "topk_group", 4))


def ignores(key: str, cfg: ModelConfig) -> bool:
    """The multi-token-prediction layers (model.layers.N for N >= num_hidden_layers)."""
    m = _LAYER.match(key)
    return m is not None and int(m.group(1)) >= cfg.num_hidden_layers


NAME_MAP = {**deepseek.NAME_MAP, "moe.correction_bias": "mlp.gate.e_score_correction_bias"}

FAMILY = Family(
    model_type="deepseek_v3",
    model_config=model_config,
    name_map=NAME_MAP,
    config_fields=deepseek.CONFIG_FIELDS,
    description="DeepSeek-V3 / R1 / Kimi-K2 / Moonlight: MLA, sigmoid group routing",
    transform=deepseek.deinterleave_rope,
    ignores=ignores,
)
