"""colibri.engine.rope against transformers' rotary embeddings, and the decode step's tables and
compiled rotation against the general ones bit for bit."""
import numpy as np
import pytest
from numeric import assert_close as _close

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri.config import ModelConfig
from colibri.kernels import rope_rows_into
from colibri.engine.rope import Rope, apply_rope, rope_inv_freq


def _llama_config(**rope):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                       max_position_embeddings=4096, rope_parameters=rope)


@pytest.mark.parametrize("params", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "default", "rope_theta": 1e6},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
     "original_max_position_embeddings": 1024},
])
def test_rope_inv_freq_matches_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cfg = _llama_config(**params)
    if params["rope_type"] == "default":
        ref, ref_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        ref, ref_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg)
    scaling = None if params["rope_type"] == "default" else dict(params)
    inv, factor = rope_inv_freq(16, params["rope_theta"], scaling, 1.0, 4096)
    np.testing.assert_allclose(inv, ref.numpy(), rtol=2e-7, atol=0)
    assert factor == pytest.approx(ref_factor)


def test_rope_unknown_type_is_named():
    with pytest.raises(NotImplementedError, match="'dynamic'"):
        rope_inv_freq(16, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


def test_longrope_needs_its_fields():
    with pytest.raises(ValueError, match="short_factor"):
        rope_inv_freq(16, 10000.0, {"rope_type": "longrope", "factor": 2.0,
                                    "original_max_position_embeddings": 8})
    with pytest.raises(ValueError, match="must list 8 numbers"):
        rope_inv_freq(16, 10000.0, {"rope_type": "longrope", "short_factor": [1.0] * 7,
                                    "long_factor": [1.0] * 8,
                                    "original_max_position_embeddings": 8})


def _config(**fields) -> ModelConfig:
    return ModelConfig(family="mixtral", vocab_size=32, hidden_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32, **fields)


def test_rope_from_config_legacy_type_key_and_default_dict():
    r = Rope.from_config(_config(rope_scaling={"type": "linear", "factor": 2.0}))
    base = Rope.from_config(_config(rope_scaling={"rope_type": "default", "rope_theta": 1e4}))
    np.testing.assert_allclose(r.inv_freq * 2, base.inv_freq, rtol=1e-7)
    np.testing.assert_array_equal(base.inv_freq, Rope(16, 1e4).inv_freq)
    half = Rope.from_config(_config(rope_theta=1e6, partial_rotary_factor=0.5))
    assert half.rot_dim == 8
    np.testing.assert_array_equal(half.inv_freq, Rope(16, 1e6, partial_rotary_factor=0.5).inv_freq)


def test_cos_sin_one_equals_cos_sin():
    rope = Rope(16, 1e4, {"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 64}, 1.0, 256)
    assert rope.attention_factor != 1.0
    cos, sin = rope.cos_sin(np.array([[0, 5, 1000]]))
    for j, p in enumerate((0, 5, 1000)):
        c, s = rope.cos_sin_one(p)
        np.testing.assert_array_equal(c, cos[0, 0, j])
        np.testing.assert_array_equal(s, sin[0, 0, j])


def test_compiled_rope_rows_equal_apply_rope():
    """The decode step's rotation (kernels.rope_rows_into) gives apply_rope's bits."""
    rope = Rope(24, 1e6, partial_rotary_factor=0.5)
    x = np.random.default_rng(9).normal(size=(1, 6, 1, 24)).astype(np.float32)
    cos, sin = rope.cos_sin(np.array([[37]]))
    want = apply_rope(x, cos, sin)[0, :, 0]
    rows = x[0, :, 0].copy()
    rope_rows_into(rows, *rope.cos_sin_one(37))
    np.testing.assert_array_equal(rows, want)


def test_apply_rope_matches_transformers():
    from transformers.models.mixtral.modeling_mixtral import MixtralRotaryEmbedding, apply_rotary_pos_emb
    from transformers import MixtralConfig
    cfg = MixtralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    rng = np.random.default_rng(1)
    q = rng.normal(size=(2, 4, 7, 16)).astype(np.float32)
    k = rng.normal(size=(2, 2, 7, 16)).astype(np.float32)
    pos = np.array([np.arange(7) + 3, np.arange(7) * 5], dtype=np.int64)
    cos_t, sin_t = MixtralRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), torch.from_numpy(pos))
    rq, rk = apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos_t, sin_t)
    rope = Rope(16, 1e6)
    cos, sin = rope.cos_sin(pos)
    _close(apply_rope(q, cos, sin), rq.numpy(), 1e-6)
    _close(apply_rope(k, cos, sin), rk.numpy(), 1e-6)


def test_partial_rotary_leaves_the_tail():
    rope = Rope(16, 10000.0, partial_rotary_factor=0.5)
    assert rope.rot_dim == 8
    x = np.random.default_rng(2).normal(size=(1, 1, 3, 16)).astype(np.float32)
    cos, sin = rope.cos_sin(np.arange(3)[None])
    out = apply_rope(x, cos, sin)
    np.testing.assert_array_equal(out[..., 8:], x[..., 8:])
    assert not np.allclose(out[..., :8], x[..., :8])
