"""Families: config.json -> arch dict, and the name map against what save_pretrained writes."""
from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from colibri.errors import ColibriError
from colibri.families import FAMILIES, ConfigError, canonical_tensors, get_family
from colibri.families.base import Source
from hf_factory import FAMILY_NAMES, tiny_config

ARCH_KEYS = {  # SPEC §3
    "family", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "router", "norm_topk_prob", "shared_expert_intermediate_size",
    "shared_expert_gate", "moe_layers", "dense_intermediate_size", "attention_bias", "qk_norm",
    "clip_qkv", "rope_theta", "rope_scaling", "partial_rotary_factor", "rms_norm_eps",
    "max_position_embeddings", "sliding_window", "layer_types", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id",
}


def config_dict(family: str, **overrides) -> dict:
    """What save_pretrained would write to config.json for a tiny model."""
    return json.loads(tiny_config(family, **overrides).to_json_string())


def checkpoint_shapes(folder) -> dict[str, tuple[int, ...]]:
    with safe_open(str(folder / "model.safetensors"), "np") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_registry_lists_the_four_families():
    assert set(FAMILIES) == set(FAMILY_NAMES)
    for name, fam in FAMILIES.items():
        assert fam.model_type == name
        assert get_family(name) is fam


def test_unknown_model_type_names_it_and_lists_supported():
    with pytest.raises(ColibriError) as e:
        get_family("llama")
    msg = str(e.value)
    assert "'llama'" in msg
    for name in FAMILY_NAMES:
        assert name in msg
    with pytest.raises(ColibriError, match="None"):
        get_family(None)


def test_name_map_matches_save_pretrained_exactly(hf_checkpoint, family_name):
    """Every key transformers 5.24 writes is claimed, with the shape config.json implies."""
    folder = hf_checkpoint(family_name)
    config = json.loads((folder / "config.json").read_text())
    fam = get_family(config["model_type"])
    arch = fam.arch(config)
    shapes = checkpoint_shapes(folder)
    mapping = dict(fam.tensor_map(arch))
    assert set(mapping) == set(shapes)
    expected = fam.expected_shapes(arch)
    for key, canonical in mapping.items():
        assert shapes[key] == expected[canonical], (key, canonical)
    assert len(set(mapping.values())) == len(mapping)       # one canonical name per key


def test_arch_has_every_spec_field(family_name):
    arch = get_family(family_name).arch(config_dict(family_name))
    assert set(arch) == ARCH_KEYS
    assert arch["family"] == family_name
    assert arch["router"] == "softmax_topk"
    json.dumps(arch, allow_nan=False)        # travels in the metadata as JSON


@pytest.mark.parametrize("family, expect", [
    ("mixtral", dict(num_experts=4, moe_intermediate_size=96, norm_topk_prob=True, head_dim=16,
                     qk_norm="none", attention_bias=False, shared_expert_intermediate_size=0,
                     moe_layers=[0, 1], rope_theta=1e6)),
    ("qwen2_moe", dict(num_experts=4, moe_intermediate_size=32, norm_topk_prob=False,
                       attention_bias=True, shared_expert_intermediate_size=96,
                       shared_expert_gate=True, moe_layers=[0], dense_intermediate_size=128,
                       qk_norm="none", sliding_window=None)),
    ("qwen3_moe", dict(num_experts=4, head_dim=32, qk_norm="per_head", norm_topk_prob=True,
                       moe_layers=[0, 1], dense_intermediate_size=0, attention_bias=False)),
    ("olmoe", dict(num_experts=4, moe_intermediate_size=64, qk_norm="full", clip_qkv=4.0,
                   norm_topk_prob=False, moe_layers=[0, 1])),
])
def test_arch_values(family, expect):
    arch = get_family(family).arch(config_dict(family))
    for key, value in expect.items():
        assert arch[key] == value, key
    assert (arch["bos_token_id"], arch["eos_token_id"], arch["pad_token_id"]) == (1, 2, 0)


