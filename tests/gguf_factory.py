"""GGUF files in llama.cpp's exact layout, made from the tiny Hugging Face checkpoints of
hf_factory.py, for the GGUF import tests.

    path, ref = write_gguf(hf_dir, tmp_path / "m.gguf", qtype="Q8_0")

Written with gguf.GGUFWriter as llama.cpp's convert_hf_to_gguf.py writes them (its source in
the llama-cpp-python 0.3.36 sdist; scripts/check_gguf_llamacpp.py runs the real converter and
checks these files against its output, tensor bytes and metadata): the metadata keys of
set_gguf_parameters, the tensor names of gguf's tensor name map, experts stacked per layer,
llama's q / k rows permuted for interleaved RoPE, DeepSeek's kv_b split into k_b (transposed)
and v_b, the tokenizer through gguf.SpecialVocab, and the converter's type rule: 1-D
tensors, norms, routers and the shared-expert gate F32, the rest `qtype`
(gguf.quants.quantize; F16 where a row does not split into blocks).

`ref` is the Hugging Face state dict holding what the GGUF holds, in Hugging Face layout: each
tensor through gguf's own quantize / dequantize (a row permutation commutes with it, since the
blocks lie along rows; k_b is transposed for it and back). transformers run on `ref` is the
parity oracle.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from safetensors.numpy import load_file

ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
        "olmoe": "olmoe", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2"}
# the overrides that make a tiny checkpoint one llama.cpp's format describes fully: it stores
# no clip_qkv for OLMoE, no group routing for DeepSeek-V2, and its qwen2moe tensor list has no
# dense-layer FFN (Qwen1.5-MoE has none)
GGUF_OVERRIDES = {"olmoe": dict(clip_qkv=None), "deepseek_v2": dict(topk_method="greedy"),
                  "qwen2_moe": dict(mlp_only_layers=[])}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: per head, halves -> interleaved RoPE pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def _roundtrip(w: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray, T]:
    """(stored data, the values it decodes to float32 (same shape as w), type stored)."""
    try:
        data = gguf.quants.quantize(w, qtype)
    except gguf.QuantError:
        qtype = T.F16
        data = gguf.quants.quantize(w, qtype)
    return data, gguf.quants.dequantize(data, qtype).reshape(w.shape).astype(np.float32), qtype


def _metadata(w: gguf.GGUFWriter, family: str, hf: dict) -> None:
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    mla = family.startswith("deepseek")
    w.add_head_count_kv(1 if mla else hf["num_key_value_heads"])
    theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta"))
    if theta is not None:
        w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-5 if family == "olmoe" else hf["rms_norm_eps"])
    w.add_expert_used_count(hf["num_experts_per_tok"])
    if hf.get("n_group") is not None:
        w.add_expert_group_count(hf["n_group"])
    if hf.get("topk_group") is not None:
        w.add_expert_group_used_count(hf["topk_group"])
    if hf.get("head_dim") is not None and not mla:
        w.add_key_length(hf["head_dim"])
        w.add_value_length(hf["head_dim"])
    if family == "mixtral":
        w.add_expert_count(hf["num_local_experts"])
        w.add_vocab_size(hf["vocab_size"])
        w.add_rope_dimension_count(hf.get("head_dim") or hf["hidden_size"]
                                   // hf["num_attention_heads"])
    elif family in ("qwen2_moe", "qwen3_moe"):
        w.add_expert_count(hf.get("num_experts") or hf["num_local_experts"])
        w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
        if hf.get("shared_expert_intermediate_size") is not None:
            w.add_expert_shared_feed_forward_length(hf["shared_expert_intermediate_size"])
    elif family == "olmoe":
        w.add_expert_count(hf.get("num_experts") or hf["num_local_experts"])
    else:
        w.add_leading_dense_block_count(hf["first_k_dense_replace"])
        w.add_vocab_size(hf["vocab_size"])
        if hf.get("q_lora_rank") is not None:
            w.add_q_lora_rank(hf["q_lora_rank"])
        w.add_kv_lora_rank(hf["kv_lora_rank"])
        w.add_key_length(hf["kv_lora_rank"] + hf["qk_rope_head_dim"])
        w.add_value_length(hf["kv_lora_rank"])
        w.add_key_length_mla(hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"])
        w.add_value_length_mla(hf["v_head_dim"])
        w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
        w.add_expert_count(hf["n_routed_experts"])
        w.add_expert_shared_count(hf["n_shared_experts"])
        w.add_expert_weights_scale(hf["routed_scaling_factor"])
        w.add_expert_weights_norm(bool(hf.get("norm_topk_prob", False)))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID
                                 if hf.get("scoring_func", "softmax") == "sigmoid"
                                 or family == "deepseek_v3" else gguf.ExpertGatingFuncType.SOFTMAX)
        w.add_rope_dimension_count(hf["qk_rope_head_dim"])


def _tokenizer(w: gguf.GGUFWriter, hf_dir: Path, vocab_size: int) -> None:
    """convert_hf_to_gguf's _set_vocab_gpt2 for the test tokenizer (byte-level BPE, which
    scripts/check_gguf_llamacpp.py reports to the converter as "gpt-2"); ids the tokenizer
    does not use up to vocab_size are "[PAD{i}]" tokens of type UNUSED."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    added = {a["content"]: a for a in tok["added_tokens"]}
    vocab.update({a["content"]: a["id"] for a in tok["added_tokens"]})
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED if i not in by_id
             else gguf.TokenType.CONTROL if t in added and added[t]["special"]
             else gguf.TokenType.USER_DEFINED if t in added else gguf.TokenType.NORMAL
             for i, t in enumerate(tokens)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(hf_dir, load_merges=True).add_to_gguf(w)     # ids, merges, template


