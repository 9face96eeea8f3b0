"""colibri.attention against transformers' own modules (the oracle), in float32."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri.attention import (Attention, DecodeWork, Rope, apply_rope, attend, build_mask,
                               rms_norm, rms_norm_row, rope_inv_freq)
from colibri.kv_cache import KVCache

TOL = 2e-5


def _close(a, b, tol=TOL):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = max(1.0, float(np.abs(b).max()))
    err = float(np.abs(a - b).max()) / scale
    assert err <= tol, f"max relative error {err:.3g} > {tol}"


# --------------------------------------------------------------------------------------------
# RMSNorm, RoPE
# --------------------------------------------------------------------------------------------

def test_rms_norm_matches_transformers():
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 48)).astype(np.float32) * 3
    w = rng.normal(size=48).astype(np.float32)
    ref = OlmoeRMSNorm(48, eps=1e-5)
    ref.weight.data = torch.from_numpy(w)
    _close(rms_norm(x, w, 1e-5), ref(torch.from_numpy(x)).detach().numpy(), 1e-6)


def _rms_norm_as_before(x, weight, eps):
    """rms_norm as it was written first (np.mean); the rewrite must give the same bits."""
    x = np.asarray(x, dtype=np.float32)
    var = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return weight * (x * (np.float32(1.0) / np.sqrt(var + np.float32(eps))))


@pytest.mark.parametrize("n", [7, 24, 64, 100, 1024, 1536, 2880])
def test_rms_norm_in_place_and_row_versions_are_bit_identical(n):
    rng = np.random.default_rng(n)
    for i in range(20):
        x = (rng.normal(size=(3, n)) * 10.0 ** rng.uniform(-4, 4)).astype(np.float32)
        w = rng.normal(size=n).astype(np.float32)
        eps = (1e-5, 1e-6, 1e-8)[i % 3]
        want = _rms_norm_as_before(x, w, eps)
        np.testing.assert_array_equal(rms_norm(x, w, eps), want)
        y = x.copy()
        assert rms_norm(y, w, eps, out=y) is y
        np.testing.assert_array_equal(y, want)
        out, tmp = np.empty((1, n), np.float32), np.empty((1, n), np.float32)
        for r in range(3):
            rms_norm_row(x[r:r + 1], w, np.float32(eps), out, tmp)
            np.testing.assert_array_equal(out[0], want[r])


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
    with pytest.raises(NotImplementedError, match="longrope"):
        rope_inv_freq(16, 10000.0, {"rope_type": "longrope", "factor": 2.0})


def test_rope_from_arch_legacy_type_key_and_default_dict():
    r = Rope.from_arch({"head_dim": 16, "rope_theta": 10000.0,
                        "rope_scaling": {"type": "linear", "factor": 2.0}})
    base = Rope.from_arch({"head_dim": 16, "rope_theta": 10000.0,
                           "rope_scaling": {"rope_type": "default", "rope_theta": 10000.0}})
    np.testing.assert_allclose(r.inv_freq * 2, base.inv_freq, rtol=1e-7)


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


# --------------------------------------------------------------------------------------------
# masks and the core
# --------------------------------------------------------------------------------------------

def test_build_mask_causal_padding_window():
    valid = np.array([[False, True, True, True, True]])
    m = build_mask(valid, 5)
    expected = np.tril(np.ones((5, 5), bool)) & valid[0][None, :]
    np.testing.assert_array_equal(m[0], expected)
    w = build_mask(np.ones((1, 6), bool), 2, window=3)      # queries at slots 4, 5
    np.testing.assert_array_equal(w[0], [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]])


def test_attend_matches_naive_and_handles_empty_rows():
    rng = np.random.default_rng(3)
    B, H, Hkv, T, L, Dh = 2, 6, 2, 3, 5, 8
    q = rng.normal(size=(B, H, T, Dh)).astype(np.float32)
    k = rng.normal(size=(B, Hkv, L, Dh)).astype(np.float32)
    v = rng.normal(size=(B, Hkv, L, Dh)).astype(np.float32)
    valid = np.ones((B, L), bool)
    valid[1, :3] = False                                    # sequence 1: 3 pad slots
    mask = build_mask(valid, T)
    out = attend(q, k, v, mask, Dh ** -0.5)
    G = H // Hkv
    for b in range(B):
        for h in range(H):
            for t in range(T):
                m = mask[b, t]
                if not m.any():
                    np.testing.assert_array_equal(out[b, t, h * Dh:(h + 1) * Dh], 0.0)
                    continue
                s = (k[b, h // G] @ q[b, h, t]) * Dh ** -0.5
                s = np.where(m, s, -np.inf)
                p = np.exp(s - s.max())
                p /= p.sum()
                np.testing.assert_allclose(out[b, t, h * Dh:(h + 1) * Dh], p @ v[b, h // G],
                                           rtol=1e-5, atol=1e-6)
    assert np.isfinite(out).all()


def test_attend_chunked_equals_unchunked(monkeypatch):
    import colibri.attention as att
    rng = np.random.default_rng(4)
    q = rng.normal(size=(1, 4, 9, 8)).astype(np.float32)
    k = rng.normal(size=(1, 2, 9, 8)).astype(np.float32)
    v = rng.normal(size=(1, 2, 9, 8)).astype(np.float32)
    mask = build_mask(np.ones((1, 9), bool), 9)
    full = attend(q, k, v, mask, 0.3)
    monkeypatch.setattr(att, "_SCORE_BYTES", 4 * 2 * 9 * 4)   # 2 queries per chunk
    np.testing.assert_allclose(attend(q, k, v, mask, 0.3), full, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------
# whole layers against transformers' attention modules
# --------------------------------------------------------------------------------------------

def _family(name):
    """(transformers config, attention class, rotary class, qk_norm, has_bias)."""
    D, H, Hkv = 64, 4, 2
    common = dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=Hkv,
                  rms_norm_eps=1e-6, max_position_embeddings=256)
    if name == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral import modeling_mixtral as m
        cfg = MixtralConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        return cfg, m.MixtralAttention, m.MixtralRotaryEmbedding, "none"
    if name == "mixtral_window":
        from transformers import MixtralConfig
        from transformers.models.mixtral import modeling_mixtral as m
        cfg = MixtralConfig(**common, sliding_window=4,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e4})
        return cfg, m.MixtralAttention, m.MixtralRotaryEmbedding, "none"
    if name == "qwen2_moe":
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe import modeling_qwen2_moe as m
        cfg = Qwen2MoeConfig(**common, num_hidden_layers=1, qkv_bias=True,
                             rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})
        return cfg, m.Qwen2MoeAttention, m.Qwen2MoeRotaryEmbedding, "none"
    if name == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe import modeling_qwen3_moe as m
        cfg = Qwen3MoeConfig(**common, head_dim=24,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        return cfg, m.Qwen3MoeAttention, m.Qwen3MoeRotaryEmbedding, "per_head"
    if name == "olmoe":
        from transformers import OlmoeConfig
        from transformers.models.olmoe import modeling_olmoe as m
        cfg = OlmoeConfig(**common, clip_qkv=0.4,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e4})
        return cfg, m.OlmoeAttention, m.OlmoeRotaryEmbedding, "full"
    raise KeyError(name)


def _np_proj(lin):
    w = lin.weight.detach().numpy().copy()
    b = None if lin.bias is None else lin.bias.detach().numpy().copy()
    return (lambda x: x @ w.T) if b is None else (lambda x: x @ w.T + b)


def _build(name, seed=0):
    cfg, attn_cls, rope_cls, qk_norm = _family(name)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    ref = attn_cls(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
        if qk_norm != "none":
            ref.q_norm.weight.normal_(1.0, 0.3)
            ref.k_norm.weight.normal_(1.0, 0.3)
    head_dim = ref.head_dim
    ours = Attention(
        _np_proj(ref.q_proj), _np_proj(ref.k_proj), _np_proj(ref.v_proj), _np_proj(ref.o_proj),
        n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
        eps=cfg.rms_norm_eps, qk_norm=qk_norm,
        q_norm=None if qk_norm == "none" else ref.q_norm.weight.detach().numpy(),
        k_norm=None if qk_norm == "none" else ref.k_norm.weight.detach().numpy(),
        clip_qkv=getattr(cfg, "clip_qkv", None),
        window=getattr(cfg, "sliding_window", None) or None)
    rp = cfg.rope_parameters
    rope = Rope(head_dim, rp["rope_theta"], None if rp["rope_type"] == "default" else dict(rp))
    return cfg, ref, rope_cls(cfg), ours, rope


def _ref_mask(valid, T, window):
    """transformers' additive 4-D mask (B, 1, T, L) for eager attention."""
    allowed = build_mask(valid, T, window)
    return torch.from_numpy(np.where(allowed, 0.0, torch.finfo(torch.float32).min)
                            .astype(np.float32)[:, None])


