"""The integer GEMM path (csrc/igemm.h): q4 / q8 matrices on int8 / int16 activation codes from
runtime.igemm_min_tokens() tokens per matrix (linear: the call's tokens; the expert FFN: one
expert's), panels of 48 rows decoded once per 256-column chunk. By default (0) each ISA path
takes its measured crossover (runtime.igemm_crossover; none on avx2 / avx512); the tests force
a number, so that every path's body runs.

Every body (scalar spec, AVX2, AVX-VNNI, AVX-512 VNNI; the avx512 path runs the AVX2 one) is
compared bit for bit with colibri.kernels._reference.linear_igemm_ref, which does the float part in
the path's own float32 order (exact integer block sums, one fmaf per block), so the bodies
equal each other too. Against the row kernel (few tokens) and the float64 references, the
tolerances of test_kernels_activations.py.
"""
from __future__ import annotations

import numpy as np
import pytest

import colibri
from colibri import kernels as K
from colibri.kernels import runtime
from colibri.kernels import _reference as R
from colibri.api import default_model_path
from kernel_helpers import F32, THREADS, assert_dot_close, make_experts, make_weight, rng_for
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)
from test_kernels_activations import assert_iact_ffn_close, iact_magnitude

QFORMATS = ["q4", "q8"]
ACTS = [("int8", 8), ("int16", 16)]
IGEMM_MIN = 6                        # the crossover the tests force (igemm_min_tokens) ...
# (R, C, G): R below / not a multiple of the 48-row panel, the 16- and 8-row vectors; C a
# multiple of 32, not of the 256-column chunk (one block, a partial chunk, several chunks);
# groups 32, 64, 96 and 160 (groups straddling a chunk), 512 (two chunks per group)
SHAPES = [(53, 320, 32), (97, 544, 32), (48, 256, 64), (7, 288, 96), (26, 320, 160),
          (5, 32, 32), (17, 1536, 512), (1, 64, 64)]
# tokens: the micro-kernels' remainders (4 and 3 tokens per pass on avx512vnni / avxvnni,
# 2 on avx2), one and several passes of 64
TOKENS = [1, 2, 3, 5, 7, 64, 65, 130]


@pytest.fixture(autouse=True)
def gemm_from():
    """igemm_min_tokens IGEMM_MIN on every path for the test (restored after); the test may
    set another value with the setter it gets."""
    previous = runtime.igemm_min_tokens()
    runtime.set_igemm_min_tokens(IGEMM_MIN)
    yield runtime.set_igemm_min_tokens
    runtime.set_igemm_min_tokens(previous)


def full_range_codes(w, rng):
    """Overwrite the code bytes of every row of w with random bytes: q8 codes over all of
    -128..127, q4 nibbles over 0..15 (the scales are kept)."""
    code_bytes = w.cols if w.dtype == "q8" else w.cols // 2
    for e in range(w.n_experts):
        for r in range(w.rows):
            start = w.offset + e * w.expert_stride + r * w.row_stride
            w.buf[start:start + code_bytes] = rng.integers(0, 256, code_bytes, dtype=np.uint8)
    return w


