"""GPT-OSS's decode step compiled: the attention sinks inside the compiled attention
(kernels.attend_cached_sinks_into, csrc/attend.h) against the float64 reference
(_reference.attend_decode_ref with sinks) on every cache dtype, every ISA path against
scalar, any thread count the same bits, sinks of -inf the plain attention's bits,
Attention.decode with sinks (and a sliding window) against Attention.__call__, errors.
The transformers parity of whole GPT-OSS models is tests/test_family_gpt_oss.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from colibri import kernels as K
from colibri.kernels import runtime
from colibri.kernels import _reference as Ref
from colibri.engine.attention import Attention, build_mask
from colibri.engine.kv_cache import KVCache, to_f32, to_storage
from colibri.engine.rope import Rope
from colibri.engine.run_state import RunState
from kernel_helpers import F32, rng_for
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)

# (H, Hkv, Dh, S, slot, start): Dh a multiple of 16 (AVX-512 bodies), of 8 (AVX2), of
# neither (scalar); the whole cache, a window, one slot, several blocks of 64 positions.
SHAPES = [(8, 2, 64, 12, 9, 0), (8, 2, 64, 12, 9, 4), (4, 4, 24, 5, 0, 0),
          (6, 2, 8, 90, 80, 3), (4, 2, 12, 10, 7, 0), (16, 2, 32, 140, 139, 0)]
KV_DTYPES = ["f32", "f16", "bf16"]


def _case(key, shape, kv_dtype, sink_scale=3.0):
    H, Hkv, Dh, S, slot, start = shape
    rng = rng_for("sinks", key, shape, kv_dtype)
    cache = KVCache(1, 1, Hkv, S, Dh, dtype=kv_dtype)
    cache.k[0][...] = to_storage((rng.standard_normal((1, Hkv, S, Dh)) * 1.5).astype(F32),
                                 kv_dtype)
    cache.v[0][...] = to_storage(rng.standard_normal((1, Hkv, S, Dh)).astype(F32), kv_dtype)
    q = rng.standard_normal((H, Dh)).astype(F32)
    kn, vn = rng.standard_normal((2, Hkv, Dh)).astype(F32)
    # around log(n): a sink then takes a share of the mass comparable to the keys'
    sinks = (np.log(slot + 1 - start) + rng.standard_normal(H) * sink_scale).astype(F32)
    return cache, q, kn, vn, sinks


def _run(cache, q, kn, vn, sinks, shape, threads=1, scale=0.3):
    H, Hkv, Dh, S, slot, start = shape
    out = np.full((H, Dh), np.nan, F32)
    K.attend_cached_sinks_into(q, cache.k[0], cache.v[0], kn, vn, slot, start, scale, sinks,
                               out, threads)
    return out


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sinks_match_reference(isa, shape, kv_dtype):
    H, Hkv, Dh, S, slot, start = shape
    cache, q, kn, vn, sinks = _case("ref", shape, kv_dtype)
    got = _run(cache, q, kn, vn, sinks, shape)
    assert np.array_equal(cache.k[0][0, :, slot], to_storage(kn, kv_dtype))
    assert np.array_equal(cache.v[0][0, :, slot], to_storage(vn, kv_dtype))
    k, v = to_f32(cache.k[0][0, :, start:slot + 1]), to_f32(cache.v[0][0, :, start:slot + 1])
    want = Ref.attend_decode_ref(q, k, v, 0.3, sinks)
    plain = Ref.attend_decode_ref(q, k, v, 0.3)
    assert np.abs(want - plain).max() > 0.05 * np.abs(plain).max()    # the sinks matter
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    for threads in (2, 3):
        assert np.array_equal(_run(cache, q, kn, vn, sinks, shape, threads), got)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sinks_isa_paths_agree_with_scalar(shape):
    previous = runtime.get_isa()
    try:
        runtime.set_isa("scalar")
        want = _run(*_case("isa", shape, "f16", 6.0), shape)
        for name in runtime.available_isas():
            runtime.set_isa(name)
            got = _run(*_case("isa", shape, "f16", 6.0), shape)
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max(),
                                       err_msg=name)
    finally:
        runtime.set_isa(previous)


def test_sinks_extremes(isa):
    """Sinks of -inf give the plain attention's bits; a huge sink takes all the mass (the
    output 0, not NaN); a NaN in q makes its head NaN only."""
    shape = (8, 2, 64, 12, 9, 0)
    cache, q, kn, vn, sinks = _case("extremes", shape, "f16")
    plain = np.empty((8, 64), F32)
    K.attend_cached_into(q, cache.k[0], cache.v[0], kn, vn, 9, 0, 0.3, plain, 1)
    assert np.array_equal(_run(cache, q, kn, vn, np.full(8, -np.inf, F32), shape), plain)
    sinks[3] = 1e30
    q[5, 1] = np.nan
    got = _run(cache, q, kn, vn, sinks, shape)
    assert (got[3] == 0).all()
    assert np.isnan(got[5]).all() and np.isfinite(np.delete(got, 5, axis=0)).all()


def test_sinks_argument_errors():
    shape = (8, 2, 64, 12, 9, 0)
    cache, q, kn, vn, sinks = _case("errors", shape, "f32")
    with pytest.raises(ValueError, match="sinks has 7 elements, expected one per query head"):
        _run(cache, q, kn, vn, sinks[:7].copy(), shape)
    with pytest.raises(ValueError, match="sinks must be a C-contiguous float32 array"):
        _run(cache, q, kn, vn, sinks.astype(np.float64), shape)


def _projection(w, b):
    def proj(x, out=None):
        y = (x @ w.T + b).astype(F32)
        if out is None:
            return y
        out[...] = y
        return out
    return proj


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("kv_dtype", ["f32", "bf16"])
def test_attention_decode_with_sinks_matches_general_path(kv_dtype, window):
    """Attention.decode (the compiled call with the sinks) token by token against
    Attention.__call__ (NumPy attend with the sinks over the mask), GPT-OSS-shaped: biases,
    a scale, GQA, a sliding window or none."""
    D, H, Hkv, Dh = 40, 4, 2, 16
    rng = rng_for("sinks-layer", kv_dtype, window)

    def proj(r, c):
        return _projection((rng.standard_normal((r, c)) * c ** -0.5).astype(F32),
                           (0.1 * rng.standard_normal(r)).astype(F32))
    attn = Attention(proj(H * Dh, D), proj(Hkv * Dh, D), proj(Hkv * Dh, D), proj(D, H * Dh),
                     n_heads=H, n_kv_heads=Hkv, head_dim=Dh, window=window, threads=2,
                     scale=0.2, sinks=(2 * rng.standard_normal(H)).astype(F32))
    rope, state = Rope(Dh, 10000.0), RunState(D, H, Hkv, Dh, 1e-6)
    a = KVCache(1, 1, Hkv, 10, Dh, dtype=kv_dtype)
    b = KVCache(1, 1, Hkv, 10, Dh, dtype=kv_dtype)
    for pos in range(10):
        x = rng.standard_normal((1, D)).astype(F32)
        cos, sin = rope.cos_sin_one(pos)
        got = attn.decode(x, cos, sin, a, 0, state).copy()
        c3, s3 = rope.cos_sin(np.array([[pos]]))
        mask = build_mask(np.ones((1, pos + 1), bool), 1, window)
        want = attn(x[None], c3, s3, mask, b, 0)[0]
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
        a.commit_one(pos)
        b.commit_one(pos)


# ---------------------------------------------------------------------------------------------
# the biased experts of one token in one compiled call (kernels.prepare_biased_experts)
# ---------------------------------------------------------------------------------------------

# (E, K, D, I): GPT-OSS-like (K of E, I = D), and I != D, K = 1
EXPERT_SHAPES = [(8, 4, 64, 64), (6, 2, 96, 64), (4, 1, 64, 128)]
EXPERT_CASES = [("f32", "f32"), ("bf16", "f32"), ("q8", "f32"), ("q4", "f32"),
                ("mxfp4", "f32"), ("q8", "int16"), ("q4", "int8"), ("mxfp4", "int16"),
                ("mxfp4", "int8")]
# activations' tolerance against the NumPy loop (relative to the output's max): f32 and int16
# differ only by the activation's exp (a few ulp); int8's h codes may round the other way
# where h moved by an ulp
TOL = {"f32": 2e-6, "int16": 2e-5, "int8": 2e-3}


def _experts(key, shape, fmt, biased=True):
    from colibri.kernels.weights import WeightRef
    E, K, D, I = shape
    rng = rng_for("biased", key, shape, fmt, biased)

    def stack(r, c):
        return WeightRef.from_array((rng.standard_normal((E, r, c)) * c ** -0.5).astype(F32),
                                    fmt, 32 if fmt in ("q8", "q4", "mxfp4") else 0)
    ws = (stack(I, D), stack(I, D), stack(D, I))
    bs = ((0.3 * rng.standard_normal((E, I))).astype(F32),
          (0.3 * rng.standard_normal((E, I))).astype(F32),
          (0.3 * rng.standard_normal((E, D))).astype(F32)) if biased else (None,) * 3
    x = (2 * rng.standard_normal((1, D))).astype(F32)
    ids = rng.permutation(E)[:K].astype(np.int32)[None]
    w = rng.random((1, K)).astype(F32)
    return ws, bs, x, ids, w


def _biased(ws, bs, activation, threads=1, activations="f32"):
    from colibri.kernels.biased_experts import BiasedExperts
    return BiasedExperts(*ws, *bs, activation, 1.702, 1.5, threads, activations)


@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
@pytest.mark.parametrize("fmt, activations", EXPERT_CASES)
@pytest.mark.parametrize("shape", EXPERT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_biased_experts_decode_matches_loop_and_reference(isa, shape, fmt, activations,
                                                           activation):
    """One compiled call against BiasedExperts' loop of prepared linears (the spec: the same
    row kernels) and, with f32 activations, against the float64 reference; limit 1.5
    clamps a share of the gate and up values; any thread count the same bits."""
    ws, bs, x, ids, w = _experts("loop", shape, fmt)
    be = _biased(ws, bs, activation, 1, activations)
    got = np.full_like(x, np.nan)
    be(x, ids, w, got)
    want = be.reference(x, ids, w, np.empty_like(x))
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[activations] * np.abs(want).max())
    if activations == "f32":
        ref = Ref.biased_experts_ref(x, ids, w, *ws, *bs, activation, 1.702, 1.5)
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    for threads in (2, 3):
        again = np.empty_like(x)
        _biased(ws, bs, activation, threads, activations)(x, ids, w, again)
        assert np.array_equal(again, got)


@pytest.mark.parametrize("fmt", ["f32", "q4", "mxfp4"])
def test_biased_experts_isa_paths_agree_with_scalar(fmt):
    shape = (8, 4, 64, 64)
    ws, bs, x, ids, w = _experts("isa", shape, fmt)
    x *= 3                                         # past the limit more often
    previous = runtime.get_isa()
    try:
        runtime.set_isa("scalar")
        want = np.empty_like(x)
        _biased(ws, bs, "swigluoai")(x, ids, w, want)
        for name in runtime.available_isas():
            runtime.set_isa(name)
            got = np.empty_like(x)
            _biased(ws, bs, "swigluoai")(x, ids, w, got)
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max(),
                                       err_msg=name)
    finally:
        runtime.set_isa(previous)


def test_biased_experts_repeated_id_as_the_loop():
    """A token choosing one expert twice: both slots, in slot order, as the loop (its
    np.add.at) up to the activation's ulp."""
    ws, bs, x, ids, w = _experts("repeat", (8, 4, 64, 64), "q8")
    ids[0, 2] = ids[0, 0]
    be = _biased(ws, bs, "swigluoai")
    got = np.empty_like(x)
    be(x, ids, w, got)
    np.testing.assert_allclose(got, be.reference(x, ids, w, np.empty_like(x)), rtol=0,
                               atol=2e-6 * np.abs(got).max())
    ref = Ref.biased_experts_ref(x, ids, w, *ws, *bs, "swigluoai", 1.702, 1.5)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_biased_experts_without_biases_and_nan():
    """No biases (a silu model with biases absent); a NaN input gives NaN, as the loop."""
    ws, bs, x, ids, w = _experts("nobias", (6, 2, 96, 64), "q8", biased=False)
    be = _biased(ws, bs, "swigluoai")
    got = np.empty_like(x)
    be(x, ids, w, got)
    np.testing.assert_allclose(got, be.reference(x, ids, w, np.empty_like(x)), rtol=0,
                               atol=2e-6 * np.abs(got).max())
    x[0, 5] = np.nan
    be(x, ids, w, got)
    assert np.isnan(got).all() and np.isnan(be.reference(x, ids, w, np.empty_like(x))).all()


def test_biased_experts_decode_errors():
    ws, bs, x, ids, w = _experts("errors", (8, 4, 64, 64), "q8")
    p = K.prepare_biased_experts(*ws, *bs, "swigluoai", 1.702, 7.0)
    out = np.empty_like(x)
    with pytest.raises(ValueError, match="expert id 8 is out of range for 8 experts"):
        p(x, np.array([[0, 1, 2, 8]], np.int32), w, out)
    with pytest.raises(ValueError, match="must be \\(1, 64\\) \\(one token\\)"):
        p(np.ones((2, 64), F32), ids, w, np.empty((2, 64), F32))
    with pytest.raises(ValueError, match="must not overlap"):
        p(x, ids, w, x)
    with pytest.raises(ValueError, match="b_up has shape \\(8, 63\\), expected \\(8, 64\\)"):
        K.prepare_biased_experts(*ws, bs[0], bs[1][:, :63], bs[2], "swigluoai", 1.7, 7.0)
    with pytest.raises(ValueError, match="activation must be 'swigluoai' or 'silu'"):
        K.prepare_biased_experts(*ws, *bs, "gelu", 1.7, 7.0)
