"""Decode attention (attend_decode): against the reference, ISA paths against scalar,
extremes, argument errors.
"""
from __future__ import annotations

import numpy as np
import pytest

from colibri import kernels as K
from colibri.kernels import runtime
from colibri.kernels import _reference as R
from kernel_helpers import F32, rng_for
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)


ATTEND_SHAPES = [(16, 4, 64, 100), (4, 4, 24, 1), (6, 2, 8, 13), (8, 1, 128, 37), (2, 2, 5, 7),
                 (4, 2, 40, 9), (4, 2, 64, 8), (4, 2, 64, 16)]


def _attend_inputs(rng, H, Hkv, Dh, n, spread=2.0):
    """q (H, Dh); k, v strided slices (Hkv, n, Dh) of a larger cache, as the model passes."""
    q = rng.standard_normal((H, Dh)).astype(F32)
    k = (rng.standard_normal((Hkv, n + 10, Dh)) * spread).astype(F32)[:, 3:3 + n]
    v = rng.standard_normal((Hkv, n + 10, Dh)).astype(F32)[:, 3:3 + n]
    return q, k, v


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", ATTEND_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attend_decode_matches_reference(isa, threads, shape):
    H, Hkv, Dh, n = shape
    q, k, v = _attend_inputs(rng_for("attend", shape), H, Hkv, Dh, n)
    y = K.attend_decode(q, k, v, Dh ** -0.5, threads=threads)
    ref = R.attend_decode_ref(q, k, v, Dh ** -0.5)
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    assert np.array_equal(K.attend_decode(q, k, v, Dh ** -0.5, threads=3), y)   # any count


@pytest.mark.parametrize("shape", ATTEND_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attend_decode_isa_paths_agree_with_scalar(shape):
    H, Hkv, Dh, n = shape
    q, k, v = _attend_inputs(rng_for("attend-isa", shape), H, Hkv, Dh, n, spread=6.0)
    previous = runtime.get_isa()
    try:
        runtime.set_isa("scalar")
        want = K.attend_decode(q, k, v, 0.3)
        for name in runtime.available_isas():
            runtime.set_isa(name)
            got = K.attend_decode(q, k, v, 0.3)
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max(),
                                       err_msg=name)
    finally:
        runtime.set_isa(previous)


def test_attend_decode_extremes(isa):
    """A dominant score takes all the weight (exp underflows to 0 elsewhere, no NaN); a NaN
    or inf in q or k makes that head NaN and leaves the others alone; out= is filled."""
    rng = rng_for("attend-extremes")
    q, k, v = _attend_inputs(rng, 4, 2, 16, 11)
    k = np.ascontiguousarray(k)
    k[0, 5] = q[0] * 100                          # head 0 (kv head 0): position 5 dominates
    y = K.attend_decode(q, k, v, 1.0)
    np.testing.assert_allclose(y[0], v[0, 5], rtol=1e-6, atol=1e-6)
    assert np.isfinite(y).all()
    q[3, 2] = np.nan
    out = np.full((4, 16), 7.0, F32)
    K.attend_decode(q, k, v, 1.0, out=out)
    assert np.isnan(out[3]).all() and np.isfinite(out[:3]).all()
    np.testing.assert_array_equal(out[:3], y[:3])


def test_attend_decode_argument_errors():
    q, k, v = _attend_inputs(rng_for("attend-errors"), 4, 2, 16, 5)
    with pytest.raises(ValueError, match="multiple"):
        K.attend_decode(q[:3], k, v, 1.0)
    with pytest.raises(ValueError, match="must both be"):
        K.attend_decode(q, k, v[:, :4], 1.0)
    with pytest.raises(ValueError, match="n = 0"):
        K.attend_decode(q, k[:, :0], v[:, :0], 1.0)
    with pytest.raises(ValueError, match="out"):
        K.attend_decode(q, k, v, 1.0, out=np.empty((4, 15), F32))
    with pytest.raises(ValueError, match="overlap"):
        K.attend_decode(q, k, v, 1.0, out=q)
    with pytest.raises(ValueError, match="float32"):
        K.attend_decode(q, k.astype(np.float64), v, 1.0)
    # non-contiguous rows are copied, not misread
    kt = np.ascontiguousarray(np.swapaxes(np.ascontiguousarray(k), 1, 2))
    kf = np.swapaxes(kt, 1, 2)                    # (Hkv, n, Dh) with strided rows
    np.testing.assert_array_equal(K.attend_decode(q, kf, np.ascontiguousarray(v), 1.0),
                                  K.attend_decode(q, np.ascontiguousarray(k),
                                                  np.ascontiguousarray(v), 1.0))
