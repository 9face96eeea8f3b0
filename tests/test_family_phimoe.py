"""PhiMoE against transformers (tests/family_parity.py): the exact sparsemixer routing,
LayerNorm with bias, q/k/v/o and head biases, LongRoPE (short and long tables)."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri import kernels  # noqa: E402
from colibri.kernels._reference import route_topk_ref, sparsemixer_ref  # noqa: E402
from colibri.families import get_family  # noqa: E402
from colibri.engine.rope import Rope  # noqa: E402
from family_parity import *  # noqa: E402,F401,F403 - the shared parity tests
from family_parity import FamilyRef  # noqa: E402

ORIGINAL = 64        # LongRoPE's original context: the test prompts stay within it
ROPE = {"rope_type": "longrope", "rope_theta": 1e4,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
        "long_factor": [1.0, 1.5, 2.2, 3.0, 4.1, 5.5, 7.2, 9.0],
        "short_mscale": 1.1, "long_mscale": 1.3, "original_max_position_embeddings": ORIGINAL}
BASE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=32, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, initializer_range=0.15)
# The formats' bounds for PhiMoE (test_model.BOUNDS' layout): the sparsemixer's masks (experts
# within 2 * router_jitter_noise of the best, relatively) make the weights jump when rounding
# moves a logit across the threshold, without changing the experts, and this tiny random
# model's router logits lie close together; measured worst of the two variants (routed-alike
# max error / top-1 / KL / routing): f16 3.2e-2 / 0.984 / 2.0e-4 / 1.0, bf16 6.8e-2 / 0.898 /
# 4.3e-3 / 0.980, q8 1.6e-2 / 0.977 / 5.5e-3 / 0.988, q4 0.28 / 0.672 / 3.6e-2 / 0.953. That
# each format computes exactly what it stores is test_format_path_is_exact's.
PHIMOE_BOUNDS = {
    "f16": (5e-2, 0.95, 1e-3, 0.98),
    "bf16": (1e-1, 0.85, 1e-2, 0.95),
    "q8": (1e-1, 0.90, 1e-2, 0.95),
    "q4": (1.0, 0.55, 1e-1, 0.85),
}
VARIANTS = {
    # a wide jitter: the masks keep several experts, so the weights are not 1 and the top-2
    # softmax approximation would differ; every bias; LongRoPE
    "biases-longrope": dict(router_jitter_noise=0.3, attention_bias=True, lm_head_bias=True,
                            rope_parameters=ROPE),
    # the release's jitter (0.01), no biases, plain RoPE, a sliding window shorter than a prompt
    "release-window": dict(router_jitter_noise=0.01, sliding_window=8),
}


def moe_block(layer):
    return getattr(layer, "block_sparse_moe", None) or layer.mlp


def phimoe_routers(hf):
    # PhimoeTopKRouter returns (logits, weights, ids) from transformers' sparsemixer
    return [(i, moe_block(layer).router, lambda out: (out[2], out[1]))
            for i, layer in enumerate(hf.model.layers)]


@pytest.fixture(scope="module", params=list(VARIANTS))
def ref(request, tmp_path_factory):
    cfg = transformers.PhimoeConfig(**BASE, **VARIANTS[request.param])
    r = FamilyRef.from_config(cfg, tmp_path_factory.mktemp("phimoe"), phimoe_routers,
                              bounds=PHIMOE_BOUNDS)
    yield r
    r.close()


def test_config(ref):
    cfg = ref.model().config
    assert (cfg.router, cfg.norm, cfg.norm_bias) == ("sparsemixer", "layer_norm", True)
    assert cfg.router_jitter_noise == ref.hf.config.router_jitter_noise
    assert cfg.lm_head_bias == ref.hf.config.lm_head_bias
    assert cfg.attention_out_bias == cfg.attention_bias == ref.hf.config.attention_bias
    hf = json.loads((ref.path / "config.json").read_text())
    assert get_family("phimoe").model_config(hf) == cfg


def test_routing_is_not_the_top2_softmax(ref):
    """The wide-jitter variant has tokens where sparsemixer and softmax(top-2 logits) differ,
    so the parity above tells them apart."""
    if ref.hf.config.router_jitter_noise < 0.1:
        pytest.skip("the release jitter masks nearly every other expert")
    m = ref.model()
    _, tr = m.forward(ref.ids, attention_mask=ref.mask, return_routing=True)
    logits = tr.logits[0][ref.valid]
    _, approx = kernels.route_topk(np.ascontiguousarray(logits), 2, rule="topk_softmax")
    got = np.sort(tr.weights[0][ref.valid], -1)
    assert np.abs(np.sort(approx, -1) - got).max() > 1e-2
    assert ((got > 0.05) & (got < 0.999)).mean() > 0.5      # the masks keep other experts



# --- the pieces against their specifications --------------------------------------------------

def test_sparsemixer_kernel_equals_reference_and_transformers():
    from transformers.models.phimoe.modeling_phimoe import sparsemixer
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((200, 8)) * 2).astype(np.float32)
    logits[5] = 0.0                                        # ties and 0 / 0 thresholds
    logits[6, :3] = logits[6].max() + 1                    # a tie at the top
    for jitter in (0.01, 0.3, 0.0):
        ids, w = kernels.route_topk(logits, 2, rule="sparsemixer", jitter_eps=jitter)
        rids, rw = route_topk_ref(logits, 2, rule="sparsemixer", jitter_eps=jitter)
        np.testing.assert_array_equal(ids, rids)
        np.testing.assert_allclose(w, rw, rtol=1e-6)
        tw, tids = sparsemixer(torch.from_numpy(logits), jitter_eps=jitter, training=False)
        for t in range(len(logits)):
            want = dict(zip(tids[t].tolist(), tw[t].tolist()))
            got = dict(zip(ids[t].tolist(), w[t].tolist()))
            assert want.keys() == got.keys(), t
            for e in want:
                assert abs(want[e] - got[e]) <= 1e-6, (t, e)
        prepared = kernels.prepare_route(2, rule="sparsemixer", jitter_eps=jitter)
        pids, pw = prepared(logits)
        np.testing.assert_array_equal(pids, ids)
        np.testing.assert_array_equal(pw, w)
    e, w = sparsemixer_ref(np.array([3.0, 1.0, 2.9, -1.0], np.float32), 0.01)
    assert list(e) == [0, 2] and w[0] > 0.5


def test_sparsemixer_refuses_other_k_and_noise():
    logits = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="k = 2"):
        kernels.route_topk(logits, 3, rule="sparsemixer")
    with pytest.raises(ValueError, match="noise"):
        kernels.route_topk(logits, 2, rule="sparsemixer", noise_seed=1)
    with pytest.raises(ValueError, match="jitter_eps"):
        kernels.prepare_route(2, rule="sparsemixer", jitter_eps=-1.0)


def test_longrope_tables_match_transformers():
    """Short table and mscale within the original context, long ones beyond (transformers'
    _compute_longrope_parameters with the sequence length, PhiMoE's short/long mscale)."""
    from transformers.modeling_rope_utils import _compute_longrope_parameters
    cfg = transformers.PhimoeConfig(**BASE, rope_parameters=dict(ROPE))
    rope = Rope(16, 1e4, {k: v for k, v in ROPE.items() if k != "rope_theta"},
                max_position_embeddings=256)
    for seq_len, mscale in ((ORIGINAL, ROPE["short_mscale"]), (ORIGINAL + 1, ROPE["long_mscale"])):
        want, _ = _compute_longrope_parameters(cfg, seq_len=seq_len)
        pos = np.arange(seq_len)[None]
        cos, sin = rope.cos_sin(pos)
        freqs = pos[0, :, None].astype(np.float32) * want.numpy()
        np.testing.assert_allclose(cos[0, 0], np.cos(freqs) * np.float32(mscale), rtol=1e-6,
                                   atol=1e-6)
        np.testing.assert_allclose(sin[0, 0], np.sin(freqs) * np.float32(mscale), rtol=1e-6,
                                   atol=1e-6)
        c1, s1 = rope.cos_sin_one(seq_len - 1)             # the decode step picks the same
        np.testing.assert_array_equal(c1, cos[0, 0, -1])
        np.testing.assert_array_equal(s1, sin[0, 0, -1])
