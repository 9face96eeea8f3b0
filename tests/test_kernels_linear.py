"""linear on the row kernel (below GEMM_MIN tokens): against the reference, expert stacks,
argument errors, bit-identity across threads and token blocks, ISA paths against scalar.
"""
from __future__ import annotations

import numpy as np
import pytest

from colibri import _kernels, dtypes, kernels as K
from colibri.kernels import runtime
from colibri.kernels.weights import WeightRef
from colibri.kernels import _reference as R
from kernel_helpers import (
    F32, FORMATS, GEMM_MIN, THREADS, assert_dot_close, ffn_dims, magnitude, make_experts,
    make_weight, rng_for)
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)


PLAIN_SHAPES = [(1, 1, 1), (1, 33, 7), (3, 17, 45), (9, 67, 100), (6, 5, 300)]      # T, R, C
QUANT_SHAPES = [(1, 1, 32, 32), (1, 37, 128, 64), (5, 19, 256, 128), (9, 13, 96, 32)]


def linear_cases(fmt):
    if fmt in dtypes.QUANTIZED:
        return QUANT_SHAPES
    return [(T, Rr, C, 0) for T, Rr, C in PLAIN_SHAPES]


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_matches_reference(isa, threads, fmt):
    rng = rng_for("linear", fmt)
    for T, Rr, C, G in linear_cases(fmt):
        w, _ = make_weight(rng, (Rr, C), fmt, G)
        x = rng.standard_normal((T, C)).astype(F32)
        y = K.linear(x, w, threads=threads)
        assert y.shape == (T, Rr) and y.dtype == F32
        assert_dot_close(y, R.linear_ref(x, w), magnitude(x, w), f"{fmt} T={T} R={Rr} C={C}")
        bias = rng.standard_normal(Rr).astype(F32)
        yb = K.linear(x, w, bias, threads=threads)
        assert_dot_close(yb, R.linear_ref(x, w, bias), magnitude(x, w) + np.abs(bias), "bias")
        y1 = K.linear(x[0], w, threads=threads)                        # one token, 1-D
        assert y1.shape == (Rr,)
        assert_dot_close(y1, y[0], magnitude(x[0], w), "one token")


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_expert_stack_and_out(isa, fmt):
    rng = rng_for("stack", fmt)
    C = 64 if fmt in dtypes.QUANTIZED else 50
    w, _ = make_weight(rng, (4, 11, C), fmt, 32)
    x = rng.standard_normal((6, C)).astype(F32)
    out = np.full((6, 11), np.nan, dtype=F32)
    for e in range(4):
        y = K.linear(x, w, threads=2, out=out, expert=e)
        assert y is out
        assert_dot_close(out, R.linear_ref(x, w, expert=e), magnitude(x, w, e), f"expert {e}")
        assert np.array_equal(out, K.linear(x, w.expert(e), threads=1))
    with pytest.raises(ValueError, match="expert 4 out of range"):
        K.linear(x, w, expert=4)


def test_linear_argument_errors():
    rng = np.random.default_rng(1)
    w, _ = make_weight(rng, (8, 16), "f32")
    x = rng.standard_normal((3, 16)).astype(F32)
    with pytest.raises(TypeError, match="float32"):
        K.linear(x.astype(np.float64), w)
    with pytest.raises(ValueError, match="16"):
        K.linear(np.ones((3, 15), F32), w)
    with pytest.raises(ValueError, match="out"):
        K.linear(x, w, out=np.empty((3, 7), F32))
    with pytest.raises(ValueError, match="bias"):
        K.linear(x, w, np.ones(7, F32))
    big = np.zeros((8, 16), F32)
    with pytest.raises(ValueError, match="overlap"):                  # out aliasing x
        K.linear(big, WeightRef.from_array(np.eye(16, dtype=F32), "f32"), out=big[:, :16])
    assert K.linear(np.empty((0, 16), F32), w).shape == (0, 8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_bit_identical_across_threads(isa, fmt):
    rng = rng_for("threads", fmt)
    C = 128 if fmt in dtypes.QUANTIZED else 99
    w, _ = make_weight(rng, (203, C), fmt, 64)
    x = rng.standard_normal((7, C)).astype(F32)
    y1 = K.linear(x, w, threads=1)
    for n in (2, 3):
        assert np.array_equal(K.linear(x, w, threads=n), y1), n


@pytest.fixture
def row_kernel_only():
    """Turn the GEMM path off (every call on the row kernel), restoring GEMM_MIN after."""
    _kernels.set_gemm_min_tokens(1 << 40)
    yield
    _kernels.set_gemm_min_tokens(GEMM_MIN)


@pytest.mark.parametrize("fmt", FORMATS)
def test_token_result_independent_of_batch(isa, fmt, row_kernel_only):
    """On the row kernel (fewer than GEMM_MIN tokens per matrix; here forced for every
    count), a token's output has the same bits alone (decode) and inside a block of tokens,
    at every position of the block: linear and the expert FFN. (From GEMM_MIN tokens on the
    GEMM path takes over: test_gemm_token_result_independent_of_batch.)"""
    rng = rng_for("batch", fmt)
    C = 128 if fmt in dtypes.QUANTIZED else 99
    w, _ = make_weight(rng, (37, C), fmt, 32)
    x = rng.standard_normal((11, C)).astype(F32)
    block = K.linear(x, w, threads=2)
    for t in range(x.shape[0]):
        assert np.array_equal(K.linear(x[t:t + 1], w, threads=1)[0], block[t]), t
    D, I, G = ffn_dims(fmt)
    wg, wu, wd = make_experts(rng, 4, D, I, (fmt,) * 3, G)
    x = rng.standard_normal((9, D)).astype(F32)
    ids = np.argsort(rng.random((9, 4)), axis=1)[:, :2].astype(np.int32)
    weights = rng.random((9, 2)).astype(F32)
    block = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=2)
    for t in range(x.shape[0]):
        one = K.expert_ffn(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], wg, wu, wd, threads=1)
        assert np.array_equal(one[0], block[t]), t


@pytest.mark.parametrize("fmt", FORMATS)
def test_isa_paths_agree_with_scalar(fmt):
    """Every SIMD path against the scalar path: same data, within the dot-product bound."""
    rng = rng_for("agree", fmt)
    C = 256 if fmt in dtypes.QUANTIZED else 173
    w, _ = make_weight(rng, (29, C), fmt, 32)
    x = rng.standard_normal((5, C)).astype(F32)
    previous = runtime.get_isa()
    try:
        runtime.set_isa("scalar")
        ref = K.linear(x, w)
        for name in runtime.available_isas()[1:]:
            runtime.set_isa(name)
            assert_dot_close(K.linear(x, w), ref, magnitude(x, w), f"{name} vs scalar")
    finally:
        runtime.set_isa(previous)
