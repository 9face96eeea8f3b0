"""Tiny Hugging Face checkpoints of every supported family, made with transformers, for tests.

    from hf_factory import make_hf_checkpoint, FAMILY_NAMES
    path = make_hf_checkpoint(tmp_path, "qwen2_moe", dtype="bfloat16", sharded=True, seed=1,
                              num_hidden_layers=3)

Each checkpoint is a real `save_pretrained` folder (config.json, model.safetensors or shards
with model.safetensors.index.json, generation_config.json) plus, unless `tokenizer=False`, a
small byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja,
special_tokens_map.json) that can encode any text. Weights are random but every parameter
(norm weights and biases included) gets its own noise, so two tensors are never equal by
construction and a swapped name map cannot pass unnoticed.

The tiny configs (TINY_CONFIGS) keep every matrix's input dimension a multiple of 32 so q8/q4
with group size 32 applies everywhere; they exercise each family's quirks by default:
qwen2_moe has a dense layer (mlp_only_layers=[1]) and a shared expert, qwen3_moe a head_dim
different from hidden/heads, olmoe clip_qkv. Keyword overrides go to the config class.

conftest.py exposes `hf_checkpoint`, a session-scoped cached version of `make_hf_checkpoint`;
treat what it returns as read-only (copy it with `copy_checkpoint` before editing files).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

FAMILY_NAMES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# families with their own parity files (tests/test_family_<name>.py), not the Llama-style
# attention reference_tensors and the FAMILY_NAMES-parametrized tests walk
OTHER_FAMILY_NAMES = ("deepseek_v2", "deepseek_v3", "glm4_moe")

_COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256,
               bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)

# family -> (transformers config class name, tiny config kwargs)
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", dict(_COMMON, intermediate_size=96, num_local_experts=4,
                                      rope_theta=1e6)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_COMMON, intermediate_size=128, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=96, num_experts=4,
                                         mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_COMMON, intermediate_size=128, moe_intermediate_size=64,
                                         num_experts=4, head_dim=32, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(_COMMON, intermediate_size=64, num_experts=4, clip_qkv=4.0)),
    # MLA with a q LoRA, one dense first layer, 2 shared experts, group-limited routing
    "deepseek_v2": ("DeepseekV2Config", dict(
        _COMMON, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=2, first_k_dense_replace=1, num_hidden_layers=3,
        kv_lora_rank=32, q_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.5)),
    # sigmoid + correction bias routing in 4 groups, plain q projection, one shared expert
    "deepseek_v3": ("DeepseekV3Config", dict(
        _COMMON, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3,
        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=32, n_group=4, topk_group=2, num_experts_per_tok=3,
        routed_scaling_factor=2.5, norm_topk_prob=True)),
    # partial RoPE (half of a head_dim unlike hidden/heads), q/k/v biases, per-head q/k norm
    "glm4_moe": ("Glm4MoeConfig", dict(
        _COMMON, head_dim=32, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3,
        n_group=2, topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True,
        use_qk_norm=True, attention_bias=True)),
}

_CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The hummingbird is small, fast and frugal. Mixture of experts models route each token.",
    "Hello world! Tokens, experts, routers, layers and the key value cache.",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_config(family: str, **overrides: Any):
    """The transformers config object of a tiny `family` model (overrides applied)."""
    import transformers

    if family not in TINY_CONFIGS:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(TINY_CONFIGS)}")
    cls_name, kwargs = TINY_CONFIGS[family]
    kwargs = dict(kwargs, **overrides)
    theta = kwargs.pop("rope_theta", None)
    if theta is not None and "rope_parameters" not in kwargs:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return getattr(transformers, cls_name)(**kwargs)


def make_tokenizer(path: Path, vocab_size: int = 300) -> None:
    """Write a byte-level BPE tokenizer (every byte encodable) with a chat template into path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    specials = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256,
         "add_bos_token": False, **specials}, indent=2))
    (path / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def make_hf_checkpoint(path: str | Path, family: str, dtype: str = "float32", sharded: bool = False,
                       seed: int = 0, *, tokenizer: bool = True, **overrides: Any) -> Path:
    """Save a tiny random `family` model with save_pretrained into `path`; return the folder.

    dtype: "float32" | "bfloat16" | "float16" (the checkpoint's storage dtype).
    sharded: several safetensors shards plus model.safetensors.index.json.
    seed: torch seed of the random weights (same seed, same weights).
    tokenizer: also write tokenizer files (False: a tokenizer-less folder).
    overrides: config fields, e.g. num_hidden_layers=3, tie_word_embeddings=True.
    """
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()   # keep test output quiet
    path = Path(path)
    config = tiny_config(family, **overrides)
    torch_dtype = getattr(torch, dtype)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():       # distinct values everywhere (norms are all 1 at init)
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        for name, b in model.named_buffers():   # DeepSeek-V3's router bias (zeros at init)
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn(b.shape, generator=gen) * 0.05)
    model = model.to(torch_dtype)
    model.save_pretrained(path, max_shard_size="40KB" if sharded else "50GB")
    if tokenizer:
        make_tokenizer(path)
    return path


