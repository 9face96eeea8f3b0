"""GPT-OSS (model_type "gpt_oss", gpt-oss-20b / 120b): biases everywhere, attention sinks,
alternating sliding-window layers, top-k then softmax routing with a router bias, the clamped
swigluoai experts, YaRN.

Router (GptOssTopKRouter): logits = x W^T + b, the k largest, softmax over those k
("topk_softmax", router_bias). Experts (GptOssExperts): gate_up = x W_gu + b_gu with gate and
up **interleaved** (even columns gate, odd up); gate clamped to <= swiglu_limit, up to
[-limit, limit]; (up + 1) * gate * sigmoid(swiglu_alpha * gate); then x W_d + b_d. Attention:
q/k/v/o biases, a learned sink logit per head (`self_attn.sinks`), `layer_types` alternating
sliding (window `sliding_window`) and full attention; RMSNorm; RoPE with YaRN.
Checkpoint layouts: the released checkpoints store the experts as MXFP4,
`mlp.experts.gate_up_proj_blocks` (E, 2I, D/32, 16) + `_scales` (E, 2I, D/32) and
`down_proj_blocks` (E, D, I/32, 16) + `_scales`: the converter keeps those bytes as they are
(the "mxfp4" format, colibri/format/mxfp4.py), splitting gate / up by rows. transformers'
save_pretrained writes them unquantized and transposed: `mlp.experts.gate_up_proj`
(E, D, 2I), `down_proj` (E, I, D); those are de-interleaved and transposed into the canonical
(I, D) / (D, I) matrices. Biases: `gate_up_proj_bias` (E, 2I, interleaved), `down_proj_bias`.
"""
from __future__ import annotations

from ..config import ConfigError, ModelConfig
from .base import LLAMA_NAMES, Family, MxSlice, Slice
from .config_json import HFConfig, build, experts, get_bool, get_float, get_int

_GATE_UP = ("num_experts", "hidden_size", "2*moe_intermediate_size")       # (E, D, 2I)
_GATE_UP_BIAS = ("num_experts", "2*moe_intermediate_size")                 # (E, 2I)
_EVEN, _ODD = slice(0, None, 2), slice(1, None, 2)
# the released MXFP4 experts: blocks (E, R, C/32, 16) and scales (E, R, C/32), R the outputs
_MX_GATE_UP = ("num_experts", "2*moe_intermediate_size", "hidden_size/32", "16")
_MX_DOWN = ("num_experts", "hidden_size", "moe_intermediate_size/32", "16")
_GU_BLOCKS, _GU_SCALES = "mlp.experts.gate_up_proj_blocks", "mlp.experts.gate_up_proj_scales"

NAME_MAP = {
    **LLAMA_NAMES,
    "attn.bq": "self_attn.q_proj.bias",
    "attn.bk": "self_attn.k_proj.bias",
    "attn.bv": "self_attn.v_proj.bias",
    "attn.bo": "self_attn.o_proj.bias",
    "attn.sinks": "self_attn.sinks",
    "moe.router": "mlp.router.weight",
    "moe.router_bias": "mlp.router.bias",
    # MXFP4 as released (kept so), else the unquantized layout save_pretrained writes
    "moe.experts.w_gate": (MxSlice(_GU_BLOCKS, _GU_SCALES, _MX_GATE_UP, ("e", _EVEN)),
                           Slice("mlp.experts.gate_up_proj", _GATE_UP,
                                 ("e", slice(None), _EVEN), transposed=True)),
    "moe.experts.w_up": (MxSlice(_GU_BLOCKS, _GU_SCALES, _MX_GATE_UP, ("e", _ODD)),
                         Slice("mlp.experts.gate_up_proj", _GATE_UP,
                               ("e", slice(None), _ODD), transposed=True)),
    "moe.experts.w_down": (MxSlice("mlp.experts.down_proj_blocks",
                                   "mlp.experts.down_proj_scales", _MX_DOWN, ("e",)),
                           Slice("mlp.experts.down_proj",
                                 ("num_experts", "moe_intermediate_size", "hidden_size"),
                                 ("e",), transposed=True)),
    "moe.b_gate": Slice("mlp.experts.gate_up_proj_bias", _GATE_UP_BIAS,
                        (slice(None), _EVEN)),
    "moe.b_up": Slice("mlp.experts.gate_up_proj_bias", _GATE_UP_BIAS, (slice(None), _ODD)),
    "moe.b_down": "mlp.experts.down_proj_bias",
}


def layer_types(hf: HFConfig, n_layers: int) -> tuple[str, ...]:
    """GptOssConfig's default: sliding on even layers, full on odd ones."""
    types = hf.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                 for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers:
        raise ConfigError(f"config.json: layer_types must list {n_layers} entries "
                          f"(num_hidden_layers), found {types!r}")
    return tuple(types)


def model_config(hf: HFConfig) -> ModelConfig:
    bias = get_bool(hf, "attention_bias", True)
    return build(
        hf, family="gpt_oss", default_rope_theta=150000.0,
        **experts(hf, ("num_local_experts", "num_experts"), 128, default_top_k=4),
        moe_intermediate_size=get_int(hf, "intermediate_size"),
        router="topk_softmax",
        router_bias=True,
        expert_bias=True,
        expert_activation="swigluoai",
        swiglu_alpha=get_float(hf, "swiglu_alpha", 1.702),
        swiglu_limit=get_float(hf, "swiglu_limit", 7.0),
        attention_bias=bias,
        attention_out_bias=bias,
        attention_sinks=True,
        rms_norm_eps=get_float(hf, "rms_norm_eps", 1e-5),
        sliding_window=get_int(hf, "sliding_window", 128),
        layer_types=layer_types(hf, get_int(hf, "num_hidden_layers")),
    )


FAMILY = Family(
    model_type="gpt_oss",
    model_config=model_config,
    name_map=NAME_MAP,
    fused_experts=None,
    config_fields={"num_experts": "num_local_experts",
                   "moe_intermediate_size": "intermediate_size"},
    description="GPT-OSS: attention sinks, swigluoai experts with biases, router bias, YaRN",
)
