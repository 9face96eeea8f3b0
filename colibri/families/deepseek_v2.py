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
    return deepseek.model_config(hf, "deepseek_v2", norm_topk_prob=False, **router)


FAMILY = Family(
    model_type="deepseek_v2",
    model_config=model_config,
    name_map=deepseek.NAME_MAP,
    config_fields=deepseek.CONFIG_FIELDS,
    description="DeepSeek-V2 / V2-Lite: MLA, shared experts, greedy or group-limited routing",
    transform=deepseek.deinterleave_rope,
)