@pytest.mark.parametrize("name", ["mixtral", "mixtral_window", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_layer_matches_transformers_with_padding_and_cache(name):
    cfg, ref, ref_rope, ours, rope = _build(name)
    rng = np.random.default_rng(5)
    B, T = 2, 7
    x = rng.normal(size=(B, T, cfg.hidden_size)).astype(np.float32)
    valid = np.ones((B, T), bool)
    valid[1, :3] = False                                     # left padding of sequence 1
    pos = np.clip(np.cumsum(valid, axis=1) - 1, 0, None)
    window = ours.window
    with torch.no_grad():
        cos_t, sin_t = ref_rope(torch.from_numpy(x), torch.from_numpy(pos))
        want = ref(torch.from_numpy(x), (cos_t, sin_t), _ref_mask(valid, T, window))[0].numpy()
    cos, sin = rope.cos_sin(pos)
    got = ours(x, cos, sin, build_mask(valid, T, window))
    _close(got[valid], want[valid])
    assert np.isfinite(got).all()

    # the same through a KV cache, prompt of 4 then one token at a time
    cache = KVCache(1, B, cfg.num_key_value_heads, 16, ours.head_dim)
    pieces = []
    for a, b in [(0, 4), (4, 5), (5, 6), (6, 7)]:
        n = b - a
        cache.check_room(n)
        all_valid = np.concatenate([cache.valid[:, :cache.length], valid[:, a:b]], axis=1)
        c, s = rope.cos_sin(pos[:, a:b])
        pieces.append(ours(x[:, a:b], c, s, build_mask(all_valid, n, window), cache, 0))
        cache.commit(valid[:, a:b], pos[:, a:b])
    step = np.concatenate(pieces, axis=1)
    _close(step[valid], want[valid])
    np.testing.assert_array_equal(cache.next_positions(), pos[:, -1] + 1)


# --------------------------------------------------------------------------------------------
# the decode fast path (B = T = 1, nothing masked) against the general path
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mixtral", "mixtral_window", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_decode_fast_path_equals_general_path(name):
    """Attention.decode gives __call__'s bits through a cache (same operations, same shapes),
    except past a sliding window (hidden slots left out rather than masked): 1e-6 there."""
    cfg, _, _, ours, rope = _build(name)
    rng = np.random.default_rng(6)
    T, ctx, Hkv, Dh = 11, 16, cfg.num_key_value_heads, ours.head_dim
    x = rng.normal(size=(1, T, cfg.hidden_size)).astype(np.float32)
    pos = np.arange(T)[None] + 2
    general, fast = KVCache(2, 1, Hkv, ctx, Dh), KVCache(2, 1, Hkv, ctx, Dh)
    work = DecodeWork(cfg.hidden_size, ours.n_heads, Hkv, Dh, rope.rot_dim // 2, ctx, ours.eps,
                      proj_out=False)
    cos, sin = rope.cos_sin(pos[:, :3])
    for cache in (general, fast):                       # a prompt of 3, general path, layer 1
        ours(x[:, :3], cos, sin, build_mask(np.ones((1, 3), bool), 3, ours.window), cache, 1)
        cache.commit(np.ones((1, 3), bool), pos[:, :3])
    windowed = 0
    for t in range(3, T):
        cos, sin = rope.cos_sin(pos[:, t:t + 1])
        mask = build_mask(np.ones((1, t + 1), bool), 1, ours.window)
        want = ours(x[:, t:t + 1], cos, sin, mask, general, 1)[0]
        got = ours.decode(x[0, t:t + 1], cos[0, 0, 0], sin[0, 0, 0], fast, 1, work)
        assert got.shape == want.shape
        if ours.window and t + 1 > ours.window:
            windowed += 1
            _close(got, want, 1e-6)
        else:
            np.testing.assert_array_equal(got, want)
        for cache in (general, fast):
            cache.commit(np.ones((1, 1), bool), pos[:, t:t + 1])
    np.testing.assert_array_equal(fast.k[1][:, :, :T], general.k[1][:, :, :T])
    np.testing.assert_array_equal(fast.v[1][:, :, :T], general.v[1][:, :, :T])
    assert not fast.k[0].any()                          # only the given layer was written
    assert windowed == (T - ours.window if ours.window else 0)
