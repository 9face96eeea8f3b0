"""The expert FFN (expert_ffn, swiglu) against the reference: every format, all tokens on one
expert, bit-identity across threads, mixed formats, argument and id errors.
"""
from __future__ import annotations

import numpy as np
import pytest

from colibri import kernels as K
from colibri.kernels.weights import WeightRef
from colibri.kernels import _reference as R
from kernel_helpers import (
    F32, FORMATS, THREADS, assert_ffn_close, ffn_dims, make_experts, poison_expert, rng_for)
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_ffn_matches_reference(isa, threads, fmt):
    rng = rng_for("ffn", fmt)
    D, I, G = ffn_dims(fmt)
    E = 5
    wg, wu, wd = make_experts(rng, E, D, I, (fmt,) * 3, G)
    poison_expert(wg, wu, wd, 3)                    # expert 3 is never chosen below
    choices = np.array([0, 1, 2, 4])
    for T, Kk in [(1, 1), (1, 2), (7, 2), (33, 3)]:
        x = rng.standard_normal((T, D)).astype(F32)
        ids = np.stack([rng.choice(choices, size=Kk, replace=False) for _ in range(T)])
        ids = ids.astype(np.int32)
        weights = rng.random((T, Kk)).astype(F32)
        y = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=threads)
        assert y.shape == (T, D) and y.dtype == F32 and np.isfinite(y).all()
        assert_ffn_close(y, R.expert_ffn_ref(x, ids, weights, wg, wu, wd), f"T={T} K={Kk}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_ffn_all_tokens_on_one_expert(isa, fmt):
    rng = rng_for("one", fmt)
    D, I, G = ffn_dims(fmt)
    wg, wu, wd = make_experts(rng, 4, D, I, (fmt,) * 3, G)
    poison_expert(wg, wu, wd, 3)
    T = 21
    x = rng.standard_normal((T, D)).astype(F32)
    ids = np.full((T, 1), 1, np.int32)
    weights = np.ones((T, 1), F32)
    y = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=2)
    assert_ffn_close(y, R.expert_ffn_ref(x, ids, weights, wg, wu, wd))
    # and equals the dense FFN of that expert
    assert_ffn_close(y, K.swiglu(x, wg.expert(1), wu.expert(1), wd.expert(1)))
    # every token on the same pair, and a token listing one expert twice
    ids2 = np.tile(np.array([[2, 0]], np.int32), (T, 1))
    ids2[5] = [2, 2]
    w2 = rng.random((T, 2)).astype(F32)
    y2 = K.expert_ffn(x, ids2, w2, wg, wu, wd, threads=2)
    assert_ffn_close(y2, R.expert_ffn_ref(x, ids2, w2, wg, wu, wd))


@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_ffn_bit_identical_across_threads(isa, fmt):
    rng = rng_for("ffn-threads", fmt)
    D, I, G = ffn_dims(fmt)
    wg, wu, wd = make_experts(rng, 6, D, I, (fmt,) * 3, G)
    T = 40
    x = rng.standard_normal((T, D)).astype(F32)
    ids = np.argsort(rng.random((T, 6)), axis=1)[:, :2].astype(np.int32)
    weights = rng.random((T, 2)).astype(F32)
    y1 = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=1)
    for n in (2, 3):
        assert np.array_equal(K.expert_ffn(x, ids, weights, wg, wu, wd, threads=n), y1)
    xc = x.copy()                                   # out may be x itself
    K.expert_ffn(xc, ids, weights, wg, wu, wd, threads=2, out=xc)
    assert np.array_equal(xc, y1)


def test_expert_ffn_mixed_formats(isa):
    rng = np.random.default_rng(11)
    D, I = 64, 128
    wg, wu, wd = make_experts(rng, 3, D, I, ("q4", "q8", "bf16"), 64)
    x = rng.standard_normal((9, D)).astype(F32)
    ids = rng.integers(0, 3, size=(9, 2)).astype(np.int32)
    weights = rng.random((9, 2)).astype(F32)
    y = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=2)
    assert_ffn_close(y, R.expert_ffn_ref(x, ids, weights, wg, wu, wd))


def test_expert_ffn_argument_errors():
    rng = np.random.default_rng(2)
    wg, wu, wd = make_experts(rng, 3, 32, 64, ("f32",) * 3, 0)
    x = np.ones((2, 32), F32)
    w = np.ones((2, 2), F32)
    with pytest.raises(ValueError, match="0..2"):
        K.expert_ffn(x, np.array([[0, 3], [1, 2]]), w, wg, wu, wd)
    with pytest.raises(ValueError, match="weights"):
        K.expert_ffn(x, np.array([[0, 1], [1, 2]]), np.ones((2, 3), F32), wg, wu, wd)
    with pytest.raises(ValueError, match="disagree"):
        K.expert_ffn(x, np.array([[0, 1], [1, 2]]), w, wg, wu, wg)
    with pytest.raises(ValueError, match="columns"):
        K.expert_ffn(np.ones((2, 31), F32), np.array([[0, 1], [1, 2]]), w, wg, wu, wd)
    y = K.expert_ffn(np.empty((0, 32), F32), np.empty((0, 2), np.int32), np.empty((0, 2), F32),
                     wg, wu, wd)
    assert y.shape == (0, 32)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_swiglu_matches_reference(isa, threads, fmt):
    rng = rng_for("swiglu", fmt)
    D, I, G = ffn_dims(fmt)
    wg, wu, wd = (w.expert(0) for w in make_experts(rng, 1, D, I, (fmt,) * 3, G))
    for T in (1, 6):
        x = rng.standard_normal((T, D)).astype(F32)
        y = K.swiglu(x, wg, wu, wd, threads=threads)
        assert_ffn_close(y, R.swiglu_ref(x, wg, wu, wd), f"T={T}")
    stack = make_experts(rng, 2, D, I, (fmt,) * 3, G)
    with pytest.raises(ValueError, match="n_experts"):
        K.swiglu(x, *stack)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8])
@pytest.mark.parametrize("bad, where", [(8, (1, 0)), (-1, (0, 1))])
def test_expert_ffn_rejects_out_of_range_ids(dtype, bad, where):
    """An id outside 0..E-1 is a ValueError before any weight is read, whatever its dtype
    (int32 ids, what route_topk returns, are checked once, in the compiled kernel)."""
    if bad < 0 and np.dtype(dtype).kind == "u":
        pytest.skip("unsigned ids cannot be negative")
    rng = np.random.default_rng(9)
    E, D, I = 8, 64, 32
    ws = [WeightRef.from_array(rng.standard_normal(s).astype(np.float32), "q4", 32)
          for s in ((E, I, D), (E, I, D), (E, D, I))]
    x = rng.standard_normal((2, D)).astype(np.float32)
    ids = np.array([[0, 1], [2, 3]], dtype=dtype)
    ids[where] = bad
    w = np.full((2, 2), 0.5, np.float32)
    with pytest.raises(ValueError, match=f"{bad}"):
        K.expert_ffn(x, ids, w, *ws, threads=1)
    with pytest.raises(ValueError, match=f"{bad}"):
        K.group_by_expert(ids, E)
