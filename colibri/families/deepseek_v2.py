"""DeepSeek-V2 (model_type "deepseek_v2", DeepSeek-V2 / -Lite / -Coder-V2): multi-head
latent attention, dense first layers, routed + ungated shared experts (deepseek.py).

Router (DeepseekV2TopkRouter, transformers 5.24): softmax over all E in f32; `topk_method`
"greedy" takes the top k of it ("softmax_topk"), "group_limited_greedy" first keeps the
`topk_group` of `n_group` groups with the largest single score ("softmax_group_topk");
the weights are never renormalised (`norm_topk_prob` is ignored) and are multiplied by
`routed_scaling_factor`. RoPE pairs are always interleaved (the converter de-interleaves).
"""
from __future__ import annotations

from ..config import ConfigError, ModelConfig
from . import deepseek
from .base import Family
from .config_json import HFConfig, get_int


# DeepseekV2Config's defaults of the fields a config.json may leave out (num_experts_per_tok
# has none there: it must be given)
DEFAULTS = dict(first_k_dense_replace=0, moe_intermediate_size=1407, n_shared_experts=2,
                intermediate_size=11008, q_lora_rank=1536, n_routed_experts=64,
                num_experts_per_tok=deepseek.REQUIRED, routed_scaling_factor=1.0,
                kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def model_config(hf: HFConfig) -> ModelConfig:
    method = hf.get("topk_method") or "greedy"
    if method == "greedy":
        router = dict(router="softmax_topk")
    elif method == "group_limited_greedy":
        router = dict(router="softmax_group_topk", n_group=get_int(hf, "n_group"),
                      topk_group=get_int(hf, "topk_group"))
    else:
        raise ConfigError(f"config.json: topk_method {method!r} is not supported for "
                          f"deepseek_v2 (supported: greedy, group_limited_greedy)")
    return deepseek.model_config(hf, "deepseek_v2", DEFAULTS, norm_topk_prob=False, **router)


FAMILY = Family(
    model_type="deepseek_v2",
    model_config=model_config,
    name_map=deepseek.NAME_MAP,
    config_fields=deepseek.CONFIG_FIELDS,
    description="DeepSeek-V2 / V2-Lite: MLA, shared experts, greedy or group-limited routing",
    transform=deepseek.deinterleave_rope,
)
