"""Granite-MoE and Granite-MoE-Shared against transformers (tests/family_parity.py): fused
experts, top-k then softmax routing, the muP multipliers, q/k/v/o biases, the shared MLP."""
from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from colibri.families import get_family  # noqa: E402
from family_parity import *  # noqa: E402,F401,F403 - the shared parity tests
from family_parity import FamilyRef  # noqa: E402

BASE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=32, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
            initializer_range=0.15,
            # muP multipliers far from 1 so a missing one cannot pass
            embedding_multiplier=3.0, attention_multiplier=0.1, residual_multiplier=0.5,
            logits_scaling=2.5)
VARIANTS = {
    "granitemoe": lambda: transformers.GraniteMoeConfig(**BASE, attention_bias=True),
    "granitemoeshared": lambda: transformers.GraniteMoeSharedConfig(
        **BASE, shared_intermediate_size=64),
}


def granite_routers(hf):
    # GraniteMoeTopKRouter returns (logits, top-k weights, top-k ids)
    return [(i, layer.block_sparse_moe.router, lambda out: (out[2], out[1]))
            for i, layer in enumerate(hf.model.layers)]


@pytest.fixture(scope="module", params=list(VARIANTS))
def ref(request, tmp_path_factory):
    r = FamilyRef.from_config(VARIANTS[request.param](), tmp_path_factory.mktemp(request.param),
                              granite_routers)
    yield r
    r.close()


def test_config_reads_the_multipliers(ref):
    cfg = ref.model().config
    assert cfg.router == "topk_softmax"
    assert (cfg.embedding_multiplier, cfg.attention_multiplier, cfg.residual_multiplier,
            cfg.logits_scaling) == (3.0, 0.1, 0.5, 2.5)
    hf = json.loads((ref.path / "config.json").read_text())
    assert get_family(hf["model_type"]).model_config(hf) == cfg
    if cfg.family == "granitemoe":
        assert cfg.attention_bias and cfg.attention_out_bias
        assert "layers.0.attn.bo" in ref.model().file
    else:
        assert cfg.shared_expert_intermediate_size == 64 and not cfg.shared_expert_gate