def copy_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """A private copy of a checkpoint folder, to edit its files in a test."""
    shutil.copytree(src, dst)
    return Path(dst)


def load_hf_model(path: str | Path, dtype: str = "float32"):
    """The transformers model of a checkpoint folder, in eval mode (a parity oracle)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.eval()


_EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                         r"(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight")
_PROJ = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down",
         "down_proj": "down"}


def fuse_experts(src: str | Path, dst: str | Path) -> Path:
    """Copy a single-file checkpoint, storing experts fused as transformers 5 holds them:
    model.layers.N.mlp.experts.gate_up_proj (E, 2I, D), gate rows first, and
    model.layers.N.mlp.experts.down_proj (E, D, I); Mixtral's block_sparse_moe.gate becomes
    mlp.gate. Other files are copied unchanged."""
    import ml_dtypes  # noqa: F401  - bf16 through NumPy
    import numpy as np
    from safetensors.numpy import load_file, save_file

    dst = copy_checkpoint(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out, experts = {}, {}
    for key, value in tensors.items():
        m = _EXPERT_KEY.fullmatch(key)
        if m:
            experts.setdefault(int(m.group(1)), {}).setdefault(_PROJ[m.group(3)], {})[
                int(m.group(2))] = value
        else:
            out[key.replace("block_sparse_moe.gate.", "mlp.gate.")] = value
    for layer, projs in experts.items():
        stack = {p: np.stack([projs[p][e] for e in sorted(projs[p])]) for p in projs}
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = np.concatenate(
            [stack["gate"], stack["up"]], axis=1)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = stack["down"]
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def reference_tensors(model) -> dict[str, "np.ndarray"]:
    """canonical name (SPEC §1.7) -> float32 array, read from the transformers modules.

    An oracle independent of colibri's name maps: it walks the in-memory model of
    transformers 5 (experts fused as gate_up_proj (E, 2I, D), gate first, and down_proj
    (E, D, I)), not the checkpoint keys.
    """
    def f32(t):
        return t.detach().float().numpy().copy()

    inner, out = model.model, {}
    out["tok_embeddings"] = f32(inner.embed_tokens.weight)
    out["norm"] = f32(inner.norm.weight)
    if not model.config.tie_word_embeddings:
        out["lm_head"] = f32(model.lm_head.weight)
    for i, layer in enumerate(inner.layers):
        p, att, mlp = f"layers.{i}.", layer.self_attn, layer.mlp
        out[p + "attn_norm"] = f32(layer.input_layernorm.weight)
        out[p + "ffn_norm"] = f32(layer.post_attention_layernorm.weight)
        for w, proj in (("wq", att.q_proj), ("wk", att.k_proj), ("wv", att.v_proj),
                        ("wo", att.o_proj)):
            out[p + "attn." + w] = f32(proj.weight)
        for b, proj in (("bq", att.q_proj), ("bk", att.k_proj), ("bv", att.v_proj)):
            if proj.bias is not None:
                out[p + "attn." + b] = f32(proj.bias)
        for n in ("q_norm", "k_norm"):
            if hasattr(att, n):
                out[p + "attn." + n] = f32(getattr(att, n).weight)
        if hasattr(mlp, "experts"):
            out[p + "moe.router"] = f32(mlp.gate.weight)
            gate_up, down = f32(mlp.experts.gate_up_proj), f32(mlp.experts.down_proj)
            inter = gate_up.shape[1] // 2
            for e in range(gate_up.shape[0]):
                q = f"{p}moe.experts.{e}."
                out[q + "w_gate"], out[q + "w_up"] = gate_up[e, :inter], gate_up[e, inter:]
                out[q + "w_down"] = down[e]
            if getattr(mlp, "shared_expert", None) is not None:
                s = mlp.shared_expert
                out[p + "moe.shared.w_gate"] = f32(s.gate_proj.weight)
                out[p + "moe.shared.w_up"] = f32(s.up_proj.weight)
                out[p + "moe.shared.w_down"] = f32(s.down_proj.weight)
                out[p + "moe.shared_gate"] = f32(mlp.shared_expert_gate.weight)
        else:
            out[p + "mlp.w_gate"] = f32(mlp.gate_proj.weight)
            out[p + "mlp.w_up"] = f32(mlp.up_proj.weight)
            out[p + "mlp.w_down"] = f32(mlp.down_proj.weight)
    return out
