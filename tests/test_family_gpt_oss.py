"""GPT-OSS against transformers (tests/family_parity.py): attention sinks, alternating
sliding-window layers, q/k/v/o biases, the router bias, top-k then softmax, the clamped
swigluoai experts with biases (gate / up interleaved in the checkpoint), YaRN."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri.families import get_family  # noqa: E402
from colibri.moe import swigluoai  # noqa: E402
from family_parity import FORMATS, FamilyRef  # noqa: E402

WINDOW = 6           # shorter than the prompts (11): the sliding layers must honour it


def gpt_oss_config(**kw):
    return transformers.GptOssConfig(**dict(dict(
        vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=131072, sliding_window=WINDOW,
        initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        # a limit the random activations reach, so the clamps are exercised
        swiglu_limit=1.0), **kw))


def gpt_oss_routers(hf):
    # GptOssTopKRouter returns (logits, weights, ids)
    return [(layer.mlp.router, lambda out: (out[2], out[1])) for layer in hf.model.layers]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    r = FamilyRef(gpt_oss_config(), tmp_path_factory.mktemp("gpt_oss"), gpt_oss_routers)
    with torch.no_grad():                       # sinks far from 0 so that they matter
        for layer in r.hf.model.layers:
            assert layer.self_attn.sinks.abs().max() > 0
    yield r
    r.close()


def test_config(ref):
    cfg = ref.model().config
    assert (cfg.router, cfg.router_bias, cfg.expert_bias) == ("topk_softmax", True, True)
    assert cfg.expert_activation == "swigluoai" and cfg.swiglu_limit == 1.0
    assert cfg.attention_sinks and cfg.attention_bias and cfg.attention_out_bias
    assert cfg.layer_types == ("sliding_attention", "full_attention")
    assert [cfg.layer_window(i) for i in range(2)] == [WINDOW, None]
    assert cfg.rope_scaling["rope_type"] == "yarn"
    hf = json.loads((ref.path / "config.json").read_text())
    assert get_family("gpt_oss").model_config(hf) == cfg


def test_swigluoai_matches_transformers():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    experts = GptOssExperts(gpt_oss_config(swiglu_limit=7.0))
    gate_up = torch.randn(50, 64) * 6
    want = experts._apply_gate(gate_up).numpy()
    g, u = gate_up[:, ::2].numpy(), gate_up[:, 1::2].numpy()
    np.testing.assert_allclose(swigluoai(g, u, 1.702, 7.0), want, rtol=1e-6, atol=1e-6)


def test_full_prompt_batch_with_padding(ref):
    ref.check_full_prompt()


def test_cached_decode(ref):
    ref.check_cached_decode()


def test_decode_step(ref):
    ref.check_decode_step()


def test_routing_matches_transformers(ref):
    ref.check_routing()


def test_greedy_tokens_identical(ref):
    ref.check_greedy()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format_within_bounds(ref, fmt):
    ref.check_format(fmt)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format_path_is_exact(ref, fmt):
    ref.check_same_weights(fmt)


def test_routes_command(ref, capsys):
    ref.check_routes_command(capsys)