def _tensors(family: str, hf: dict, sd: dict[str, np.ndarray]):
    """(HF key(s), GGUF-layout array, GGUF name base, undo) in the converter's order: undo maps
    the stored values back to the HF tensors they came from."""
    arch = gguf.MODEL_ARCH[ARCH[family].upper()]
    names = gguf.get_tensor_name_map(arch, hf["num_hidden_layers"])
    E = hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts")
    done = set()
    mla = family.startswith("deepseek")
    for key, a in sd.items():
        if key in done:
            continue
        if ".experts." in key and "shared" not in key:
            layer, proj = int(key.split(".")[2]), key.split(".")[-2]    # w1 / gate_proj ...
            keys = [key.replace(f".experts.{key.split('.')[-3]}.", f".experts.{e}.")
                    for e in range(E)]
            done.update(keys)
            if family == "mixtral":
                merged = f"layers.{layer}.feed_forward.experts.{proj}.weight"
            else:
                merged = f"model.layers.{layer}.mlp.experts.{proj}.weight"
            yield keys, np.stack([sd[k] for k in keys]), names.get_name(merged, (".weight",)), None
            continue
        if family == "mixtral" and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = hf["num_attention_heads"] if "q_proj" in key else hf["num_key_value_heads"]
            yield [key], permute(a, heads), names.get_name(key, (".weight",)), \
                lambda v, h=heads: permute_back(v, h)
            continue
        if mla and key.endswith("kv_b_proj.weight"):
            H, dn, dv = hf["num_attention_heads"], hf["qk_nope_head_dim"], hf["v_head_dim"]
            kv = a.reshape(H, dn + dv, a.shape[-1])
            kb, vb = np.ascontiguousarray(kv[:, :dn].transpose(0, 2, 1)), kv[:, dn:]
            yield [key, "k_b"], kb, names.get_name(key.replace("kv_b", "k_b"), (".weight",)), None
            yield [key, "v_b"], np.ascontiguousarray(vb), \
                names.get_name(key.replace("kv_b", "v_b"), (".weight",)), None
            continue
        gname = key.replace("e_score_correction_bias", "e_score_correction.bias")  # as llama.cpp
        yield [key], a, names.get_name(gname, (".weight", ".bias")), None


def permute_back(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def write_gguf(hf_dir: str | Path, out: str | Path, qtype: str = "F32",
               tokenizer: bool = True) -> tuple[Path, dict[str, np.ndarray]]:
    """Write the GGUF of checkpoint folder hf_dir; return (its path, the reference state dict:
    HF key -> float32 values as the GGUF holds them)."""
    hf_dir, out = Path(hf_dir), Path(out)
    hf = json.loads((hf_dir / "config.json").read_text())
    family = hf["model_type"]
    sd = {k: v.astype(np.float32) for k, v in load_file(hf_dir / "model.safetensors").items()}
    w = gguf.GGUFWriter(out, ARCH[family])
    _metadata(w, family, hf)
    if tokenizer:
        _tokenizer(w, hf_dir, hf["vocab_size"])
    ref: dict[str, np.ndarray] = {}
    kv_parts: dict[str, dict[str, np.ndarray]] = {}
    for keys, a, name, undo in _tensors(family, hf, sd):
        if name is None:
            raise ValueError(f"no GGUF name for {keys[0]}")
        router = name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))
        want = T.F32 if (a.ndim <= 1 or name.endswith("_norm.weight") or router
                         or not name.endswith(".weight")) else T[qtype]
        data, values, stored = _roundtrip(a, want)
        w.add_tensor(name, data, raw_dtype=stored)
        if len(keys) == 2 and keys[1] in ("k_b", "v_b"):
            kv_parts.setdefault(keys[0], {})[keys[1]] = values
            continue
        if undo is not None:
            values = undo(values)
        if a.ndim == 3 and len(keys) > 1:
            for e, k in enumerate(keys):
                ref[k] = values[e]
        else:
            ref[keys[0]] = values.reshape(sd[keys[0]].shape)
    for key, parts in kv_parts.items():
        kb = parts["k_b"].transpose(0, 2, 1)
        ref[key] = np.concatenate([kb, parts["v_b"]], axis=1).reshape(sd[key].shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out, ref