def act_rows(rng, T, C):
    """Rows with blocks of very different scales, so codes reach +-127 / +-32767 and the
    int16 q8 block sums pass 2^24 (where their float conversion rounds)."""
    x = rng.standard_normal((T, C)).astype(F32)
    x *= rng.choice([1e-3, 1.0, 30.0], size=(T, C // 32, 1)).repeat(32, axis=2).reshape(T, C)
    x[:, :32] = np.sign(x[:, :32]) + (x[:, :32] == 0)            # first block: all +-1
    return x


def assert_bodies_equal_scalar(w, x, isa, act):
    """K.linear of x's first 1..9 and 70 rows on the forced path and on the scalar path: the
    same bits (the path left on isa)."""
    ys = {}
    for path in ("scalar", isa):
        runtime.set_isa(path)
        ys[path] = [K.linear(x[:T], w, threads=2, activations=act) for T in (*range(1, 10), 70)]
    runtime.set_isa(isa)
    for a, b in zip(ys["scalar"], ys[isa]):
        assert np.array_equal(a, b), (isa, a.shape)


@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize("act, bits", ACTS)
def test_igemm_bodies_match_spec_bit_for_bit(isa, gemm_from, fmt, act, bits):
    """Every body of the forced path, every token count (from 1: the GEMM path forced from
    one token), equals the NumPy spec bit for bit, with and without bias."""
    gemm_from(1)
    rng = rng_for("igemm-spec", fmt, act)
    for Rr, C, G in SHAPES:
        w = full_range_codes(make_weight(rng, (Rr, C), fmt, G)[0], rng)
        x = act_rows(rng, max(TOKENS), C)
        bias = rng.standard_normal(Rr).astype(F32)
        for T in TOKENS:
            what = f"{isa} {act} {fmt} T={T} R={Rr} C={C} G={G}"
            y = K.linear(x[:T], w, threads=1, activations=act)
            ref = R.linear_igemm_ref(x[:T], w, bits=bits)
            assert np.array_equal(y, ref), what
            yb = K.linear(x[:T], w, bias, threads=2, activations=act)
            assert np.array_equal(yb, R.linear_igemm_ref(x[:T], w, bias, bits=bits)), what


@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize("act, bits", ACTS)
def test_igemm_bodies_equal_scalar_body(isa, gemm_from, fmt, act, bits):
    """The forced path's body against the scalar body directly (the same bits), on one shape
    with every remainder: 53 rows, 544 columns (a partial chunk), 1..9 and 70 tokens."""
    gemm_from(1)
    rng = rng_for("igemm-scalar", fmt, act)
    w = full_range_codes(make_weight(rng, (53, 544), fmt, 32)[0], rng)
    assert_bodies_equal_scalar(w, act_rows(rng, 70, 544), isa, act)


@pytest.mark.parametrize("act, bits", ACTS)
def test_igemm_nan_and_zero_blocks(isa, gemm_from, act, bits):
    """A block of x with an inf gives its token NaN outputs (d = NaN), a zero block adds
    nothing: as the spec."""
    gemm_from(1)
    rng = rng_for("igemm-nan", act)
    w, _ = make_weight(rng, (50, 320), "q4", 32)
    x = rng.standard_normal((12, 320)).astype(F32)
    x[3, 40] = np.inf
    x[5, 64:96] = 0.0
    y = K.linear(x, w, threads=1, activations=act)
    assert np.isnan(y[3]).all() and np.isfinite(np.delete(y, 3, axis=0)).all()
    assert np.array_equal(y, R.linear_igemm_ref(x, w, bits=bits), equal_nan=True)


@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize("act, bits", ACTS)
def test_igemm_crossover(isa, fmt, act, bits):
    """Below igemm_min_tokens the row kernel (a token's bits as alone), from it on the GEMM
    path (the spec's bits); the two within the row kernel's tolerance of the float64
    reference."""
    rng = rng_for("igemm-crossover", fmt, act)
    w, _ = make_weight(rng, (61, 544), fmt, 32)
    x = rng.standard_normal((IGEMM_MIN + 1, 544)).astype(F32)
    for T in (IGEMM_MIN - 1, IGEMM_MIN, IGEMM_MIN + 1):
        y = K.linear(x[:T], w, threads=2, activations=act)
        alone = np.stack([K.linear(x[t], w, threads=1, activations=act) for t in range(T)])
        if T < IGEMM_MIN:
            assert np.array_equal(y, alone), T
        else:
            assert np.array_equal(y, R.linear_igemm_ref(x[:T], w, bits=bits)), T
        mag = iact_magnitude(x[:T], w, bits=bits)
        assert_dot_close(y, R.linear_iact_ref(x[:T], w, bits=bits), mag, f"T={T}")
        assert_dot_close(y, alone, mag, f"T={T} vs alone")


@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize("act", [a for a, _ in ACTS])
def test_igemm_independent_of_threads_and_batch(isa, fmt, act):
    """On the GEMM path a token's output has the same bits for 1, 2, 3 threads and in any
    block of >= igemm_min_tokens tokens (its position, the passes of the call)."""
    rng = rng_for("igemm-batch", fmt, act)
    w, _ = make_weight(rng, (203, 320), fmt, 64)
    x = rng.standard_normal((130, 320)).astype(F32)
    block = K.linear(x, w, threads=1, activations=act)
    for n in (2, 3):
        assert np.array_equal(K.linear(x, w, threads=n, activations=act), block), n
    for t0 in (0, 3, 64, 130 - IGEMM_MIN):
        for n in (IGEMM_MIN, IGEMM_MIN + 5):
            part = K.linear(x[t0:t0 + n], w, threads=2, activations=act)
            assert np.array_equal(part, block[t0:t0 + n]), (t0, n)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize("act, bits", ACTS)
def test_igemm_expert_ffn(isa, threads, fmt, act, bits):
    """The expert FFN with experts of many tokens (gate / up fused with the SiLU product, and
    down, on the GEMM path) and of few (row kernel) in one call: against the float64
    reference, against the whole call on the row kernel, and the same bits for any thread
    count; swiglu (one dense FFN) likewise."""
    rng = rng_for("igemm-ffn", fmt, act)
    for D, I, G in ((64, 96, 32), (96, 160, 32), (128, 544, 32)):
        wg, wu, wd = make_experts(rng, 4, D, I, (fmt,) * 3, G)
        T = 3 * IGEMM_MIN + 5
        x = rng.standard_normal((T, D)).astype(F32)
        ids = np.zeros((T, 2), np.int32)
        ids[:, 0] = 0                                  # expert 0: every token (GEMM path)
        ids[:, 1] = rng.choice([1, 2, 3], size=T, p=[0.8, 0.15, 0.05])  # 2 and 3: few tokens
        weights = rng.random((T, 2)).astype(F32)
        what = f"{act} {fmt} D={D} I={I}"
        y = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=threads, activations=act)
        ref = R.expert_ffn_iact_ref(x, ids, weights, wg, wu, wd, bits=bits)
        assert_iact_ffn_close(y, ref, what, bits)
        runtime.set_igemm_min_tokens(10 ** 9)
        rows = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=threads, activations=act)
        dense_rows = K.swiglu(x, wg.expert(1), wu.expert(1), wd.expert(1), threads=threads,
                              activations=act)
        runtime.set_igemm_min_tokens(IGEMM_MIN)
        assert not np.array_equal(y, rows), what + ": the GEMM path was not taken"
        assert_iact_ffn_close(y, rows, what + " vs row kernel", bits)
        for n in (1, 2, 3):
            assert np.array_equal(
                K.expert_ffn(x, ids, weights, wg, wu, wd, threads=n, activations=act), y), n
        dense = K.swiglu(x, wg.expert(1), wu.expert(1), wd.expert(1), threads=threads,
                         activations=act)
        assert_iact_ffn_close(dense, R.swiglu_iact_ref(x, wg.expert(1), wu.expert(1),
                                                       wd.expert(1), bits=bits), what, bits)
        assert_iact_ffn_close(dense, dense_rows, what + " swiglu vs row kernel", bits)


