"""GLM-4-MoE against transformers (tests/family_parity.py), plus what is its own: partial
RoPE (rope_parameters.partial_rotary_factor), the switches use_qk_norm / attention_bias,
GLM-4.5's single group, the MTP layers skipped."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

import colibri.api as api  # noqa: E402
from colibri.config import ConfigError  # noqa: E402
from colibri.convert import plan  # noqa: E402
from colibri.families import canonical_tensors, get_family  # noqa: E402
from colibri.engine.rope import Rope  # noqa: E402
from family_parity import *  # noqa: E402,F401,F403 - the shared parity tests
from family_parity import FamilyRef, gate_routers  # noqa: E402
from hf_factory import copy_checkpoint, tiny_config  # noqa: E402
from test_model import F32_TOL, _rel_err  # noqa: E402

FAMILY = "glm4_moe"
INIT_RANGE = 0.15


@pytest.fixture(scope="module")
def ref(hf_checkpoint, tmp_path_factory):
    r = FamilyRef(hf_checkpoint(FAMILY, initializer_range=INIT_RANGE),
                  tmp_path_factory.mktemp(FAMILY), gate_routers, flips_spread=True)
    yield r
    r.close()


def config_dict(**overrides) -> dict:
    return json.loads(tiny_config(FAMILY, **overrides).to_json_string())


def test_model_config_fields():
    cfg = get_family(FAMILY).model_config(config_dict())
    assert (cfg.head_dim, cfg.partial_rotary_factor, Rope.from_config(cfg).rot_dim) == (32, 0.5, 16)
    assert cfg.qk_norm == "per_head" and cfg.attention_bias and not cfg.is_mla
    assert cfg.router == "sigmoid_group_topk" and (cfg.n_group, cfg.topk_group) == (2, 1)
    assert cfg.routed_scaling_factor == 1.8 and cfg.norm_topk_prob
    assert cfg.moe_layers == (1, 2) and cfg.shared_expert_intermediate_size == 32
    plain = get_family(FAMILY).model_config(config_dict(use_qk_norm=False, attention_bias=False))
    names = {t.name for t in canonical_tensors(plain)}
    assert "layers.1.attn.q_norm" not in names and "layers.1.attn.bq" not in names
    assert "layers.1.moe.correction_bias" in names and "layers.1.moe.shared.w_up" in names
    old = config_dict()
    old.pop("rope_parameters")
    old.update(rope_theta=5e5, partial_rotary_factor=0.25)
    cfg = get_family(FAMILY).model_config(old)
    assert (cfg.rope_theta, cfg.partial_rotary_factor, cfg.rope_scaling) == (5e5, 0.25, None)
    with pytest.raises(ConfigError, match="partial_rotary_factor must be in"):
        get_family(FAMILY).model_config(dict(old, partial_rotary_factor=1.5))
    with pytest.raises(ConfigError, match="groups of one"):
        get_family(FAMILY).model_config(config_dict(n_group=8, topk_group=4))


def test_one_group_and_no_qk_norm(hf_checkpoint, tmp_path):
    """GLM-4.5's own setting (n_group = topk_group = 1) without q/k norm or biases."""
    path = hf_checkpoint(FAMILY, initializer_range=INIT_RANGE, n_group=1, topk_group=1,
                         use_qk_norm=False, attention_bias=False)
    r = FamilyRef(path, tmp_path, gate_routers)
    m = r.model()
    got = api.forward(m, r.ids, attention_mask=r.mask)
    assert _rel_err(got[r.valid], r.logits[r.valid]) <= F32_TOL
    cache = m.new_cache(ctx=16)
    steps = [api.forward(m, t[None], cache=cache) for t in r.seqs[0]]
    assert _rel_err(np.concatenate(steps), r.logits[0, r.valid[0]]) <= F32_TOL
    r.close()


def test_mtp_layers_are_skipped(hf_checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file
    src = copy_checkpoint(hf_checkpoint(FAMILY), tmp_path / "ckpt")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.3.enorm.weight"] = np.ones(64, np.float32)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert "model.layers.3.enorm.weight" in plan(src).ignored
