"""The canonical tensors of a model (docs/format.md §7): which ones it has and their shapes, following
from its ModelConfig alone, the same for every family.

    for t in canonical_tensors(cfg): t.name, t.shape, t.dims    # "layers.3.attn.wq", ...

Shapes in the package's alphabet: V vocab, D hidden, H / Hkv heads, Dh head dim, E experts,
I expert intermediate, Is shared-expert intermediate, Id dense-mlp intermediate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import ModelConfig

EXPERT_PROJS = ("w_gate", "w_up", "w_down")

# Each dimension is a product of ModelConfig fields (or integer literals); kept as text so a
# shape mismatch can say which config fields it came from.
DIMS: dict[str, tuple[str, ...]] = {
    "tok_embeddings": ("vocab_size", "hidden_size"),                      # (V, D)
    "norm": ("hidden_size",),                                             # (D,)
    "lm_head": ("vocab_size", "hidden_size"),                             # (V, D)
    "attn_norm": ("hidden_size",),
    "ffn_norm": ("hidden_size",),
    "attn_norm_bias": ("hidden_size",),                                   # LayerNorm biases
    "ffn_norm_bias": ("hidden_size",),
    "norm_bias": ("hidden_size",),
    "lm_head_bias": ("vocab_size",),                                      # (V,)
    "attn.wq": ("num_attention_heads*head_dim", "hidden_size"),          # (H*Dh, D)
    "attn.wk": ("num_key_value_heads*head_dim", "hidden_size"),          # (Hkv*Dh, D)
    "attn.wv": ("num_key_value_heads*head_dim", "hidden_size"),          # (Hkv*Dh, D)
    "attn.wo": ("hidden_size", "num_attention_heads*head_dim"),          # (D, H*Dh)
    "attn.bq": ("num_attention_heads*head_dim",),
    "attn.bk": ("num_key_value_heads*head_dim",),
    "attn.bv": ("num_key_value_heads*head_dim",),
    "attn.bo": ("hidden_size",),
    "attn.sinks": ("num_attention_heads",),                              # (H,) GPT-OSS
    "attn.q_norm/full": ("num_attention_heads*head_dim",),               # OLMoE
    "attn.k_norm/full": ("num_key_value_heads*head_dim",),
    "attn.q_norm/per_head": ("head_dim",),                               # Qwen3
    "attn.k_norm/per_head": ("head_dim",),
    # multi-head latent attention (DeepSeek): Rq q_lora_rank, Rkv kv_lora_rank, Dr = head_dim
    "attn.wq/mla": ("num_attention_heads*qk_head_dim", "hidden_size"),   # (H*(Dn+Dr), D)
    "attn.wq_a": ("q_lora_rank", "hidden_size"),                         # (Rq, D)
    "attn.q_a_norm": ("q_lora_rank",),
    "attn.wq_b": ("num_attention_heads*qk_head_dim", "q_lora_rank"),     # (H*(Dn+Dr), Rq)
    "attn.wkv_a": ("kv_lora_rank+head_dim", "hidden_size"),              # (Rkv+Dr, D)
    "attn.kv_a_norm": ("kv_lora_rank",),
    "attn.wkv_b": ("num_attention_heads*qk_nope_head_dim+num_attention_heads*v_head_dim",
                   "kv_lora_rank"),                                      # (H*(Dn+Dv), Rkv)
    "attn.wo/mla": ("hidden_size", "num_attention_heads*v_head_dim"),   # (D, H*Dv)
    "moe.router": ("num_experts", "hidden_size"),                        # (E, D)
    "moe.correction_bias": ("num_experts",),                             # sigmoid_group_topk
    "moe.router_bias": ("num_experts",),                                  # (E,)
    "moe.b_gate": ("num_experts", "moe_intermediate_size"),              # (E, I) expert biases
    "moe.b_up": ("num_experts", "moe_intermediate_size"),
    "moe.b_down": ("num_experts", "hidden_size"),                        # (E, D)
    "moe.experts.w_gate": ("moe_intermediate_size", "hidden_size"),      # (I, D)
    "moe.experts.w_up": ("moe_intermediate_size", "hidden_size"),        # (I, D)
    "moe.experts.w_down": ("hidden_size", "moe_intermediate_size"),      # (D, I)
    "moe.shared.w_gate": ("shared_expert_intermediate_size", "hidden_size"),  # (Is, D)
    "moe.shared.w_up": ("shared_expert_intermediate_size", "hidden_size"),
    "moe.shared.w_down": ("hidden_size", "shared_expert_intermediate_size"),
    "moe.shared_gate": ("1", "hidden_size"),                             # (1, D)
    "mlp.w_gate": ("dense_intermediate_size", "hidden_size"),            # (Id, D)
    "mlp.w_up": ("dense_intermediate_size", "hidden_size"),
    "mlp.w_down": ("hidden_size", "dense_intermediate_size"),            # (D, Id)
}


def eval_dim(expr: str, cfg: ModelConfig) -> int:
    """'num_attention_heads*head_dim' -> H*Dh of `cfg`; a sum of such products ('a*b+c',
    a fused tensor's rows) -> their sum; a factor 'field/n' is the field divided by n (MXFP4
    blocks of 32)."""
    total = 0
    for term in expr.split("+"):
        out = 1
        for factor in term.split("*"):
            out *= _factor(factor, cfg)
        total += out
    return total


def _factor(factor: str, cfg: ModelConfig) -> int:
    name, _, div = factor.partition("/")
    value = int(name) if name.isdigit() else int(getattr(cfg, name))
    return value // int(div) if div else value


@dataclass(frozen=True)
class CanonicalTensor:
    """One tensor of the .colibri file, as the ModelConfig implies it."""
    name: str                      # e.g. "layers.3.moe.experts.5.w_up"
    shape: tuple[int, ...]
    dims: tuple[str, ...]          # ModelConfig-field expression behind each dimension
    kind: str                      # key of the name map: "attn.wq", "moe.experts.w_up", ...
    layer: int | None = None
    expert: int | None = None
    proj: str | None = None        # "w_gate" | "w_up" | "w_down" for routed experts


def canonical_tensors(cfg: ModelConfig) -> list[CanonicalTensor]:
    """Every tensor a model with this config has, in model order (embedding, layers, head)."""
    out: list[CanonicalTensor] = []

    def add(name: str, kind: str, dims_key: str | None = None, **where: Any) -> None:
        dims = DIMS[dims_key or kind]
        out.append(CanonicalTensor(name, tuple(eval_dim(d, cfg) for d in dims), dims, kind,
                                   **where))

    add("tok_embeddings", "tok_embeddings")
    moe_layers = set(cfg.moe_layer_ids)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        add(p + "attn_norm", "attn_norm", layer=i)
        if cfg.norm_bias:
            add(p + "attn_norm_bias", "attn_norm_bias", layer=i)
        if cfg.is_mla:
            _mla_tensors(add, p, i, cfg)
        for w in () if cfg.is_mla else ("wq", "wk", "wv", "wo"):
            add(p + "attn." + w, "attn." + w, layer=i)
        if cfg.attention_bias:
            for b in ("bq", "bk", "bv"):
                add(p + "attn." + b, "attn." + b, layer=i)
        if cfg.attention_out_bias:
            add(p + "attn.bo", "attn.bo", layer=i)
        if cfg.attention_sinks:
            add(p + "attn.sinks", "attn.sinks", layer=i)
        if cfg.qk_norm != "none":
            for n in ("q_norm", "k_norm"):
                add(p + "attn." + n, "attn." + n, f"attn.{n}/{cfg.qk_norm}", layer=i)
        add(p + "ffn_norm", "ffn_norm", layer=i)
        if cfg.norm_bias:
            add(p + "ffn_norm_bias", "ffn_norm_bias", layer=i)
        if i in moe_layers:
            add(p + "moe.router", "moe.router", layer=i)
            if cfg.router == "sigmoid_group_topk":
                add(p + "moe.correction_bias", "moe.correction_bias", layer=i)
            if cfg.router_bias:
                add(p + "moe.router_bias", "moe.router_bias", layer=i)
            if cfg.expert_bias:
                for b in ("b_gate", "b_up", "b_down"):
                    add(p + "moe." + b, "moe." + b, layer=i)
            for e in range(cfg.num_experts):
                for w in EXPERT_PROJS:
                    add(f"{p}moe.experts.{e}.{w}", "moe.experts." + w, layer=i, expert=e, proj=w)
            if cfg.has_shared_expert:
                for w in EXPERT_PROJS:
                    add(p + "moe.shared." + w, "moe.shared." + w, layer=i)
                if cfg.shared_expert_gate:
                    add(p + "moe.shared_gate", "moe.shared_gate", layer=i)
        else:
            for w in EXPERT_PROJS:
                add(p + "mlp." + w, "mlp." + w, layer=i)
    add("norm", "norm")
    if cfg.norm_bias:
        add("norm_bias", "norm_bias")
    if not cfg.tie_word_embeddings:
        add("lm_head", "lm_head")
    if cfg.lm_head_bias:
        add("lm_head_bias", "lm_head_bias")
    return out


def _mla_tensors(add, p: str, i: int, cfg: ModelConfig) -> None:
    """The attention tensors of an MLA layer (colibri/engine/mla.py), in data-flow order."""
    if cfg.q_lora_rank:
        for kind in ("attn.wq_a", "attn.q_a_norm", "attn.wq_b"):
            add(p + kind, kind, layer=i)
    else:
        add(p + "attn.wq", "attn.wq", "attn.wq/mla", layer=i)
    for kind in ("attn.wkv_a", "attn.kv_a_norm", "attn.wkv_b"):
        add(p + kind, kind, layer=i)
    add(p + "attn.wo", "attn.wo", "attn.wo/mla", layer=i)
