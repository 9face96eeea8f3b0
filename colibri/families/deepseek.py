"""What DeepSeek-V2 and -V3 share (deepseek_v2.py, deepseek_v3.py): the checkpoint names of
multi-head latent attention and of the MoE with ungated shared experts, the config fields
of both, and the converter's de-interleaving of the RoPE rows.

Layers below `first_k_dense_replace` have a dense mlp of `intermediate_size`; the others
route to `n_routed_experts` experts of `moe_intermediate_size` and add `n_shared_experts`
shared experts as one ungated SwiGLU of n_shared_experts * moe_intermediate_size (checked
against transformers 5.24 modeling_deepseek_v2.py / modeling_deepseek_v3.py).

RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... of the Dr rotary dims (V2
always, through complex numbers; V3 when `rope_interleave`, the default). The file stores the
rows of q_proj / q_b_proj and kv_a_proj_with_mqa that produce those dims de-interleaved
(evens, then odds): colibri's half-split rotation then gives the same q · k, pair for pair.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..config import ConfigError, ModelConfig
from .base import DENSE_MLP_NAMES, LLAMA_NAMES, QWEN_EXPERT_NAMES
from .config_json import REQUIRED, HFConfig, build, experts, get_bool, get_float, get_int
from .tensors import CanonicalTensor

NAME_MAP = {
    **{k: v for k, v in LLAMA_NAMES.items() if not k.startswith("attn.w")},
    "attn.wq": "self_attn.q_proj.weight",
    "attn.wq_a": "self_attn.q_a_proj.weight",
    "attn.q_a_norm": "self_attn.q_a_layernorm.weight",
    "attn.wq_b": "self_attn.q_b_proj.weight",
    "attn.wkv_a": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "attn.wkv_b": "self_attn.kv_b_proj.weight",
    "attn.wo": "self_attn.o_proj.weight",
    **QWEN_EXPERT_NAMES,
    "moe.shared.w_gate": "mlp.shared_experts.gate_proj.weight",
    "moe.shared.w_up": "mlp.shared_experts.up_proj.weight",
    "moe.shared.w_down": "mlp.shared_experts.down_proj.weight",
    **DENSE_MLP_NAMES,
}

__all__ = ["NAME_MAP", "CONFIG_FIELDS", "REQUIRED", "model_config", "deinterleave_rows",
           "deinterleave_rope"]

CONFIG_FIELDS = {
    "num_experts": "n_routed_experts",
    "head_dim": "qk_rope_head_dim",
    "dense_intermediate_size": "intermediate_size",
    "shared_expert_intermediate_size": "n_shared_experts*moe_intermediate_size",
}


def model_config(hf: HFConfig, family: str, defaults: dict[str, Any], **router: Any
                 ) -> ModelConfig:
    """The ModelConfig of a DeepSeek config.json; `defaults` are the family's config class
    defaults of the fields config.json may leave out, `router` its routing fields (router,
    norm_topk_prob, n_group, topk_group)."""
    if get_bool(hf, "attention_bias", False):
        raise ConfigError(f"config.json: attention_bias=true is not supported for {family}")
    d = defaults
    n_layers = get_int(hf, "num_hidden_layers")
    first_dense = get_int(hf, "first_k_dense_replace", d["first_k_dense_replace"], minimum=0)
    moe_size = get_int(hf, "moe_intermediate_size", d["moe_intermediate_size"])
    shared = get_int(hf, "n_shared_experts", d["n_shared_experts"], minimum=0)
    dense = {} if first_dense == 0 else {
        "dense_intermediate_size": get_int(hf, "intermediate_size", d["intermediate_size"])}
    # q_lora_rank: null means a plain q projection, a missing key the class default
    q_lora = hf.get("q_lora_rank", d["q_lora_rank"])
    rope_dim = get_int(hf, "qk_rope_head_dim", d["qk_rope_head_dim"])
    return build(
        {**hf, "head_dim": rope_dim}, family=family,    # as the config classes set head_dim
        **experts(hf, ("n_routed_experts", "num_local_experts"), d["n_routed_experts"],
                  default_top_k=d["num_experts_per_tok"]),
        moe_intermediate_size=moe_size,
        moe_layers=tuple(range(min(first_dense, n_layers), n_layers)),
        **dense,
        shared_expert_intermediate_size=shared * moe_size,
        routed_scaling_factor=get_float(hf, "routed_scaling_factor",
                                        d["routed_scaling_factor"]),
        kv_lora_rank=get_int(hf, "kv_lora_rank", d["kv_lora_rank"]),
        q_lora_rank=get_int({"q_lora_rank": q_lora}, "q_lora_rank", 0, minimum=0),
        qk_nope_head_dim=get_int(hf, "qk_nope_head_dim", d["qk_nope_head_dim"]),
        v_head_dim=get_int(hf, "v_head_dim", d["v_head_dim"]),
        **router,
    )


def deinterleave_rows(w: np.ndarray, block: int, rope: int) -> np.ndarray:
    """The rows of w (R, C) in blocks of `block` rows whose last `rope` rows are RoPE pairs
    (x0, x1), (x2, x3), ...: those reordered evens first, then odds (a copy)."""
    order = np.arange(w.shape[0]).reshape(-1, block)
    tail = order[:, block - rope:]
    order[:, block - rope:] = np.concatenate([tail[:, 0::2], tail[:, 1::2]], axis=1)
    return np.ascontiguousarray(w[order.reshape(-1)])


def deinterleave_rope(t: CanonicalTensor, cfg: ModelConfig, hf: HFConfig,
                      a: np.ndarray) -> np.ndarray:
    """Family.transform of an interleaved-RoPE checkpoint (V2; V3 unless rope_interleave is
    false): the rows of the q projection (per head: Dn + Dr) and of kv_a (Rkv + Dr)
    de-interleaved; other tensors as read."""
    if hf.get("model_type") == "deepseek_v3" and not get_bool(hf, "rope_interleave", True):
        return a
    if t.kind in ("attn.wq", "attn.wq_b"):
        return deinterleave_rows(a, cfg.qk_head_dim, cfg.head_dim)
    if t.kind == "attn.wkv_a":
        return deinterleave_rows(a, cfg.kv_lora_rank + cfg.head_dim, cfg.head_dim)
    return a
