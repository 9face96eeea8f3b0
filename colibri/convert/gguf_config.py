"""A GGUF file's metadata as the config.json of the same model, so the families (one place for
every rule) turn it into the ModelConfig, and its tokenizer as Hugging Face files.

    meta = GGUFMeta(path, reader)
    hf = hf_config(meta)                    # {"model_type": "qwen3_moe", "hidden_size": ...}
    files = tokenizer_files(path, meta)     # {"tokenizer.json": ..., ...} or None

llama.cpp's converter (convert_hf_to_gguf.py) writes `<arch>.block_count`, `.expert_count`, ...
from config.json; this is that mapping read backwards (docs/format.md §14). What
the converter does not write, llama.cpp's runtime fixes per architecture, and so does this:
top-k renormalisation (qwen3moe and llama yes, qwen2moe / olmoe no), RoPE theta 10000 when
absent, DeepSeek-V2 greedy routing unless the file gives expert groups.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any

from ..errors import ColibriError
from .checks import ConversionWarning

# GGUF general.architecture -> the family's model_type (deepseek2 may also be deepseek_v3)
ARCHITECTURES = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
                 "olmoe": "olmoe", "deepseek2": "deepseek_v2"}
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2          # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                   "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


class GGUFMeta:
    """The key/value metadata of an open GGUFReader, read on demand (the token list of a big
    vocabulary is ~150k strings: only the tokenizer reads it)."""

    def __init__(self, path: str | os.PathLike, reader: Any):
        self.path, self.fields = os.fspath(path), reader.fields
        # logical (NumPy-order) shape of each tensor: GGUF lists ne0 (the columns) first
        self.shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
        self.tensor_names = set(self.shapes)
        self.arch = self.get("general.architecture")
        if not isinstance(self.arch, str):
            raise ColibriError(f"{self.path}: GGUF metadata has no general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:                   # noqa: BLE001 - a malformed field
            raise ColibriError(f"{self.path}: GGUF metadata field {key!r} is unreadable "
                               f"({e})") from None

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.arch_get(key)
        if value is None:
            raise ColibriError(f"{self.path}: GGUF metadata field {self.arch}.{key} is "
                               f"missing (needed for {self.arch})")
        return value


def _layers_with(meta: GGUFMeta, suffix: str, n_layers: int) -> list[int]:
    return [i for i in range(n_layers) if f"blk.{i}.{suffix}" in meta.tensor_names]


def _rope_scaling(meta: GGUFMeta) -> dict | None:
    kind = meta.arch_get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = meta.arch_get("rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = meta.arch_get("rope.scaling.original_context_length")
        out = {"rope_type": "yarn", "factor": factor,
               "original_max_position_embeddings": original}
        log_mul = meta.arch_get("rope.scaling.yarn_log_multiplier")
        if log_mul is not None:            # llama.cpp stores 0.1 * mscale_all_dim (DeepSeek)
            out["mscale"] = out["mscale_all_dim"] = float(log_mul) / 0.1
        return out
    raise ColibriError(f"{meta.path}: GGUF rope scaling {kind!r} is not supported "
                       f"(supported: none, linear, yarn)")


def hf_config(meta: GGUFMeta) -> dict:
    """The config.json fields of the model a GGUF file holds (model_type included)."""
    arch = meta.arch
    if arch not in ARCHITECTURES:
        raise ColibriError(f"{meta.path}: GGUF architecture {arch!r} is not supported; "
                           f"supported: {', '.join(sorted(ARCHITECTURES))}")
    n_layers = meta.require("block_count")
    heads = meta.require("attention.head_count")
    kv_heads = meta.arch_get("attention.head_count_kv", heads)
    if not isinstance(kv_heads, int):
        raise ColibriError(f"{meta.path}: per-layer {arch}.attention.head_count_kv is not "
                           f"supported")
    embd = meta.shapes.get("token_embd.weight")
    hf: dict[str, Any] = dict(
        model_type=ARCHITECTURES[arch],
        vocab_size=meta.arch_get("vocab_size") or (embd[0] if embd else None),
        hidden_size=meta.require("embedding_length"),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=meta.arch_get("context_length", 4096),
        rms_norm_eps=meta.arch_get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=meta.arch_get("rope.freq_base", 10000.0),      # llama.cpp's default
        rope_scaling=_rope_scaling(meta),
        num_experts_per_tok=meta.require("expert_used_count"),
        tie_word_embeddings="output.weight" not in meta.tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        hidden_act="silu",
    )
    if hf["vocab_size"] is None:
        raise ColibriError(f"{meta.path}: GGUF has neither {arch}.vocab_size nor "
                           f"token_embd.weight")
    if arch != "deepseek2" and meta.arch_get("attention.key_length") is not None:
        hf["head_dim"] = meta.arch_get("attention.key_length")
    n_experts = meta.require("expert_count")
    expert_ff = meta.arch_get("expert_feed_forward_length")
    ff = meta.arch_get("feed_forward_length")
    moe = _layers_with(meta, "ffn_gate_inp.weight", n_layers)
    dense = [i for i in range(n_layers) if i not in moe]
    if arch == "llama":
        if not n_experts:
            raise ColibriError(f"{meta.path}: a llama GGUF without experts (a dense Llama) is "
                               f"not an MoE model; colibri runs MoE models")
        hf.update(num_local_experts=n_experts, intermediate_size=expert_ff or ff)
    elif arch in ("qwen2moe", "qwen3moe"):
        hf.update(num_experts=n_experts, moe_intermediate_size=expert_ff or ff,
                  intermediate_size=ff, mlp_only_layers=dense,
                  norm_topk_prob=bool(meta.arch_get("expert_weights_norm", arch == "qwen3moe")))
        if arch == "qwen2moe":
            shared = _layers_with(meta, "ffn_gate_shexp.weight", n_layers)
            hf["shared_expert_intermediate_size"] = (
                meta.arch_get("expert_shared_feed_forward_length", 0) if shared else 0)
            hf["qkv_bias"] = "blk.0.attn_q.bias" in meta.tensor_names
    elif arch == "olmoe":
        hf.update(num_experts=n_experts, intermediate_size=expert_ff or ff,
                  norm_topk_prob=bool(meta.arch_get("expert_weights_norm", False)),
                  clip_qkv=meta.arch_get("attention.clamp_kqv"))
    else:
        hf.update(_deepseek2(meta, n_experts, expert_ff, ff, heads))
    return hf


def _deepseek2(meta: GGUFMeta, n_experts: int, expert_ff: int, ff: int, heads: int) -> dict:
    """deepseek2: MLA geometry, dense first layers, the router (V2 softmax / V3 sigmoid)."""
    rope_dim = meta.require("rope.dimension_count")
    if meta.arch_get("attention.key_length_mla") is not None:       # MQA-absorbed layout
        qk_dim = meta.arch_get("attention.key_length_mla")
        v_dim = meta.require("attention.value_length_mla")
    else:                                                           # older converters
        qk_dim = meta.require("attention.key_length")
        v_dim = meta.require("attention.value_length")
    gating = meta.arch_get("expert_gating_func", _GATING_SOFTMAX)
    groups = meta.arch_get("expert_group_count", 1) or 1
    used_groups = meta.arch_get("expert_group_used_count", groups) or groups
    out = dict(
        num_key_value_heads=heads,          # llama.cpp writes 1 (MLA as MQA); HF says H
        first_k_dense_replace=meta.arch_get("leading_dense_block_count", 0),
        n_routed_experts=n_experts, moe_intermediate_size=expert_ff, intermediate_size=ff,
        n_shared_experts=meta.arch_get("expert_shared_count", 0),
        routed_scaling_factor=meta.arch_get("expert_weights_scale", 1.0),
        kv_lora_rank=meta.require("attention.kv_lora_rank"),
        q_lora_rank=meta.arch_get("attention.q_lora_rank"),
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=qk_dim - rope_dim, v_head_dim=v_dim,
        norm_topk_prob=bool(meta.arch_get("expert_weights_norm", False)),
    )
    if gating == _GATING_SIGMOID:
        out.update(model_type="deepseek_v3", n_group=groups, topk_group=used_groups)
    elif gating == _GATING_SOFTMAX:
        out.update(topk_method="group_limited_greedy" if groups > 1 else "greedy",
                   n_group=groups, topk_group=used_groups)
    else:
        raise ColibriError(f"{meta.path}: deepseek2.expert_gating_func {gating} is not "
                           f"supported (1 softmax, 2 sigmoid)")
    return out


def tokenizer_files(path: str | os.PathLike, meta: GGUFMeta) -> dict[str, str] | None:
    """tokenizer.json (+ tokenizer_config.json, chat_template.jinja) of the tokenizer the
    GGUF metadata describes, built by transformers' GGUF tokenizer conversion; None (with a
    warning) when the file has no tokenizer."""
    if "tokenizer.ggml.tokens" not in meta.fields:
        warnings.warn(f"{os.path.basename(path)}: no tokenizer in the GGUF metadata; the "
                      f"converted model can be used with token ids only", ConversionWarning,
                      stacklevel=3)
        return None
    # transformers' GGUF tokenizer conversion, fed from this reader (its own file reader
    # would import torch): the metadata keys it maps, then its builder for the vocabulary type
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)
    groups = {group: {name: meta.get(f"tokenizer.{key}") for key, name in renames.items()
                      if f"tokenizer.{key}" in meta.fields}
              for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tok, tok_config = groups["tokenizer"], groups["tokenizer_config"]
    if tok.get("tokenizer_type") == "llama":       # llama.cpp adds BOS to sentencepiece
        tok_config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tok["tokens"]):
            tok_config[name] = tok["tokens"][token_id]
    try:
        backend, _ = convert_gguf_tokenizer(meta.arch, tok)
    except Exception as e:                       # noqa: BLE001 - transformers' own errors
        raise ColibriError(f"{path}: cannot build the tokenizer from the GGUF metadata "
                           f"(tokenizer.ggml.model {meta.get('tokenizer.ggml.model')!r}): "
                           f"{e}") from None
    config = {k: v for k, v in tok_config.items() if v is not None and k != "chat_template"}
    files = {"tokenizer.json": backend.to_str(),
             "tokenizer_config.json": json.dumps(config, ensure_ascii=False, indent=1)}
    template = meta.get("tokenizer.chat_template")
    if template:
        files["chat_template.jinja"] = template
    return files
