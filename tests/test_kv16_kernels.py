"""The 16-bit KV cache's kernels: the rounding of the cache write (compiled and NumPy, the
same bits), attend_decode / attend_cached_into over f16 and bf16 planes against the NumPy
reference (the planes widened by kv_cache.to_f32, then _reference.attend_decode_ref) on
every forced ISA path and against the scalar body, and the argument errors.
"""
from __future__ import annotations

import numpy as np
import pytest

from colibri.kernels import _reference as R
from colibri import kernels as K
from colibri.kernels import runtime
from colibri.engine.kv_cache import KV_DTYPES, to_f32, to_storage
from kernel_helpers import F32, rng_for
from kernel_helpers import isa  # noqa: F401 (fixture)

# (H, Hkv, Dh, n): Dh % 16 == 0 runs the AVX-512 body on its paths (G = 3 and 6: a partial
# group of 4 heads; Dh 48 and 80: a partial pass of 4 vectors), other Dh % 8 == 0 the AVX2
# body, the rest the scalar one
SHAPES = [(16, 4, 64, 100), (8, 2, 64, 9), (6, 2, 48, 21), (12, 2, 80, 33), (6, 2, 8, 13),
          (4, 4, 24, 1), (8, 1, 128, 37), (2, 2, 5, 7), (4, 2, 40, 70)]
ATOL = 2e-6          # of max |out|: the f32 kernel's bound, unchanged by the storage
PATH_ATOL = 5e-6     # SIMD vs scalar at large scores (the exp polynomial): as for f32 planes


def _planes(rng, H, Hkv, Dh, n, dtype, spread=2.0):
    """q (H, Dh) float32; k, v strided (Hkv, n, Dh) slices of larger planes of `dtype`."""
    q = rng.standard_normal((H, Dh)).astype(F32)
    k = to_storage((rng.standard_normal((Hkv, n + 10, Dh)) * spread).astype(F32), dtype)
    v = to_storage(rng.standard_normal((Hkv, n + 10, Dh)).astype(F32), dtype)
    return q, k[:, 3:3 + n], v[:, 3:3 + n]


