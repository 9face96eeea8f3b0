"""The GEMM (prefill) path: from GEMM_MIN tokens per matrix, panels of rows decoded once
(linear and the expert FFN).
"""
from __future__ import annotations

import numpy as np
import pytest

from colibri import _kernels, dtypes, kernels as K
from colibri.kernels import runtime
from colibri.kernels import _reference as R
from kernel_helpers import (
    F32, FORMATS, GEMM_MIN, THREADS, assert_dot_close, assert_ffn_close, ffn_dims, magnitude,
    make_experts, make_weight, rng_for)
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)


GEMM_TOKENS = sorted({GEMM_MIN - 1, GEMM_MIN, GEMM_MIN + 1, 13, 130} - {0})
# (R, C, G): R not a multiple of the panel (24) or micro-panel (3) rows; C not a multiple of
# the 256-column K-chunk; groups 32, 64 and 96 / 160 (a group straddling a chunk boundary);
# plain C with a tail of < 8 columns, and C < 8
GEMM_QUANT_SHAPES = [(53, 320, 32), (29, 544, 32), (53, 320, 64), (7, 288, 96), (26, 320, 160)]
GEMM_PLAIN_SHAPES = [(53, 300, 0), (25, 45, 0), (4, 5, 0), (50, 512, 0)]


def gemm_shapes(fmt):
    return GEMM_QUANT_SHAPES if fmt in dtypes.QUANTIZED else GEMM_PLAIN_SHAPES


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_linear_matches_reference(isa, threads, fmt):
    rng = rng_for("gemm-linear", fmt)
    for Rr, C, G in gemm_shapes(fmt):
        w, _ = make_weight(rng, (Rr, C), fmt, G)
        x = rng.standard_normal((max(GEMM_TOKENS), C)).astype(F32)
        bias = rng.standard_normal(Rr).astype(F32)
        for T in GEMM_TOKENS:
            what = f"{fmt} T={T} R={Rr} C={C} G={G}"
            y = K.linear(x[:T], w, threads=threads)
            assert_dot_close(y, R.linear_ref(x[:T], w), magnitude(x[:T], w), what)
            yb = K.linear(x[:T], w, bias, threads=threads)
            assert_dot_close(yb, R.linear_ref(x[:T], w, bias),
                             magnitude(x[:T], w) + np.abs(bias), what + " bias")


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_linear_bit_identical_across_threads(isa, fmt):
    rng = rng_for("gemm-threads", fmt)
    C = 320 if fmt in dtypes.QUANTIZED else 301
    w, _ = make_weight(rng, (203, C), fmt, 64)
    for T in (GEMM_MIN, 13, 130):
        x = rng.standard_normal((T, C)).astype(F32)
        y1 = K.linear(x, w, threads=1)
        for n in (2, 3):
            assert np.array_equal(K.linear(x, w, threads=n), y1), (T, n)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_token_result_independent_of_batch(isa, fmt):
    """On the GEMM path a token's output has the same bits in every block of >= GEMM_MIN
    tokens (whatever its position, the token blocks and passes of the call), and is within
    the dot bound of its row-kernel result (alone): linear and the expert FFN."""
    rng = rng_for("gemm-batch", fmt)
    C = 320 if fmt in dtypes.QUANTIZED else 99
    w, _ = make_weight(rng, (37, C), fmt, 32)
    x = rng.standard_normal((130, C)).astype(F32)
    block = K.linear(x, w, threads=2)
    for t0 in (0, 3, 64, 130 - GEMM_MIN):
        for n in (GEMM_MIN, GEMM_MIN + 5):
            part = K.linear(x[t0:t0 + n], w, threads=1)
            assert np.array_equal(part, block[t0:t0 + n]), (t0, n)
    alone = np.stack([K.linear(x[t:t + 1], w, threads=1)[0] for t in range(0, 130, 7)])
    assert_dot_close(block[::7], alone, magnitude(x[::7], w), "alone vs block")
    D, I, G = ffn_dims(fmt)
    wg, wu, wd = make_experts(rng, 2, D, I, (fmt,) * 3, G)
    x = rng.standard_normal((3 * GEMM_MIN, D)).astype(F32)
    ids = np.zeros((3 * GEMM_MIN, 1), np.int32)                   # one expert: all GEMM
    weights = rng.random((3 * GEMM_MIN, 1)).astype(F32)
    block = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=2)
    for t0 in (0, GEMM_MIN // 2, 2 * GEMM_MIN):
        part = K.expert_ffn(x[t0:t0 + GEMM_MIN], ids[:GEMM_MIN], weights[t0:t0 + GEMM_MIN],
                            wg, wu, wd, threads=1)
        assert np.array_equal(part, block[t0:t0 + GEMM_MIN]), t0


@pytest.mark.parametrize("fmt", ["f32", "q4"])
def test_gemm_path_is_taken(isa, fmt):
    """From GEMM_MIN tokens the result comes from the GEMM path (it differs from the row
    kernel's in the last bits somewhere), below it from the row kernel (identical)."""
    rng = rng_for("gemm-taken", fmt)
    w, _ = make_weight(rng, (40, 256), fmt, 32)
    x = rng.standard_normal((GEMM_MIN, 256)).astype(F32)
    gemm, below = K.linear(x, w), K.linear(x[:-1], w)
    try:
        _kernels.set_gemm_min_tokens(1 << 40)
        rows, rows_below = K.linear(x, w), K.linear(x[:-1], w)
    finally:
        _kernels.set_gemm_min_tokens(GEMM_MIN)
    assert np.array_equal(below, rows_below)
    assert not np.array_equal(gemm, rows)
    assert_dot_close(gemm, rows, magnitude(x, w))
    with pytest.raises(ValueError, match="gemm_min_tokens"):
        _kernels.set_gemm_min_tokens(0)


def skewed_routing(rng, T, E, Kk):
    """ids (T, Kk): expert 0 in every token's list; expert 1 on GEMM_MIN tokens, expert 2 on
    GEMM_MIN - 1, experts 3 and 4 on one token each, the rest spread over the others."""
    ids = np.empty((T, Kk), np.int32)
    ids[:, 0] = 0
    rest = rng.integers(5, E, size=(T, Kk - 1))
    ids[:, 1:] = rest
    order = rng.permutation(T)
    ids[order[:GEMM_MIN], 1] = 1
    ids[order[GEMM_MIN:2 * GEMM_MIN - 1], 1] = 2
    ids[order[2 * GEMM_MIN - 1], 1] = 3
    ids[order[2 * GEMM_MIN], 1] = 4
    return ids


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_expert_ffn_skewed_routing(isa, threads, fmt):
    """One expert gets every token (the GEMM path, token passes of 130 split), others get
    GEMM_MIN, GEMM_MIN - 1 (the row kernel) and 1 token; against the reference, and
    bit-identical across thread counts."""
    rng = rng_for("gemm-skew", fmt)
    D, I, G = ffn_dims(fmt)
    E = 7
    wg, wu, wd = make_experts(rng, E, D, I, (fmt,) * 3, G)
    for T in (2 * GEMM_MIN + 1, 130):
        x = rng.standard_normal((T, D)).astype(F32)
        ids = skewed_routing(rng, T, E, 2)
        weights = rng.random((T, 2)).astype(F32)
        y = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=threads)
        assert_ffn_close(y, R.expert_ffn_ref(x, ids, weights, wg, wu, wd), f"T={T}")
        if threads == 1:
            for n in (2, 3):
                assert np.array_equal(K.expert_ffn(x, ids, weights, wg, wu, wd, threads=n), y)


