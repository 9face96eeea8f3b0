"""The decode step's row operations (rms_norm_rows, rope_rows, attend_cached) against the
reference and NumPy, and their argument errors.
"""
from __future__ import annotations

import numpy as np
import pytest

from colibri import kernels as K
from colibri.kernels import _reference as R
from colibri.engine.norms import rms_norm
from colibri.engine.rope import apply_rope
from kernel_helpers import F32, THREADS, rng_for
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)


ROW_SHAPES = [(1, 1), (1, 7), (1, 8), (3, 64), (1, 129), (1, 1024), (2, 2048), (1, 5000)]


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_rows_matches_reference_and_numpy(shape):
    """Within float32 rounding of the float64 twin, and the same bits as the NumPy code of
    the general path (norms.rms_norm: the same operations, summed in NumPy's order)."""
    rng = rng_for("rms-rows", shape)
    for scale in (1.0, 1e3, 1e-3):
        x = (rng.standard_normal(shape) * scale).astype(F32)
        w = rng.standard_normal(shape[1]).astype(F32)
        y = K.rms_norm_rows(x, w, 1e-5)
        np.testing.assert_allclose(y, R.rms_norm_rows_ref(x, w, 1e-5), rtol=2e-6,
                                   atol=1e-6 * np.abs(w).max())
        np.testing.assert_array_equal(y, rms_norm(x, w, 1e-5))
        np.testing.assert_array_equal(K.rms_norm_rows(x[0], w, 1e-5), y[0])    # 1-D x
        K.rms_norm_rows(x, w, 1e-5, out=x)                                     # in place
        np.testing.assert_array_equal(x, y)


def test_rope_rows_matches_reference_and_apply_rope():
    rng = rng_for("rope-rows")
    for N, Dh, h in [(20, 64, 32), (5, 128, 16), (3, 10, 4), (1, 2, 1)]:
        x = (rng.standard_normal((N, Dh)) * 3).astype(F32)
        ang = rng.uniform(0, 100, h).astype(F32)
        c, s = np.cos(ang), np.sin(ang)
        want = R.rope_rows_ref(x, c, s)
        numpy_ops = apply_rope(x[None, :, None], c, s)[0, :, 0]
        y = x.copy()
        assert K.rope_rows(y, c, s) is y
        np.testing.assert_allclose(y, want, rtol=0, atol=2e-6 * np.abs(want).max())
        np.testing.assert_array_equal(y, numpy_ops)
        np.testing.assert_array_equal(y[:, 2 * h:], x[:, 2 * h:])      # past R: unchanged


def test_row_ops_argument_errors():
    x, w = np.ones((2, 8), F32), np.ones(8, F32)
    with pytest.raises(ValueError, match="float32"):
        K.rms_norm_rows(x.astype(np.float64), w, 1e-5)
    with pytest.raises(ValueError, match="not contiguous"):
        K.rms_norm_rows(np.ones((8, 2), F32).T, w, 1e-5)
    with pytest.raises(ValueError, match="weight has 7 elements, expected 8"):
        K.rms_norm_rows(x, w[:7], 1e-5)
    with pytest.raises(ValueError, match="out has shape"):
        K.rms_norm_rows(x, w, 1e-5, out=np.empty((2, 9), F32))
    buf = np.ones(9, F32)
    with pytest.raises(ValueError, match="overlaps"):
        K.rms_norm_rows_into(buf[:8].reshape(2, 4), w[:4], 1e-5, buf[1:].reshape(2, 4))
    with pytest.raises(ValueError, match="writable"):
        ro = np.ones((2, 8), F32)
        ro.flags.writeable = False
        K.rope_rows(ro, np.ones(4, F32), np.ones(4, F32))
    with pytest.raises(ValueError, match="2h <= 8"):
        K.rope_rows(x.copy(), np.ones(5, F32), np.ones(5, F32))
    with pytest.raises(ValueError, match="same length"):
        K.rope_rows(x.copy(), np.ones(4, F32), np.ones(3, F32))
    with pytest.raises(ValueError):                       # the compiled form checks types too
        K.rms_norm_rows_into(x.astype(np.float64), w, 1e-5, x)


@pytest.mark.parametrize("threads", THREADS)
def test_attend_cached_equals_write_then_attend(isa, threads):
    """The cache write and the attention in one call: the same cache contents and the same
    bits as KVCache.write_one followed by attend_decode, for a whole cache and a window."""
    from colibri.engine.kv_cache import KVCache
    rng = rng_for("attend-cached", threads)
    H, Hkv, Dh, S = 8, 2, 16, 12
    for n_before, start in [(0, 0), (5, 0), (9, 4), (11, 11)]:
        caches = [KVCache(2, 1, Hkv, S, Dh) for _ in range(2)]
        old = rng.standard_normal((2, 1, Hkv, S, Dh)).astype(F32)
        for c in caches:
            c.k[1][...], c.v[1][...] = old
            c.length = n_before
        q = rng.standard_normal((H, Dh)).astype(F32)
        kn, vn = rng.standard_normal((2, Hkv, Dh)).astype(F32)
        k, v = caches[0].write_one(1, kn, vn, start)
        want = K.attend_decode(q, k, v, 0.25, threads=threads)
        got = np.full((H, Dh), np.nan, F32)
        K.attend_cached_into(q, caches[1].k[1], caches[1].v[1], kn, vn, n_before, start, 0.25,
                             got, threads)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(caches[1].k[1], caches[0].k[1])
        np.testing.assert_array_equal(caches[1].v[1], caches[0].v[1])


def test_attend_cached_argument_errors():
    H, Hkv, Dh, S = 4, 2, 8, 6
    q, out = np.ones((H, Dh), F32), np.empty((H, Dh), F32)
    kc, vc = np.zeros((1, Hkv, S, Dh), F32), np.zeros((1, Hkv, S, Dh), F32)
    kn = np.ones((Hkv, Dh), F32)
    with pytest.raises(ValueError, match="inside the cache"):
        K.attend_cached_into(q, kc, vc, kn, kn, S, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="inside the cache"):
        K.attend_cached_into(q, kc, vc, kn, kn, 2, 3, 1.0, out, 1)
    with pytest.raises(ValueError, match="multiple"):
        K.attend_cached_into(q[:3], kc, vc, kn, kn, 2, 0, 1.0, out[:3], 1)
    with pytest.raises(ValueError, match="k_new"):
        K.attend_cached_into(q, kc, vc, kn[:1], kn, 2, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="differ"):
        K.attend_cached_into(q, kc, np.zeros((1, Hkv, S - 1, Dh), F32), kn, kn, 2, 0, 1.0,
                             out, 1)
    with pytest.raises(ValueError, match=r"writable C-contiguous float32, float16 or uint16 "
                                         r"\(bf16\) array of 4"):
        K.attend_cached_into(q, kc[:, :, ::2], vc[:, :, ::2], kn, kn, 2, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="float32"):
        K.attend_cached_into(q.astype(np.float64), kc, vc, kn, kn, 2, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="overlap"):
        K.attend_cached_into(q, kc, vc, kn, kn, 2, 0, 1.0, q, 1)
    with pytest.raises(ValueError, match="overlap"):
        K.attend_cached_into(q, kc, kc, kn, kn, 2, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="threads"):
        K.attend_cached_into(q, kc, vc, kn, kn, 2, 0, 1.0, out, 0)