def _special_values() -> np.ndarray:
    """float32 values at the edges of both 16-bit formats: ties, subnormals, overflow."""
    f16_max, tiny = 65504.0, 2.0 ** -24
    edges = [0.0, -0.0, 1.0, -1.0, 1 + 2 ** -11, 1 + 3 * 2 ** -11, 1 + 2 ** -8, 1 + 3 * 2 ** -8,
             f16_max, 65519.996, 65520.0, -65520.0, 1e9, np.inf, -np.inf, tiny, tiny / 2,
             tiny * 1.5, tiny * 0.51, 2 ** -14, 2 ** -14 * (1 - 2 ** -11), 2 ** -25,
             2 ** -26, 3.0e38, np.finfo(F32).max, np.finfo(F32).tiny, 1e-45]
    rng = rng_for("kv16-values")
    scaled = [rng.standard_normal(2000) * s for s in (1e-7, 1e-5, 1e-3, 1.0, 1e3, 6e4, 1e30)]
    bits = rng.integers(0, 2 ** 32, 4000, dtype=np.uint64).astype(np.uint32).view(F32)
    x = np.concatenate([np.array(edges), *scaled]).astype(F32)
    x = np.concatenate([x, bits[np.isfinite(bits)]])
    return x[:x.size // 64 * 64].reshape(-1, 64)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_cache_write_rounds_to_nearest_even_as_numpy(dtype):
    """attend_cached's write of k_new / v_new gives NumPy's bits (float16 cast,
    quant.f32_to_bf16: round to nearest, ties to even, inf past the range)."""
    x = _special_values()                                                     # (N, 64)
    N = x.shape[0]
    want = to_storage(x, dtype)
    kc = np.zeros((1, N, 4, 64), dtype=want.dtype)
    vc = np.zeros_like(kc)
    out = np.empty((N, 64), F32)
    K.attend_cached_into(np.zeros((N, 64), F32), kc, vc, x, -x, 2, 2, 0.125, out, 1)
    assert np.array_equal(kc[0, :, 2].view(np.uint16), want.view(np.uint16))
    assert np.array_equal(vc[0, :, 2].view(np.uint16), to_storage(-x, dtype).view(np.uint16))
    # the numbers themselves: within half a unit of the last place, ties to even
    wide = to_f32(want).astype(np.float64)
    ok = np.isfinite(wide)
    ulp = {"f16": 2.0 ** -10, "bf16": 2.0 ** -7}[dtype]
    err = np.abs(wide[ok] - x[ok].astype(np.float64))
    floor = 2.0 ** -25 if dtype == "f16" else 2.0 ** -134   # half the subnormal spacing
    assert (err <= np.abs(x[ok]) * ulp / 2 + floor).all()
    assert to_f32(to_storage(np.array([1 + 2 ** -11], F32), "f16"))[0] == 1.0     # tie: even
    assert to_f32(to_storage(np.array([1 + 3 * 2 ** -11], F32), "f16"))[0] == 1 + 2 ** -9


def test_nan_stays_nan():
    x = np.full((1, 8), np.nan, F32)
    for dtype in ("f16", "bf16"):
        assert np.isnan(to_f32(to_storage(x, dtype))).all()
        kc = np.zeros((1, 1, 2, 8), dtype=to_storage(x, dtype).dtype)
        out = np.empty((1, 8), F32)
        K.attend_cached_into(np.ones((1, 8), F32), kc, kc.copy(), x, x, 0, 0, 1.0, out, 1)
        assert np.isnan(to_f32(kc[0, 0, 0])).all() and np.isnan(out).all()


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attend_decode_matches_reference(isa, dtype, shape):
    """Every forced path, each storage dtype: the kernel reading the 16-bit planes gives
    the float64 reference over the widened planes (the storage adds no error of its own)."""
    H, Hkv, Dh, n = shape
    q, k, v = _planes(rng_for("kv16-attend", shape, dtype), H, Hkv, Dh, n, dtype)
    ref = R.attend_decode_ref(q, to_f32(k), to_f32(v), Dh ** -0.5)
    y = K.attend_decode(q, k, v, Dh ** -0.5, threads=1)
    np.testing.assert_allclose(y, ref, rtol=0, atol=ATOL * np.abs(ref).max())
    assert np.array_equal(K.attend_decode(q, k, v, Dh ** -0.5, threads=2), y)   # any count


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_isa_paths_agree_with_scalar(dtype, shape):
    H, Hkv, Dh, n = shape
    q, k, v = _planes(rng_for("kv16-isa", shape, dtype), H, Hkv, Dh, n, dtype, spread=6.0)
    previous = runtime.get_isa()
    try:
        runtime.set_isa("scalar")
        want = K.attend_decode(q, k, v, 0.3)
        # the 16-bit body is the f32 body over the widened values, on every path
        assert np.array_equal(K.attend_decode(q, np.ascontiguousarray(to_f32(k)),
                                              np.ascontiguousarray(to_f32(v)), 0.3), want)
        for name in runtime.available_isas():
            runtime.set_isa(name)
            got = K.attend_decode(q, k, v, 0.3)
            np.testing.assert_allclose(got, want, rtol=0, atol=PATH_ATOL * np.abs(want).max(),
                                       err_msg=name)
            wide = K.attend_decode(q, np.ascontiguousarray(to_f32(k)),
                                   np.ascontiguousarray(to_f32(v)), 0.3)
            assert np.array_equal(got, wide), name
    finally:
        runtime.set_isa(previous)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_attend_cached_is_write_then_attend(isa, dtype):
    """attend_cached_into on a cache of each dtype: the new row rounded into slot `slot`,
    then the same bits as attend_decode over slots start..slot; a sliding window (start > 0)
    and batch > 1 (sequence 0 only is touched)."""
    rng = rng_for("kv16-cached", dtype)
    H, Hkv, S, Dh = 8, 2, 40, 64
    kc = to_storage(rng.standard_normal((2, Hkv, S, Dh)).astype(F32), dtype)
    vc = to_storage(rng.standard_normal((2, Hkv, S, Dh)).astype(F32), dtype)
    q = rng.standard_normal((H, Dh)).astype(F32)
    kn, vn = (rng.standard_normal((Hkv, Dh)).astype(F32) for _ in range(2))
    before = kc[1].copy()
    for slot, start in ((17, 0), (30, 11), (0, 0)):
        out = np.empty((H, Dh), F32)
        K.attend_cached_into(q, kc, vc, kn, vn, slot, start, 0.125, out, 1)
        assert np.array_equal(kc[0, :, slot].view(np.uint8), to_storage(kn, dtype).view(np.uint8))
        assert np.array_equal(vc[0, :, slot].view(np.uint8), to_storage(vn, dtype).view(np.uint8))
        want = K.attend_decode(q, kc[0, :, start:slot + 1], vc[0, :, start:slot + 1], 0.125)
        assert np.array_equal(out, want)
    assert np.array_equal(kc[1], before)


def test_dtype_errors():
    q = np.zeros((4, 8), F32)
    k = np.zeros((2, 3, 8), np.float64)
    with pytest.raises(ValueError, match="float32, float16 or uint16"):
        K.attend_decode(q, k, k, 1.0)
    with pytest.raises(ValueError, match="same dtype"):
        K.attend_decode(q, np.zeros((2, 3, 8), np.float16), np.zeros((2, 3, 8), np.uint16), 1.0)
    out = np.empty((4, 8), F32)
    kc = np.zeros((1, 2, 5, 8), np.float16)
    new = np.zeros((2, 8), F32)
    with pytest.raises(ValueError, match="differ in dtype"):
        K.attend_cached_into(q, kc, kc.astype(np.uint16), new, new, 0, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="k_cache must be a writable C-contiguous float32, "
                                         "float16 or uint16"):
        K.attend_cached_into(q, kc.astype(np.int16), kc, new, new, 0, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="k_new must be a C-contiguous float32"):
        K.attend_cached_into(q, kc, kc.copy(), new.astype(np.float16), new, 0, 0, 1.0, out, 1)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_widening_is_exact_on_every_path(isa, dtype):
    """kv_cache.to_f32 (kernels.kv_widen_into on rows of the slice) gives NumPy's widening
    bit for bit: whole planes, slices of positions, of columns (strided rows), one row, a
    1-D row, specials included."""
    x = _special_values()                                                     # (N, 64)
    plane = to_storage(x[:x.shape[0] // 2 * 2].reshape(1, 2, -1, 64), dtype)
    want = (np.asarray(plane, np.float32) if dtype == "f16"
            else (plane.astype(np.uint32) << 16).view(F32))
    for sl in (np.s_[:], np.s_[:, :, 3:77], np.s_[0, :, 5:6], np.s_[0, 1, :40], np.s_[..., :13],
               np.s_[0, 0, 0]):
        got = to_f32(plane[sl])
        assert got.dtype == F32 and got.flags.c_contiguous
        assert np.array_equal(got.view(np.uint32), want[sl].view(np.uint32)), sl


def test_widen_errors():
    out = np.empty((3, 8), F32)
    with pytest.raises(ValueError, match="float16 or uint16"):
        K.kv_widen_into(np.zeros((3, 8), F32), out)
    with pytest.raises(ValueError, match="contiguous rows"):
        K.kv_widen_into(np.zeros((3, 16), np.float16)[:, ::2], out)
    with pytest.raises(ValueError, match="expected"):
        K.kv_widen_into(np.zeros((3, 7), np.float16), out)
    with pytest.raises(ValueError, match="out must be a writable C-contiguous float32"):
        K.kv_widen_into(np.zeros((3, 8), np.float16), out.T)