def test_gemm_expert_ffn_mixed_formats_and_groups(isa):
    """Gate, up and down in different formats and group sizes, I not a multiple of the
    panel, D not a multiple of the K-chunk."""
    rng = rng_for("gemm-mixed")
    D, I, E = 288, 160, 3
    wg, _ = make_weight(rng, (E, I, D), "q4", 96, 0.3)
    wu, _ = make_weight(rng, (E, I, D), "q8", 32, 0.3)
    wd, _ = make_weight(rng, (E, D, I), "q4", 160, 0.3)
    for T in (GEMM_MIN, 41):
        x = rng.standard_normal((T, D)).astype(F32)
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :2].astype(np.int32)
        weights = rng.random((T, 2)).astype(F32)
        y = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=2)
        assert_ffn_close(y, R.expert_ffn_ref(x, ids, weights, wg, wu, wd), f"T={T}")
        assert np.array_equal(K.expert_ffn(x, ids, weights, wg, wu, wd, threads=1), y)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_avx512_equals_avx2_bitwise(fmt):
    """The AVX-512 GEMM bodies (two rows per vector, the panel's row pairs interleaved) run
    the AVX2 bodies' lanes: the same bits, for every shape of the reference test (odd row
    counts leave a zero partner row), token counts from GEMM_MIN (below it the row kernels,
    whose AVX-512 f32 bodies have 16 lanes) across the micro-kernel's 4-token blocks and the
    64-token passes, and the expert FFN over the same path."""
    if not {"avx2", "avx512"} <= set(runtime.available_isas()):
        pytest.skip("this CPU/OS does not run the avx2 and avx512 paths")
    rng = rng_for("gemm-avx512", fmt)
    previous = runtime.get_isa()
    try:
        for Rr, C, G in gemm_shapes(fmt) + ([(1, 64, 32), (2, 1024, 64)]
                                            if fmt in dtypes.QUANTIZED else [(1, 16, 0)]):
            w, _ = make_weight(rng, (Rr, C), fmt, G)
            x = rng.standard_normal((130, C)).astype(F32)
            for T in [t for t in GEMM_TOKENS if t >= GEMM_MIN] + [GEMM_MIN + 3, 64, 65]:
                got = {}
                for name in ("avx2", "avx512"):
                    runtime.set_isa(name)
                    got[name] = K.linear(x[:T], w, threads=2)
                assert np.array_equal(got["avx512"].view(np.uint32),
                                      got["avx2"].view(np.uint32)), (Rr, C, G, T)
        D, I, G = ffn_dims(fmt)
        wg, wu, wd = make_experts(rng, 5, D, I, (fmt,) * 3, G)
        T = 6 * GEMM_MIN + 1                      # every expert >= 2 GEMM_MIN tokens
        x = rng.standard_normal((T, D)).astype(F32)
        ids = np.stack([np.arange(T) % 2, 2 + np.arange(T) % 3], axis=1).astype(np.int32)
        weights = rng.random((T, 2)).astype(F32)
        got = {}
        for name in ("avx2", "avx512"):
            runtime.set_isa(name)
            got[name] = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=2)
        assert np.array_equal(got["avx512"].view(np.uint32), got["avx2"].view(np.uint32))
    finally:
        runtime.set_isa(previous)