def test_old_style_rope_fields_and_null_head_dim():
    cfg = config_dict("mixtral")
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=5e5, head_dim=None,
               rope_scaling={"type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 64})
    arch = get_family("mixtral").arch(cfg)
    assert arch["rope_theta"] == 5e5
    assert arch["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 64}
    assert arch["head_dim"] == cfg["hidden_size"] // cfg["num_attention_heads"]


def test_rope_parameters_with_scaling():
    cfg = config_dict("qwen3_moe")
    cfg["rope_parameters"] = {"rope_type": "linear", "rope_theta": 2e4, "factor": 2.0}
    arch = get_family("qwen3_moe").arch(cfg)
    assert arch["rope_theta"] == 2e4
    assert arch["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


def test_qwen_sparse_step_and_mlp_only_layers():
    fam = get_family("qwen2_moe")
    arch = fam.arch(config_dict("qwen2_moe", num_hidden_layers=4, mlp_only_layers=[],
                                decoder_sparse_step=2))
    assert arch["moe_layers"] == [1, 3]
    arch = fam.arch(config_dict("qwen2_moe", num_hidden_layers=4, mlp_only_layers=[0, 3]))
    assert arch["moe_layers"] == [1, 2]
    names = {t.name for t in canonical_tensors(arch)}
    assert "layers.0.mlp.w_gate" in names and "layers.0.moe.router" not in names
    assert "layers.1.moe.shared_gate" in names and "layers.1.mlp.w_gate" not in names
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        fam.arch(config_dict("qwen2_moe", mlp_only_layers=[7]))


def test_qwen2_sliding_window_layers():
    cfg = config_dict("qwen2_moe", use_sliding_window=True, sliding_window=16,
                      max_window_layers=1)
    arch = get_family("qwen2_moe").arch(cfg)
    assert arch["sliding_window"] == 16
    assert arch["layer_types"] == cfg["layer_types"]
    assert arch["layer_types"][0] == "sliding_attention"
    cfg = config_dict("qwen2_moe")
    assert get_family("qwen2_moe").arch(cfg)["sliding_window"] is None


def test_qwen3_expert_count_under_either_name():
    cfg = config_dict("qwen3_moe")
    n = cfg.pop("num_local_experts", None) or cfg.pop("num_experts")
    cfg["num_experts"] = n
    assert get_family("qwen3_moe").arch(cfg)["num_experts"] == n


def test_tied_embeddings_drop_lm_head():
    arch = get_family("olmoe").arch(config_dict("olmoe", tie_word_embeddings=True))
    names = [t.name for t in canonical_tensors(arch)]
    assert "lm_head" not in names and "tok_embeddings" in names


@pytest.mark.parametrize("field, value, match", [
    ("hidden_size", None, "hidden_size' is missing"),
    ("num_experts_per_tok", 9, "num_experts_per_tok 9 exceeds"),
    ("hidden_act", "gelu", "hidden_act 'gelu'"),
    ("num_key_value_heads", 3, "not a multiple of num_key_value_heads 3"),
    ("vocab_size", -5, "'vocab_size' must be an integer >= 1"),
    ("rms_norm_eps", "x", "'rms_norm_eps' must be a finite number"),
])
def test_bad_config_fields_are_named(field, value, match):
    cfg = config_dict("olmoe")
    if value is None:
        cfg.pop(field)
    else:
        cfg[field] = value
    with pytest.raises(ConfigError, match=match):
        get_family("olmoe").arch(cfg)


def test_attention_bias_with_o_proj_bias_is_refused():
    with pytest.raises(ConfigError, match="attention_bias"):
        get_family("qwen3_moe").arch(config_dict("qwen3_moe", attention_bias=True))


def test_fused_expert_sources():
    """Each expert has a fallback into transformers 5's fused (E, 2I, D) / (E, D, I) keys."""
    fam = get_family("qwen3_moe")
    arch = fam.arch(config_dict("qwen3_moe"))
    experts = {t.name: t for t in canonical_tensors(arch) if t.expert is not None}
    E, I, D = arch["num_experts"], arch["moe_intermediate_size"], arch["hidden_size"]
    gate = fam.sources(experts["layers.1.moe.experts.2.w_gate"], arch)
    assert gate[0] == Source("model.layers.1.mlp.experts.2.gate_proj.weight")
    assert gate[1].key == "model.layers.1.mlp.experts.gate_up_proj"
    assert gate[1].index == (2, slice(0, I)) and gate[1].shape == (E, 2 * I, D)
    up = fam.sources(experts["layers.1.moe.experts.2.w_up"], arch)[1]
    assert up.index == (2, slice(I, 2 * I))
    down = fam.sources(experts["layers.1.moe.experts.2.w_down"], arch)[1]
    assert down.key == "model.layers.1.mlp.experts.down_proj"
    assert down.index == (2,) and down.shape == (E, D, I)


def test_explain_uses_config_field_names():
    fam = get_family("mixtral")
    arch = fam.arch(config_dict("mixtral"))
    text = fam.explain(("moe_intermediate_size", "hidden_size"), arch)
    assert text == "intermediate_size=96, hidden_size=64"
