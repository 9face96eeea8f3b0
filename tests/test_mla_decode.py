"""The compiled absorbed MLA decode step (csrc/mla.h through kernels.prepare_mla_absorbed,
MLA.decode): against the float64 NumPy form (_reference.mla_absorbed_ref) on every kv_b
format and cache dtype, every ISA path against scalar, any thread count the same bits, the
cache write, MLA.decode against the general path (MLA.__call__), argument errors. The
transformers parity of whole DeepSeek models is tests/test_family_deepseek_v2.py / v3.
"""
from __future__ import annotations

import numpy as np
import pytest

from colibri import kernels as K
from colibri.kernels import runtime
from colibri.kernels import _reference as Ref
from colibri.engine.kv_cache import KVCache, to_f32, to_storage
from colibri.engine.mla import MLA
from colibri.engine.rope import Rope
from colibri.engine.run_state import RunState
from colibri.kernels.weights import WeightRef
from kernel_helpers import F32, rng_for
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)

# (H, Dn, Dv, Rkv, Dr, n): Rkv % 64 == 0 (the register body of the transposed product) and
# not (the panel body), Rkv / Dr multiples of 16 (AVX-512 attention), of 8 only (AVX2), of
# neither (scalar), one position and several blocks of 64.
SHAPES = [(4, 16, 16, 64, 16, 1), (4, 16, 16, 64, 16, 70), (3, 8, 12, 96, 8, 13),
          (2, 24, 8, 128, 32, 130), (2, 5, 7, 37, 6, 9)]
FORMATS = ["f32", "f16", "bf16", "q8", "q4"]
CACHE_DTYPES = ["f32", "f16", "bf16"]


def _case(key, shape, fmt, kv_dtype):
    """kv_b, a cache with n - 1 random slots, the step's inputs (q, q_rope, c, kr)."""
    H, Dn, Dv, R, Dr, n = shape
    rng = rng_for("mla", key, shape, fmt, kv_dtype)
    w = (rng.standard_normal((H * (Dn + Dv), R)) * R ** -0.5).astype(F32)
    kv_b = WeightRef.from_array(w, fmt, 32 if fmt in ("q8", "q4") else 0)
    cache = KVCache(1, 2, 1, n + 3, R, value_dim=Dr, dtype=kv_dtype)
    cache.k[0][0, 0, :n - 1] = to_storage(rng.standard_normal((n - 1, R)).astype(F32), kv_dtype)
    cache.v[0][0, 0, :n - 1] = to_storage(rng.standard_normal((n - 1, Dr)).astype(F32),
                                          kv_dtype)
    cache.length = n - 1
    q = (rng.standard_normal((H, Dn + Dr)) * 2).astype(F32)
    q_rope = np.ascontiguousarray(q[:, Dn:])
    c = rng.standard_normal((1, R)).astype(F32)
    kr = rng.standard_normal((1, Dr)).astype(F32)
    return kv_b, cache, q, q_rope, c, kr


def _run(kv_b, cache, q, q_rope, c, kr, shape, threads=1, scale=0.3):
    H, Dn, Dv = shape[:3]
    out = np.full((1, H * Dv), np.nan, F32)
    K.prepare_mla_absorbed(kv_b, H, Dn, Dv, threads=threads)(
        q, q_rope, cache.k[0], cache.v[0], c, kr, cache.length, scale, out)
    return out[0]


def _cases(formats):
    """(shape, format) pairs: q8 / q4 rows need Rkv a multiple of 32."""
    return [pytest.param(s, f, id="x".join(map(str, s)) + "-" + f) for s in SHAPES
            for f in formats if f not in ("q8", "q4") or s[3] % 32 == 0]


@pytest.mark.parametrize("kv_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("shape, fmt", _cases(FORMATS))
def test_absorbed_matches_reference(isa, shape, fmt, kv_dtype):
    kv_b, cache, q, q_rope, c, kr = _case("ref", shape, fmt, kv_dtype)
    n, Dn = shape[5], shape[1]
    got = _run(kv_b, cache, q, q_rope, c, kr, shape)
    # the new rows went to slot n - 1, rounded to the cache's dtype; nothing else changed
    assert np.array_equal(cache.k[0][0, 0, n - 1], to_storage(c[0], kv_dtype))
    assert np.array_equal(cache.v[0][0, 0, n - 1], to_storage(kr[0], kv_dtype))
    assert not cache.k[0][1].any() and not cache.k[0][0, 0, n:].any()
    lat, rot = to_f32(cache.k[0][0, 0, :n]), to_f32(cache.v[0][0, 0, :n])
    want = Ref.mla_absorbed_ref(q[:, :Dn], q_rope, Ref.dequantize_ref(kv_b), lat, rot, 0.3)
    assert np.abs(want).max() > 0.05                                 # informative
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-6 * np.abs(want).max())
    for threads in (2, 3):                                           # the same bits
        cache.k[0][0, 0, n - 1] = 0
        assert np.array_equal(_run(kv_b, cache, q, q_rope, c, kr, shape, threads), got)


@pytest.mark.parametrize("shape, fmt", _cases(["f32", "bf16", "q8", "q4"]))
def test_isa_paths_agree_with_scalar(shape, fmt):
    previous = runtime.get_isa()
    try:
        runtime.set_isa("scalar")
        want = _run(*_case("isa", shape, fmt, "f16"), shape)
        for name in runtime.available_isas():
            runtime.set_isa(name)
            got = _run(*_case("isa", shape, fmt, "f16"), shape)
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max(),
                                       err_msg=name)
    finally:
        runtime.set_isa(previous)