@pytest.mark.parametrize("act, tol, top", [("int16", 3e-4, 0.98), ("int8", 5e-2, 0.9)])
def test_igemm_model_prefill_within_accuracy_bounds(act, tol, top):
    """The shipped model's prefill (48 tokens: every expert gets several, most >= the
    crossover) on the integer GEMM path: logits within docs/accuracy.md's bound of the f32
    activations' (INT16_TOL 3e-4, INT8_TOL 5e-2, relative to the largest), the same top
    token at >= 98 % (int16) / 90 % (int8: random ids give flat logits) of positions, and
    close to the row kernel's."""
    ids = np.random.default_rng(7).integers(4, 4000, size=48)
    exact = colibri.load(default_model_path(), activations="f32").forward(ids)
    model = colibri.load(default_model_path(), activations=act)
    y = model.forward(ids)
    scale = float(np.abs(exact).max())
    assert np.abs(y - exact).max() <= tol * scale
    assert (y.argmax(-1) == exact.argmax(-1)).mean() >= top
    runtime.set_igemm_min_tokens(10 ** 9)
    rows = model.forward(ids)
    assert not np.array_equal(y, rows)
    assert np.abs(y - rows).max() <= tol * scale


def test_igemm_default_crossover_per_path(isa, gemm_from):
    """igemm_min_tokens 0 (the default): each path's measured crossover; a path without one
    (avx2, avx512, scalar; avxvnni int16) keeps the row kernel at any token count."""
    gemm_from(0)
    rng = rng_for("igemm-default", isa)
    w, _ = make_weight(rng, (50, 320), "q4", 32)
    x = rng.standard_normal((40, 320)).astype(F32)
    for act, bits in ACTS:
        n = runtime.igemm_crossover(isa, act)
        assert n is None or 1 <= n <= 16
        for T in (1, 3, 4, 6, 7, 40):
            y = K.linear(x[:T], w, threads=1, activations=act)
            if n is not None and T >= n:
                assert np.array_equal(y, R.linear_igemm_ref(x[:T], w, bits=bits)), (act, T)
            else:
                alone = np.stack([K.linear(x[t], w, threads=1, activations=act)
                                  for t in range(T)])
                assert np.array_equal(y, alone), (act, T)
    with pytest.raises(ValueError, match="igemm_min_tokens"):
        runtime.set_igemm_min_tokens(-1)
    with pytest.raises(ValueError, match="activations"):
        runtime.igemm_crossover(isa, "f32")
