"""Families: config.json -> ModelConfig, and the name map against what save_pretrained writes."""
from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from colibri.config import ConfigError, ModelConfig
from colibri.errors import ColibriError
from colibri.families import FAMILIES, canonical_tensors, get_family
from colibri.families.base import Source
from hf_factory import FAMILY_NAMES, OTHER_FAMILY_NAMES, tiny_config

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


def test_registry_lists_every_family():
    # the four of hf_factory, the others it makes (OTHER_FAMILY_NAMES), and those with a
    # parity file of their own (test_family_*.py)
    assert set(FAMILIES) == set(FAMILY_NAMES) | set(OTHER_FAMILY_NAMES) | {
        "granitemoe", "granitemoeshared", "dbrx", "phimoe", "gpt_oss"}
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
    cfg = fam.model_config(config)
    shapes = checkpoint_shapes(folder)
    mapping = dict(fam.tensor_map(cfg))
    assert set(mapping) == set(shapes)
    expected = fam.expected_shapes(cfg)
    for key, canonical in mapping.items():
        assert shapes[key] == expected[canonical], (key, canonical)
    assert len(set(mapping.values())) == len(mapping)       # one canonical name per key


def test_model_config_stores_every_spec_field(family_name):
    cfg = get_family(family_name).model_config(config_dict(family_name))
    assert isinstance(cfg, ModelConfig)
    assert cfg.family == family_name and cfg.router == "softmax_topk"
    arch = cfg.to_metadata()
    assert set(arch) == ARCH_KEYS
    text = json.dumps(arch, allow_nan=False)        # travels in the metadata as JSON
    assert ModelConfig.from_metadata(json.loads(text)) == cfg


@pytest.mark.parametrize("family, expect", [
    ("mixtral", dict(num_experts=4, moe_intermediate_size=96, norm_topk_prob=True, head_dim=16,
                     qk_norm="none", attention_bias=False, shared_expert_intermediate_size=0,
                     moe_layers=(0, 1), rope_theta=1e6)),
    ("qwen2_moe", dict(num_experts=4, moe_intermediate_size=32, norm_topk_prob=False,
                       attention_bias=True, shared_expert_intermediate_size=96,
                       shared_expert_gate=True, moe_layers=(0,), dense_intermediate_size=128,
                       qk_norm="none", sliding_window=None)),
    ("qwen3_moe", dict(num_experts=4, head_dim=32, qk_norm="per_head", norm_topk_prob=True,
                       moe_layers=(0, 1), dense_intermediate_size=0, attention_bias=False)),
    ("olmoe", dict(num_experts=4, moe_intermediate_size=64, qk_norm="full", clip_qkv=4.0,
                   norm_topk_prob=False, moe_layers=(0, 1))),
])
def test_model_config_values(family, expect):
    cfg = get_family(family).model_config(config_dict(family))
    for key, value in expect.items():
        assert getattr(cfg, key) == value, key
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)