def test_dominant_score_and_nan():
    """A dominant score takes all the weight (no NaN from the underflowing others); a NaN
    in the query makes its head NaN and leaves the others alone."""
    shape = (4, 16, 16, 64, 16, 20)
    kv_b, cache, q, q_rope, c, kr = _case("extremes", shape, "q8", "f32")
    q_rope[:] = 0
    q[:, :16] = 0
    q_rope[0, 0] = 1e4                     # head 0: all weight on the slot with the top kr
    cache.v[0][0, 0, :20, 0] = 0
    cache.v[0][0, 0, 7, 0] = 1.0
    q[2, 3] = np.nan
    got = _run(kv_b, cache, q, q_rope, c, kr, shape).reshape(4, 16)
    W = Ref.dequantize_ref(kv_b).reshape(4, 32, 64)[:, 16:]          # (H, Dv, Rkv)
    np.testing.assert_allclose(got[0], W[0] @ cache.k[0][0, 0, 7], rtol=1e-5, atol=1e-6)
    assert np.isnan(got[2]).all() and np.isfinite(got[[0, 1, 3]]).all()


def _projection(w):
    def proj(x, out=None):
        y = (x @ w.T).astype(F32)
        if out is None:
            return y
        out[...] = y
        return out
    return proj


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("fmt", ["f32", "q4"])
def test_decode_matches_general_path(fmt, kv_dtype):
    """MLA.decode (compiled absorbed step) token by token against MLA.__call__ (every latent
    expanded through kv_b, NumPy attention) over the same weights and cache contents."""
    D, H, Dn, Dr, Dv, R = 48, 4, 16, 8, 12, 64
    rng = rng_for("mla-general", fmt, kv_dtype)

    def rand(r, c):
        return (rng.standard_normal((r, c)) * c ** -0.5).astype(F32)
    kv_b = WeightRef.from_array(rand(H * (Dn + Dv), R), fmt, 32 if fmt == "q4" else 0)
    mla = MLA(wq=_projection(rand(H * (Dn + Dr), D)), wq_a=None, q_a_norm=None, wq_b=None,
              wkv_a=_projection(rand(R + Dr, D)),
              kv_a_norm=(1 + 0.1 * rng.standard_normal(R)).astype(F32),
              wkv_b=_projection(K.dequantize(kv_b)), wo=_projection(rand(D, H * Dv)),
              kv_b=kv_b, n_heads=H, nope_dim=Dn, rope_dim=Dr, v_dim=Dv, kv_rank=R,
              scale=(Dn + Dr) ** -0.5, threads=2)
    rope, state = Rope(Dr, 10000.0), RunState(D, H, H, Dr, 1e-6)
    a = KVCache(1, 1, 1, 12, R, value_dim=Dr, dtype=kv_dtype)
    b = KVCache(1, 1, 1, 12, R, value_dim=Dr, dtype=kv_dtype)
    for pos in range(12):
        x = rng.standard_normal((1, D)).astype(F32)
        cos, sin = rope.cos_sin_one(pos)
        got = mla.decode(x, cos, sin, a, 0, state).copy()
        c3, s3 = rope.cos_sin(np.array([[pos]]))
        want = mla(x[None], c3, s3, np.ones((1, 1, pos + 1), bool), b, 0)[0]
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
        assert np.array_equal(a.k[0], b.k[0]) and np.array_equal(a.v[0], b.v[0])
        a.commit_one(pos)
        b.commit_one(pos)


def test_argument_errors():
    shape = (4, 16, 16, 64, 16, 5)
    kv_b, cache, q, q_rope, c, kr = _case("errors", shape, "q4", "f16")
    p = K.prepare_mla_absorbed(kv_b, 4, 16, 16)
    out = np.empty((1, 64), F32)
    with pytest.raises(ValueError, match="n_heads \\* \\(nope_dim \\+ v_dim\\) = 132"):
        K.prepare_mla_absorbed(kv_b, 4, 17, 16)
    with pytest.raises(ValueError, match="kv_b must be a WeightRef"):
        K.prepare_mla_absorbed(np.zeros((128, 64), F32), 4, 16, 16)
    with pytest.raises(ValueError, match="slot 8 is not inside the cache's 8 slots"):
        p(q, q_rope, cache.k[0], cache.v[0], c, kr, 8, 0.3, out)
    with pytest.raises(ValueError, match="differ in dtype"):
        p(q, q_rope, cache.k[0], cache.v[0].view(np.uint16), c, kr, 4, 0.3, out)
    with pytest.raises(ValueError, match="c_new \\(1, 63\\)"):
        p(q, q_rope, cache.k[0], cache.v[0], c[:, :63].copy(), kr, 4, 0.3, out)
    with pytest.raises(ValueError, match="out has shape \\(1, 60\\)"):
        p(q, q_rope, cache.k[0], cache.v[0], c, kr, 4, 0.3, out[:, :60].copy())
    with pytest.raises(ValueError, match="must not overlap"):
        p(q, q_rope, cache.k[0], cache.v[0], c, kr, 4, 0.3, q.reshape(1, -1)[:, :64])
    with pytest.raises(ValueError, match="q_rope"):
        p(q, q_rope[:3].copy(), cache.k[0], cache.v[0], c, kr, 4, 0.3, out)
