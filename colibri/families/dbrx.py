"""DBRX (model_type "dbrx"): fused Wqkv with clip_qkv, experts fused in the checkpoint (w2
stored transposed), L1-normalised top-k weights, LayerNorm without bias.

config.json nests the attention and FFN settings: `attn_config` {kv_n_heads, clip_qkv,
rope_theta}, `ffn_config` {ffn_hidden_size (I), moe_num_experts, moe_top_k,
moe_normalize_expert_weights, ffn_act_fn}; the top level says d_model, n_heads, n_layers,
max_seq_len. Router (DbrxFFN.route_tokens_to_experts): softmax over all E, top-k, divided by
the p-norm of the k with p = moe_normalize_expert_weights; p = 1 (the release) is the sum, the
"softmax_topk" rule renormalised; no other p is supported. Checkpoint (save_pretrained and the
hub alike): `transformer.blocks.N.norm_attn_norm.attn.Wqkv.weight` ((H + 2 Hkv) Dh, D), q rows
first; `ffn.experts.mlp.{w1, v1, w2}` (E*I, D) each: w1 the gates, v1 the ups, w2 the downs
transposed (expert e's rows e*I..(e+1)*I are its (I, D) = down^T). LayerNorms (norm_1, norm_2,
norm_f) have weights only, eps 1e-5 (nn.LayerNorm's default). RoPE theta: rope_parameters
when config.json has it (transformers 5 writes it), else attn_config.rope_theta (hub configs).
"""
from __future__ import annotations

from ..config import ConfigError, ModelConfig
from .base import Family, Rows
from .config_json import HFConfig, build, get_float, get_int

_QKV = ("num_attention_heads*head_dim", "num_key_value_heads*head_dim",
        "num_key_value_heads*head_dim")
_WQKV = "norm_attn_norm.attn.Wqkv.weight"
_EXPERT = ("moe_intermediate_size",)

NAME_MAP = {
    "tok_embeddings": "transformer.wte.weight",
    "norm": "transformer.norm_f.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "norm_attn_norm.norm_1.weight",
    "ffn_norm": "norm_attn_norm.norm_2.weight",
    "attn.wq": Rows(_WQKV, _QKV, 0),
    "attn.wk": Rows(_WQKV, _QKV, 1),
    "attn.wv": Rows(_WQKV, _QKV, 2),
    "attn.wo": "norm_attn_norm.attn.out_proj.weight",
    "moe.router": "ffn.router.layer.weight",
    "moe.experts.w_gate": Rows("ffn.experts.mlp.w1", _EXPERT, "e"),
    "moe.experts.w_up": Rows("ffn.experts.mlp.v1", _EXPERT, "e"),
    "moe.experts.w_down": Rows("ffn.experts.mlp.w2", _EXPERT, "e", transposed=True),
}


def _section(hf: HFConfig, name: str) -> dict:
    v = hf.get(name) or {}
    if not isinstance(v, dict):
        raise ConfigError(f"config.json: field {name!r} must be an object, found {v!r}")
    return v


def model_config(hf: HFConfig) -> ModelConfig:
    attn, ffn = _section(hf, "attn_config"), _section(hf, "ffn_config")
    act = (ffn.get("ffn_act_fn") or {}).get("name", "silu")
    p = ffn.get("moe_normalize_expert_weights", 1.0)
    if p is not None and p != 1:
        raise ConfigError(f"config.json: ffn_config.moe_normalize_expert_weights {p!r} is not "
                          f"supported (1: the L1 norm, or null)")
    heads = get_int(hf, "n_heads")
    clip = get_float(attn, "clip_qkv", None)
    if clip is not None and clip <= 0:
        raise ConfigError(f"config.json: attn_config.clip_qkv must be positive or null, "
                          f"found {clip}")
    # the field names every family reads, under DBRX's spellings
    flat = dict(hf, hidden_size=get_int(hf, "d_model"), num_attention_heads=heads,
                num_key_value_heads=get_int(attn, "kv_n_heads", 1),
                num_hidden_layers=get_int(hf, "n_layers"),
                max_position_embeddings=get_int(hf, "max_seq_len", 2048),
                hidden_act=act, head_dim=None,
                rope_theta=get_float(attn, "rope_theta", 10000.0),
                rms_norm_eps=1e-5)
    n_experts = get_int(ffn, "moe_num_experts", 4)
    top_k = get_int(ffn, "moe_top_k", 1)
    if top_k > n_experts:
        raise ConfigError(f"config.json: ffn_config.moe_top_k {top_k} exceeds moe_num_experts "
                          f"{n_experts}")
    return build(
        flat, family="dbrx",
        num_experts=n_experts, num_experts_per_tok=top_k,
        moe_intermediate_size=get_int(ffn, "ffn_hidden_size"),
        norm_topk_prob=p is not None,
        clip_qkv=clip,
        norm="layer_norm",
    )


FAMILY = Family(
    model_type="dbrx",
    model_config=model_config,
    name_map=NAME_MAP,
    fused_experts=None,
    layer_prefix="transformer.blocks.{i}.",
    config_fields={"hidden_size": "d_model", "num_attention_heads": "n_heads",
                   "num_key_value_heads": "attn_config.kv_n_heads",
                   "num_hidden_layers": "n_layers",
                   "num_experts": "ffn_config.moe_num_experts",
                   "moe_intermediate_size": "ffn_config.ffn_hidden_size"},
    description="DBRX: fused Wqkv with clip_qkv, fused experts (w2 transposed), LayerNorm",
)
