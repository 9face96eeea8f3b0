"""DeepSeek-V2 against transformers (tests/family_parity.py), plus what is V2's own: the
group-limited greedy router, YaRN with the mscale correction, the greedy router, the
latent KV cache's size and the converter's RoPE de-interleaving."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

import colibri.api as api  # noqa: E402
from colibri.config import ConfigError  # noqa: E402
from colibri.convert import convert, plan  # noqa: E402
from colibri.families import get_family  # noqa: E402
from family_parity import *  # noqa: E402,F401,F403 - the shared parity tests
from family_parity import FamilyRef, gate_routers  # noqa: E402
from hf_factory import tiny_config  # noqa: E402
from test_model import F32_TOL, _rel_err  # noqa: E402

FAMILY = "deepseek_v2"
INIT_RANGE = 0.15
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8,
        "beta_fast": 32, "beta_slow": 1}


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
    assert cfg.is_mla and (cfg.kv_lora_rank, cfg.q_lora_rank) == (32, 64)
    assert (cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim, cfg.qk_head_dim) == (16, 8, 16, 24)
    assert cfg.router == "softmax_group_topk" and (cfg.n_group, cfg.topk_group) == (4, 2)
    assert cfg.routed_scaling_factor == 1.5 and cfg.norm_topk_prob is False
    assert cfg.moe_layers == (1, 2) and cfg.dense_intermediate_size == 96
    assert cfg.shared_expert_intermediate_size == 64 and not cfg.shared_expert_gate
    greedy = get_family(FAMILY).model_config(config_dict(topk_method="greedy"))
    assert greedy.router == "softmax_topk"
    with pytest.raises(ConfigError, match="topk_method 'noaux_tc' is not supported"):
        get_family(FAMILY).model_config(config_dict(topk_method="noaux_tc"))
    with pytest.raises(ConfigError, match="n_group 3 must be a positive divisor"):
        get_family(FAMILY).model_config(config_dict(n_group=3))


def test_latent_cache_is_smaller_than_per_head(ref):
    """The cache holds Rkv + Dr floats per token and layer, not 2 * H * (Dn + Dr)."""
    m, c = ref.model(), ref.model().config
    cache = m.new_cache(ctx=8)
    assert cache.bytes_per_token == c.num_hidden_layers * (c.kv_lora_rank + c.head_dim) * 4
    naive = c.num_hidden_layers * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim) * 4
    assert cache.bytes_per_token < naive


def _parity(hf_checkpoint, tmp_path, **overrides):
    path = hf_checkpoint(FAMILY, initializer_range=INIT_RANGE, **overrides)
    r = FamilyRef(path, tmp_path, gate_routers)
    m = r.model()
    got = api.forward(m, r.ids, attention_mask=r.mask)
    assert _rel_err(got[r.valid], r.logits[r.valid]) <= F32_TOL
    cache = m.new_cache(ctx=16)
    prompt = r.seqs[0]
    steps = [api.forward(m, prompt[i:i + 1], cache=cache) for i in range(len(prompt))]
    assert _rel_err(np.concatenate(steps), r.logits[0, r.valid[0]]) <= F32_TOL
    r.close()
    return m


def test_yarn_with_mscale(hf_checkpoint, tmp_path):
    """YaRN inverse frequencies, cos/sin attention factor and the softmax scale's
    mscale(factor, mscale_all_dim)^2, on both paths."""
    _parity(hf_checkpoint, tmp_path, rope_parameters=YARN)


def test_greedy_router_and_plain_q(hf_checkpoint, tmp_path):
    _parity(hf_checkpoint, tmp_path, topk_method="greedy", q_lora_rank=None,
            first_k_dense_replace=0)


def test_rope_rows_are_deinterleaved(ref, tmp_path):
    """Stored rows = the checkpoint's with each RoPE block's pairs split evens | odds; a
    file stored without that reordering gives other logits (the test above could fail)."""
    from safetensors import safe_open
    m = ref.model()
    with safe_open(str(ref.path / "model.safetensors"), "np") as f:
        kv_a = f.get_tensor("model.layers.0.self_attn.kv_a_proj_with_mqa.weight")
    stored = m.file.to_float32("layers.0.attn.wkv_a")
    R = m.config.kv_lora_rank
    np.testing.assert_array_equal(stored[:R], kv_a[:R])
    np.testing.assert_array_equal(stored[R:], np.concatenate([kv_a[R::2], kv_a[R + 1::2]]))
    p = plan(ref.path, dtype="f32")
    assert p.family.transform is not None


def test_fused_expert_keys_are_not_needed():
    """save_pretrained writes per-expert keys: what the name map reads."""
    fam = get_family(FAMILY)
    cfg = fam.model_config(config_dict())
    names = dict((n, k) for k, n in fam.tensor_map(cfg))
    assert names["layers.1.moe.experts.3.w_up"] == "model.layers.1.mlp.experts.3.up_proj.weight"
    assert names["layers.1.attn.wkv_b"] == "model.layers.1.self_attn.kv_b_proj.weight"
    assert names["layers.0.mlp.w_gate"] == "model.layers.0.mlp.gate_proj.weight"
    assert names["layers.2.moe.shared.w_down"] == \
        "model.layers.2.mlp.shared_experts.down_proj.weight"


def test_convert_plan_claims_every_key(ref):
    p = plan(ref.path, quant="q4", quantize="experts,shared,attn,dense")
    kinds = {t.canon.kind: t.dtype for t in p.tensors}
    assert kinds["attn.wkv_b"] == "q4" and kinds["attn.kv_a_norm"] == "f32"
    assert kinds["moe.router"] == "f32"
    convert(ref.path, ref.dir / "all-q4.colibri", quant="q4",
            quantize="experts,shared,attn,dense", progress=False)