def test_model_config_agrees_with_transformers(family_name):
    """The fields transformers' config class derives (head_dim, expert count under either
    name, rope theta from rope_parameters, defaults of an absent field) come out the same."""
    hf = tiny_config(family_name)
    cfg = get_family(family_name).model_config(json.loads(hf.to_json_string()))
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "num_experts_per_tok", "rms_norm_eps",
                 "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(cfg, name) == getattr(hf, name), name
    assert cfg.head_dim == (getattr(hf, "head_dim", None)
                            or hf.hidden_size // hf.num_attention_heads)
    assert cfg.num_experts == (getattr(hf, "num_local_experts", None) or hf.num_experts)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.norm_topk_prob == getattr(hf, "norm_topk_prob", True)   # Mixtral: always

    # config.json without the expert count / top-k: the config class's defaults
    default = type(hf)()
    plain = json.loads(hf.to_json_string())
    for key in ("num_experts", "num_local_experts", "num_experts_per_tok"):
        plain.pop(key, None)
    cfg = get_family(family_name).model_config(plain)
    assert cfg.num_experts == (getattr(default, "num_local_experts", None)
                               or default.num_experts)
    assert cfg.num_experts_per_tok == default.num_experts_per_tok


def test_qwen_layers_agree_with_transformers():
    """moe_layers are the layers transformers builds a sparse MoE block for."""
    import transformers

    for family in ("qwen2_moe", "qwen3_moe"):
        hf = tiny_config(family, num_hidden_layers=4, mlp_only_layers=[0],
                         decoder_sparse_step=2)
        cfg = get_family(family).model_config(json.loads(hf.to_json_string()))
        model = transformers.AutoModelForCausalLM.from_config(hf)
        sparse = tuple(i for i, layer in enumerate(model.model.layers)
                       if hasattr(layer.mlp, "experts"))
        assert cfg.moe_layer_ids == sparse == (1, 3), family
        assert cfg.dense_intermediate_size == hf.intermediate_size


def test_old_style_rope_fields_and_null_head_dim():
    cfg = config_dict("mixtral")
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=5e5, head_dim=None,
               rope_scaling={"type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 64})
    mc = get_family("mixtral").model_config(cfg)
    assert mc.rope_theta == 5e5
    assert mc.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 64}
    assert mc.head_dim == cfg["hidden_size"] // cfg["num_attention_heads"]


def test_rope_parameters_with_scaling():
    cfg = config_dict("qwen3_moe")
    cfg["rope_parameters"] = {"rope_type": "linear", "rope_theta": 2e4, "factor": 2.0}
    mc = get_family("qwen3_moe").model_config(cfg)
    assert mc.rope_theta == 2e4
    assert mc.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_qwen_sparse_step_and_mlp_only_layers():
    fam = get_family("qwen2_moe")
    cfg = fam.model_config(config_dict("qwen2_moe", num_hidden_layers=4, mlp_only_layers=[],
                                       decoder_sparse_step=2))
    assert cfg.moe_layers == (1, 3)
    cfg = fam.model_config(config_dict("qwen2_moe", num_hidden_layers=4,
                                       mlp_only_layers=[0, 3]))
    assert cfg.moe_layers == (1, 2)
    names = {t.name for t in canonical_tensors(cfg)}
    assert "layers.0.mlp.w_gate" in names and "layers.0.moe.router" not in names
    assert "layers.1.moe.shared_gate" in names and "layers.1.mlp.w_gate" not in names
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        fam.model_config(config_dict("qwen2_moe", mlp_only_layers=[7]))


def test_moe_layers_are_listed_even_when_all_layers_are_moe(family_name):
    """Converted files have always stored the list, never null."""
    cfg = get_family(family_name).model_config(config_dict(family_name, mlp_only_layers=[]))
    assert cfg.to_metadata()["moe_layers"] == list(range(cfg.num_hidden_layers))


def test_qwen2_sliding_window_layers():
    cfg = config_dict("qwen2_moe", use_sliding_window=True, sliding_window=16,
                      max_window_layers=1)
    mc = get_family("qwen2_moe").model_config(cfg)
    assert mc.sliding_window == 16
    assert list(mc.layer_types) == cfg["layer_types"]
    assert mc.layer_types[0] == "sliding_attention"
    assert (mc.layer_window(0), mc.layer_window(1)) == (16, None)
    cfg = config_dict("qwen2_moe")
    assert get_family("qwen2_moe").model_config(cfg).sliding_window is None


def test_qwen3_and_mixtral_window_on_every_layer():
    mc = get_family("qwen3_moe").model_config(
        config_dict("qwen3_moe", use_sliding_window=True, sliding_window=16))
    assert mc.sliding_window == 16 and mc.layer_types is None
    assert [mc.layer_window(i) for i in range(mc.num_hidden_layers)] == [16, 16]
    mc = get_family("mixtral").model_config(config_dict("mixtral", sliding_window=8))
    assert mc.layer_window(1) == 8
    assert get_family("mixtral").model_config(config_dict("mixtral", sliding_window=0)
                                              ).sliding_window is None


def test_qwen3_expert_count_under_either_name():
    cfg = config_dict("qwen3_moe")
    n = cfg.pop("num_local_experts", None) or cfg.pop("num_experts")
    cfg["num_experts"] = n
    assert get_family("qwen3_moe").model_config(cfg).num_experts == n


def test_tied_embeddings_drop_lm_head():
    cfg = get_family("olmoe").model_config(config_dict("olmoe", tie_word_embeddings=True))
    names = [t.name for t in canonical_tensors(cfg)]
    assert "lm_head" not in names and "tok_embeddings" in names


@pytest.mark.parametrize("field, value, match", [
    ("hidden_size", None, "config.json: field 'hidden_size' is missing"),
    ("num_experts_per_tok", 9, "num_experts_per_tok 9 exceeds num_experts 4"),
    ("hidden_act", "gelu", "hidden_act 'gelu'"),
    ("num_key_value_heads", 3, "not a multiple of num_key_value_heads 3"),
    ("vocab_size", -5, "config.json: field 'vocab_size' must be an integer >= 1, found -5"),
    ("vocab_size", True, "field 'vocab_size' must be an integer"),
    ("rms_norm_eps", "x", "config.json: field 'rms_norm_eps' must be a finite number"),
    ("head_dim", 15, "head_dim 15 must be even"),
    ("norm_topk_prob", 1, "field 'norm_topk_prob' must be true or false, found 1"),
    ("eos_token_id", "a", "field 'eos_token_id' must be an int, a list of ints or null"),
    ("rope_parameters", 3, "field 'rope_parameters' must be an object"),
    ("clip_qkv", -1.0, "clip_qkv must be positive"),
    ("num_experts", 0, "field 'num_experts' must be an integer >= 1, found 0"),
])
def test_bad_config_fields_are_named(field, value, match):
    cfg = config_dict("olmoe")
    if value is None:
        cfg.pop(field)
    else:
        cfg[field] = value
    with pytest.raises(ConfigError, match=match):
        get_family("olmoe").model_config(cfg)


@pytest.mark.parametrize("family, field, value, match", [
    ("mixtral", "num_local_experts", "x", "field 'num_local_experts' must be an integer"),
    ("mixtral", "intermediate_size", None, "field 'intermediate_size' is missing"),
    ("qwen2_moe", "qkv_bias", "x", "field 'qkv_bias' must be true or false"),
    ("qwen2_moe", "shared_expert_intermediate_size", -1,
     "field 'shared_expert_intermediate_size' must be an integer >= 0"),
    ("qwen2_moe", "layer_types", ["full_attention"], "layer_types must list 2 entries"),
    ("qwen3_moe", "moe_intermediate_size", None, "field 'moe_intermediate_size' is missing"),
    ("qwen3_moe", "decoder_sparse_step", 0, "field 'decoder_sparse_step' must be an integer"),
])
def test_bad_family_fields_are_named(family, field, value, match):
    cfg = config_dict(family)
    if value is None:
        cfg.pop(field)
    else:
        cfg[field] = value
    with pytest.raises(ConfigError, match=match):
        get_family(family).model_config(cfg)


def test_one_config_error_class():
    """The families raise the package's ConfigError (a ColibriError and a ValueError)."""
    with pytest.raises(ConfigError) as e:
        get_family("mixtral").model_config({})
    assert isinstance(e.value, ColibriError) and isinstance(e.value, ValueError)
    assert str(e.value).startswith("config.json: field ")


def test_attention_bias_with_o_proj_bias_is_refused():
    with pytest.raises(ConfigError, match="attention_bias"):
        get_family("qwen3_moe").model_config(config_dict("qwen3_moe", attention_bias=True))


def test_fused_expert_sources():
    """Each expert has a fallback into transformers 5's fused (E, 2I, D) / (E, D, I) keys."""
    fam = get_family("qwen3_moe")
    cfg = fam.model_config(config_dict("qwen3_moe"))
    experts = {t.name: t for t in canonical_tensors(cfg) if t.expert is not None}
    E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    gate = fam.sources(experts["layers.1.moe.experts.2.w_gate"], cfg)
    assert gate[0] == Source("model.layers.1.mlp.experts.2.gate_proj.weight")
    assert gate[1].key == "model.layers.1.mlp.experts.gate_up_proj"
    assert gate[1].index == (2, slice(0, I)) and gate[1].shape == (E, 2 * I, D)
    up = fam.sources(experts["layers.1.moe.experts.2.w_up"], cfg)[1]
    assert up.index == (2, slice(I, 2 * I))
    down = fam.sources(experts["layers.1.moe.experts.2.w_down"], cfg)[1]
    assert down.key == "model.layers.1.mlp.experts.down_proj"
    assert down.index == (2,) and down.shape == (E, D, I)


def test_explain_uses_config_field_names():
    fam = get_family("mixtral")
    cfg = fam.model_config(config_dict("mixtral"))
    text = fam.explain(("moe_intermediate_size", "hidden_size"), cfg)
    assert text == "intermediate_size=96, hidden_size=64"


# --- DeepSeek-V2 / V3, GLM-4-MoE: the fields config.json may leave out -----------------------

OPTIONAL_KEYS = ("first_k_dense_replace", "moe_intermediate_size", "n_shared_experts",
                 "q_lora_rank", "n_routed_experts", "routed_scaling_factor", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group",
                 "norm_topk_prob", "intermediate_size", "use_qk_norm", "attention_bias")


def _derived(hf) -> dict:
    """What transformers' config object implies, in ModelConfig's terms."""
    mla = hf.model_type.startswith("deepseek")
    out = dict(num_experts=hf.n_routed_experts, num_experts_per_tok=hf.num_experts_per_tok,
               moe_intermediate_size=hf.moe_intermediate_size,
               moe_layers=tuple(range(hf.first_k_dense_replace, hf.num_hidden_layers)),
               shared_expert_intermediate_size=hf.n_shared_experts * hf.moe_intermediate_size,
               routed_scaling_factor=hf.routed_scaling_factor, head_dim=hf.head_dim)
    if hf.first_k_dense_replace:
        out["dense_intermediate_size"] = hf.intermediate_size
    if mla:
        out.update(kv_lora_rank=hf.kv_lora_rank, q_lora_rank=hf.q_lora_rank or 0,
                   qk_nope_head_dim=hf.qk_nope_head_dim, v_head_dim=hf.v_head_dim)
    if hf.model_type != "deepseek_v2" or hf.topk_method == "group_limited_greedy":
        out.update(n_group=hf.n_group, topk_group=hf.topk_group)
    if hf.model_type != "deepseek_v2":
        out["norm_topk_prob"] = hf.norm_topk_prob
    if hf.model_type == "glm4_moe":
        out.update(qk_norm="per_head" if hf.use_qk_norm else "none",
                   attention_bias=hf.attention_bias)
    return out


@pytest.mark.parametrize("family", OTHER_FAMILY_NAMES)
def test_config_defaults_agree_with_transformers(family, hf_checkpoint):
    """Each field config.json may leave out takes the value transformers' config class
    gives it (one left out at a time), and the full config.json (of the family's parity
    checkpoint, tests/test_family_<name>.py) reads as transformers does."""
    import transformers
    loaded = transformers.AutoConfig.from_pretrained(
        hf_checkpoint(family, initializer_range=0.15))
    full = json.loads(loaded.to_json_string())
    fam = get_family(full["model_type"])
    cls = type(loaded)
    checked = 0
    for key in (None, *OPTIONAL_KEYS):
        if key is not None and key not in full:
            continue
        # head_dim is derived from qk_rope_head_dim: without the one, leave out the other
        gone = (key, "head_dim") if key == "qk_rope_head_dim" else (key,)
        plain = {k: v for k, v in full.items() if k not in gone}
        try:
            hf = cls(**{k: v for k, v in plain.items()
                        if k not in ("architectures", "transformers_version", "model_type")})
        except Exception:            # a default that does not fit the rest of the tiny config
            continue
        if key is not None and getattr(hf, key, 0) is None and key != "q_lora_rank":
            with pytest.raises(ConfigError, match=key):   # transformers has no value either
                fam.model_config(plain)
            continue
        try:
            cfg = fam.model_config(plain)
        except ConfigError:          # e.g. V3's 8 default groups of 8 experts: groups of one,
            continue                 # which transformers' router cannot run either
        for name, value in _derived(hf).items():
            assert getattr(cfg, name) == value, (key, name, getattr(cfg, name), value)
        checked += 1
    assert checked > 8
