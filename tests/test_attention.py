"""colibri.engine.attention against transformers' own modules (the oracle), in float32, and
Attention.decode (one token through a cache) against Attention.__call__."""
import numpy as np
import pytest
from numeric import assert_close

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri.engine.attention import Attention, attend, build_mask
from colibri.engine.kv_cache import KVCache
from colibri.engine.rope import Rope
from colibri.engine.run_state import RunState

TOL = 2e-5


def _close(a, b, tol=TOL):
    assert_close(a, b, tol)


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
    B, H, Hkv, S, L, Dh = 2, 6, 2, 3, 5, 8
    q = rng.normal(size=(B, H, S, Dh)).astype(np.float32)
    k = rng.normal(size=(B, Hkv, L, Dh)).astype(np.float32)
    v = rng.normal(size=(B, Hkv, L, Dh)).astype(np.float32)
    valid = np.ones((B, L), bool)
    valid[1, :3] = False                                    # sequence 1: 3 pad slots
    mask = build_mask(valid, S)
    out = attend(q, k, v, mask, Dh ** -0.5)
    G = H // Hkv
    for b in range(B):
        for h in range(H):
            for t in range(S):
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
    import colibri.engine.attention as att
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
    """x (N, C) -> x @ W^T (+ b), or into out (N, R): a projection as Attention takes it."""
    w = lin.weight.detach().numpy().copy()
    b = None if lin.bias is None else lin.bias.detach().numpy().copy()

    def proj(x, out=None):
        y = x @ w.T if b is None else x @ w.T + b
        if out is None:
            return y
        out[...] = y
        return out
    return proj


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


def _ref_mask(valid, S, window):
    """transformers' additive 4-D mask (B, 1, S, L) for eager attention."""
    allowed = build_mask(valid, S, window)
    return torch.from_numpy(np.where(allowed, 0.0, torch.finfo(torch.float32).min)
                            .astype(np.float32)[:, None])


@pytest.mark.parametrize("name", ["mixtral", "mixtral_window", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_layer_matches_transformers_with_padding_and_cache(name):
    cfg, ref, ref_rope, ours, rope = _build(name)
    rng = np.random.default_rng(5)
    B, S = 2, 7
    x = rng.normal(size=(B, S, cfg.hidden_size)).astype(np.float32)
    valid = np.ones((B, S), bool)
    valid[1, :3] = False                                     # left padding of sequence 1
    pos = np.clip(np.cumsum(valid, axis=1) - 1, 0, None)
    window = ours.window
    with torch.no_grad():
        cos_t, sin_t = ref_rope(torch.from_numpy(x), torch.from_numpy(pos))
        want = ref(torch.from_numpy(x), (cos_t, sin_t), _ref_mask(valid, S, window))[0].numpy()
    cos, sin = rope.cos_sin(pos)
    got = ours(x, cos, sin, build_mask(valid, S, window))
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
# one token of one sequence (B = S = 1, nothing masked) against the general path
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mixtral", "mixtral_window", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_decode_matches_general_path(name):
    """Attention.decode through a cache: __call__'s result within the compiled attention's
    rounding (its own summation order), the same keys and values in the cache."""
    cfg, _, _, ours, rope = _build(name)
    rng = np.random.default_rng(6)
    S, P, Hkv, Dh = 11, 16, cfg.num_key_value_heads, ours.head_dim
    x = rng.normal(size=(1, S, cfg.hidden_size)).astype(np.float32)
    pos = np.arange(S)[None] + 2
    general, step = KVCache(2, 1, Hkv, P, Dh), KVCache(2, 1, Hkv, P, Dh)
    state = RunState(cfg.hidden_size, ours.n_heads, Hkv, Dh, ours.eps)
    cos, sin = rope.cos_sin(pos[:, :3])
    for cache in (general, step):                       # a prompt of 3, general path, layer 1
        ours(x[:, :3], cos, sin, build_mask(np.ones((1, 3), bool), 3, ours.window), cache, 1)
        cache.commit(np.ones((1, 3), bool), pos[:, :3])
    for s in range(3, S):
        cos, sin = rope.cos_sin(pos[:, s:s + 1])
        mask = build_mask(np.ones((1, s + 1), bool), 1, ours.window)
        want = ours(x[:, s:s + 1], cos, sin, mask, general, 1)[0]
        got = ours.decode(x[0, s:s + 1], *rope.cos_sin_one(int(pos[0, s])), step, 1, state)
        assert got.shape == want.shape and got is state.o
        _close(got, want, 1e-5)
        for cache in (general, step):
            cache.commit(np.ones((1, 1), bool), pos[:, s:s + 1])
    np.testing.assert_array_equal(step.k[1][:, :, :S], general.k[1][:, :, :S])
    np.testing.assert_array_equal(step.v[1][:, :, :S], general.v[1][:, :, :S])
    assert not step.k[0].any()                          # only the given layer was written
