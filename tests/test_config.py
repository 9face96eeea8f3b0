"""ModelConfig: the typed "arch" metadata — parsing, the checks that name the field, the
derived helpers, and the round trip through a real file."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import colibri
from colibri.config import ConfigError, ModelConfig
from colibri.errors import ColibriError
from colibri.format import save

BASE = dict(family="mixtral", vocab_size=64, hidden_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16)


def test_defaults_are_the_plain_moe():
    c = ModelConfig(**BASE)
    assert (c.router, c.qk_norm, c.clip_qkv, c.sliding_window, c.layer_types) == (
        "softmax_topk", "none", None, None, None)
    assert c.shared_expert_intermediate_size == 0 and not c.has_shared_expert
    assert c.moe_layer_ids == (0, 1, 2) and all(c.is_moe_layer(i) for i in range(3))
    assert c.kv_group == 2 and c.layer_window(1) is None


def test_derived_helpers_follow_the_fields():
    c = ModelConfig(**BASE, moe_layers=(0, 2), dense_intermediate_size=24, sliding_window=5,
                    layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                    shared_expert_intermediate_size=8)
    assert c.moe_layer_ids == (0, 2) and not c.is_moe_layer(1)
    assert [c.layer_window(i) for i in range(3)] == [5, None, 5]
    assert c.has_shared_expert
    # a window without layer types applies to every layer
    assert ModelConfig(**BASE, sliding_window=7).layer_window(2) == 7


def test_shipped_model_round_trips():
    cf = colibri.open(colibri.default_model_path())
    c = cf.model_config
    assert c.to_metadata() == cf.arch                 # every stored field, the same JSON values
    assert ModelConfig.from_metadata(c.to_metadata()) == c
    assert colibri.load(colibri.default_model_path()).config == c


def test_to_metadata_gives_json_types():
    c = ModelConfig(**BASE, moe_layers=(0, 1, 2), eos_token_id=(1, 2),
                    layer_types=("full_attention",) * 3)
    m = c.to_metadata()
    assert m["moe_layers"] == [0, 1, 2] and m["eos_token_id"] == [1, 2]
    assert m["layer_types"] == ["full_attention"] * 3
    assert ModelConfig.from_metadata(m) == c


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_experts", "head_dim"])
def test_missing_required_field_is_named(field):
    arch = ModelConfig(**BASE).to_metadata()
    del arch[field]
    with pytest.raises(ConfigError, match=rf"m\.colibri: metadata 'arch' lacks the field '{field}'"):
        ModelConfig.from_metadata(arch, source="m.colibri")


@pytest.mark.parametrize("field, value, expected", [
    ("hidden_size", "32", "an integer"),
    ("hidden_size", 32.0, "an integer"),
    ("num_experts", True, "an integer"),
    ("norm_topk_prob", 1, "true or false"),
    ("rms_norm_eps", "1e-5", "a number"),
    ("eos_token_id", [1, "2"], "an integer, a list of integers or null"),
    ("moe_layers", [0, 1.5], "a list of layer numbers"),
    ("layer_types", "full", "a list of strings or null"),
    ("rope_scaling", [1], "an object or null"),
    ("qk_norm", 0, "a string"),
])
def test_wrong_type_is_named_with_what_was_found(field, value, expected):
    arch = {**ModelConfig(**BASE).to_metadata(), field: value}
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_metadata(arch, source="m.colibri")
    msg = str(e.value)
    assert f"field {field!r} must be {expected}" in msg and repr(value) in msg


def test_unknown_field_is_refused():
    arch = {**ModelConfig(**BASE).to_metadata(), "num_experts_per_token": 2}
    with pytest.raises(ConfigError, match="unknown field.*'num_experts_per_token'"):
        ModelConfig.from_metadata(arch)


def test_arch_must_be_an_object():
    with pytest.raises(ConfigError, match="must be an object, found list"):
        ModelConfig.from_metadata([], source="x")


@pytest.mark.parametrize("changes, match", [
    (dict(hidden_size=0), "hidden_size must be a positive integer, found 0"),
    (dict(num_key_value_heads=3), "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok 5 exceeds num_experts 4"),
    (dict(router="sigmoid"), "router 'sigmoid' is not supported"),
    (dict(qk_norm="rms"), "qk_norm must be one of none, full, per_head"),
    (dict(clip_qkv=-1.0), "clip_qkv must be a positive number or null"),
    (dict(sliding_window=0), "sliding_window must be an integer in"),
    (dict(moe_layers=(0, 3)), r"moe_layers must list distinct layers in \[0, 3\)"),
    (dict(moe_layers=(1, 0)), "moe_layers must list distinct layers"),
    (dict(moe_layers=(0, 1)), r"layers \[2\] are dense but dense_intermediate_size is 0"),
    (dict(layer_types=("full_attention",)), "layer_types must list 3 entries"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number"),
    (dict(head_dim=8, partial_rotary_factor=0.1), "rotary dimension 0"),
    (dict(shared_expert_intermediate_size=-1), "shared_expert_intermediate_size must be an integer >= 0"),
])
def test_impossible_values_are_refused(changes, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**BASE, **changes})
    # the same from a file's metadata, with the file named
    arch = {**ModelConfig(**BASE).to_metadata(),
            **{k: list(v) if isinstance(v, tuple) else v for k, v in changes.items()}}
    with pytest.raises(ConfigError, match="^m.colibri: "):
        ModelConfig.from_metadata(arch, source="m.colibri")


def test_config_error_is_a_colibri_error_and_a_value_error():
    assert issubclass(ConfigError, ColibriError) and issubclass(ConfigError, ValueError)


def test_frozen():
    c = ModelConfig(**BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 64
    assert c.replace(hidden_size=64).hidden_size == 64 and c.hidden_size == 32


def test_a_file_with_a_broken_arch_fails_at_load_naming_it(tmp_path):
    """A file whose arch does not parse loads as a ColibriFile (inspect can show it) but not
    as a Model: the error names the file and the field."""
    arch = {**ModelConfig(**BASE).to_metadata(), "num_experts_per_tok": 9}
    p = tmp_path / "m.colibri"
    save(p, {"x": np.zeros((2, 32), np.float32)}, metadata={"arch": arch})
    cf = colibri.open(p)
    with pytest.raises(ConfigError, match=r"m\.colibri: num_experts_per_tok 9 exceeds"):
        cf.model_config
