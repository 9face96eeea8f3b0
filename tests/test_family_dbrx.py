"""DBRX against transformers (tests/family_parity.py): fused Wqkv with clip_qkv, fused experts
with w2 transposed, L1-normalised top-k weights, LayerNorm without bias."""
from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from colibri.config import ConfigError  # noqa: E402
from colibri.families import get_family  # noqa: E402
from family_parity import *  # noqa: E402,F401,F403 - the shared parity tests
from family_parity import FamilyRef  # noqa: E402

CLIP = 1.5          # small enough that the clamp bites on these random weights


def dbrx_config(**attn):
    return transformers.DbrxConfig(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=320,
        attn_config=dict(dict(kv_n_heads=2, clip_qkv=CLIP, rope_theta=5e5), **attn),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
        initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def dbrx_routers(hf):
    # DbrxRouter returns the logits; the weights come from the FFN's own routing function
    def extract(ffn):
        return lambda out: tuple(reversed(ffn.route_tokens_to_experts(out)))
    return [(i, b.ffn.router, extract(b.ffn)) for i, b in enumerate(hf.transformer.blocks)]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    r = FamilyRef.from_config(dbrx_config(), tmp_path_factory.mktemp("dbrx"), dbrx_routers)
    yield r
    r.close()


def test_config(ref):
    cfg = ref.model().config
    assert (cfg.norm, cfg.norm_bias, cfg.rms_norm_eps) == ("layer_norm", False, 1e-5)
    assert cfg.clip_qkv == CLIP and cfg.norm_topk_prob and cfg.router == "softmax_topk"
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    assert (cfg.num_key_value_heads, cfg.head_dim) == (2, 16)
    hf = json.loads((ref.path / "config.json").read_text())
    # transformers 5 writes rope_parameters; it wins over attn_config.rope_theta, as there
    assert cfg.rope_theta == hf["rope_parameters"]["rope_theta"]
    del hf["rope_parameters"]
    assert get_family("dbrx").model_config(hf).rope_theta == 5e5
    hf["ffn_config"]["moe_normalize_expert_weights"] = 2.0
    with pytest.raises(ConfigError, match="moe_normalize_expert_weights 2.0"):
        get_family("dbrx").model_config(hf)


def test_clip_bites(ref):
    """The test weights make q/k/v exceed clip_qkv, so a missing clamp fails the parity."""
    import torch
    attn = ref.hf.transformer.blocks[0].norm_attn_norm
    x = ref.hf.transformer.wte(torch.from_numpy(ref.ids))
    with torch.no_grad():
        qkv = attn.attn.Wqkv(attn.norm_1(x))
    assert float(qkv.abs().max()) > CLIP

