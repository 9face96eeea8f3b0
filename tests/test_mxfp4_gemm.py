"""The MXFP4 GEMM paths.

The panel decode of the f32 GEMM path (csrc/gemm.h): the decoded floats are exact, so on
every ISA path an MXFP4 matrix multiplies to the same bits as an f32 matrix holding its
dequantized values (the same micro-kernel over the same panel), for scales across the whole
E8M0 range, the subnormal ones (bytes 0, 1) included.

The integer GEMM path (csrc/igemm.h, int8 / int16 activations): the panel holds the doubled
FP4 codes (code2 + 12 for the u8 / s8 panels, code2 for int16), the block scale 2^(e - 128);
every body equals colibri.kernels._reference.linear_igemm_ref (exact block sums, one fmaf per block
in block order) bit for bit, so the bodies equal each other and the scalar specification;
below the crossover the row kernel's bits (a token's alone)."""
from __future__ import annotations

import numpy as np
import pytest

from colibri import kernels as K
from colibri.format import mxfp4
from colibri.kernels import runtime
from colibri.kernels import _reference as R
from colibri.kernels.weights import WeightRef
from kernel_helpers import F32, GEMM_MIN, THREADS, assert_dot_close, rng_for
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)
from test_igemm import act_rows, assert_bodies_equal_scalar
from test_kernels_activations import assert_iact_ffn_close, iact_magnitude
from test_mxfp4_idot import mx_weight


def stacked(rng, E, Rr, C, scales=None) -> WeightRef:
    codes = rng.integers(0, 256, size=(E, Rr, C // 2), dtype=np.uint8)
    if scales is None:
        scales = rng.integers(118, 136, size=(E, Rr, C // 32), dtype=np.uint8)
    buf = mxfp4.rows(codes, scales).reshape(-1).copy()
    return WeightRef(buf=buf, offset=0, dtype="mxfp4", rows=Rr, cols=C, group_size=32,
                     n_experts=E)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("Rr,C", [(5, 32), (29, 288), (50, 544), (24, 2880)])
def test_gemm_path_equals_f32_of_the_decoded_values(isa, threads, Rr, C):
    rng = rng_for("mx-panel", Rr, C)
    w = stacked(rng, 1, Rr, C)
    W = R.dequantize_ref(w)
    wf = WeightRef.from_array(W, "f32", 0)
    for T in (GEMM_MIN, 2 * GEMM_MIN + 3, 70):
        x = rng.standard_normal((T, C)).astype(F32)
        np.testing.assert_array_equal(K.linear(x, w, threads=threads),
                                      K.linear(x, wf, threads=threads), f"T={T}")


def test_extreme_scales_decode_exactly(isa):
    """Scale bytes 0 .. 3 (2^-127 .. 2^-124: subnormal products) and 250 .. 252 (up to 2^125,
    products up to 6 * 2^125), every nibble: the panel holds the exact floats."""
    rng = rng_for("mx-panel-extreme")
    Rr, C = 12, 320
    scales = rng.choice(np.array([0, 1, 2, 3, 127, 250, 251, 252], np.uint8),
                        size=(1, Rr, C // 32))
    w = stacked(rng, 1, Rr, C, scales)
    W = R.dequantize_ref(w)
    wf = WeightRef.from_array(W, "f32", 0)
    x = np.zeros((GEMM_MIN + 1, C), F32)
    for t in range(x.shape[0]):                     # one-hot rows read single elements
        x[t, (7 * t) % C] = 1.0
    x[-1] = rng.standard_normal(C).astype(F32) * F32(1e-30)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(K.linear(x, w), K.linear(x, wf))
        np.testing.assert_array_equal(K.linear(x[:-1], w), (x[:-1] @ W.T.astype(np.float64))
                                      .astype(F32))


def test_expert_ffn_gemm_path_equals_f32(isa):
    """The expert FFN (many tokens per expert: the GEMM path on every matrix)."""
    rng = rng_for("mx-panel-ffn")
    E, D, I, T = 3, 96, 64, 3 * GEMM_MIN
    ws = [stacked(rng, E, *s) for s in ((I, D), (I, D), (D, I))]
    wf = [WeightRef.from_array(np.stack([R.dequantize_ref(w, e) for e in range(E)]), "f32", 0)
          for w in ws]
    x = rng.standard_normal((T, D)).astype(F32)
    ids = np.stack([np.arange(T) % E, (np.arange(T) + 1) % E], axis=1).astype(np.int32)
    wts = rng.random((T, 2)).astype(F32)
    np.testing.assert_array_equal(K.expert_ffn(x, ids, wts, *ws, threads=2),
                                  K.expert_ffn(x, ids, wts, *wf, threads=2))


# ---------------------------------------------------------------------------------------------
# the integer GEMM path

ACTS = [("int8", 8), ("int16", 16)]
# (R, C): below / not a multiple of the 48-row panel and of the 16- and 8-row vectors; one
# block, partial chunks (544 = 2 chunks + 1 block), GPT-OSS's 2880 (11 chunks + 2 blocks)
MX_SHAPES = [(53, 320), (97, 544), (5, 32), (48, 256), (17, 2880), (1, 64)]
TOKENS = [1, 2, 3, 5, 7, 64, 65, 130]


@pytest.fixture()
def igemm_from():
    """runtime.set_igemm_min_tokens for the test, the previous value restored after."""
    previous = runtime.igemm_min_tokens()
    yield runtime.set_igemm_min_tokens
    runtime.set_igemm_min_tokens(previous)


@pytest.mark.parametrize("act, bits", ACTS)
def test_igemm_bodies_match_spec_bit_for_bit(isa, igemm_from, act, bits):
    """The forced path's body from one token on: the spec's bits, with and without bias, 1
    and 2 threads; every nibble, activation codes up to +-127 / +-32767."""
    igemm_from(1)
    rng = rng_for("mx-igemm-spec", act)
    for Rr, C in MX_SHAPES:
        w = mx_weight(rng, (Rr, C))
        x = act_rows(rng, max(TOKENS), C)
        bias = rng.standard_normal(Rr).astype(F32)
        for T in TOKENS:
            what = f"{isa} {act} T={T} R={Rr} C={C}"
            y = K.linear(x[:T], w, threads=1, activations=act)
            np.testing.assert_array_equal(y, R.linear_igemm_ref(x[:T], w, bits=bits), what)
            yb = K.linear(x[:T], w, bias, threads=2, activations=act)
            np.testing.assert_array_equal(yb, R.linear_igemm_ref(x[:T], w, bias, bits=bits),
                                          what)


@pytest.mark.parametrize("act, bits", ACTS)
def test_igemm_bodies_equal_scalar_body(isa, igemm_from, act, bits):
    """The forced path's body against the scalar body directly, 1..9 and 70 tokens, rows
    of +-6 (code +-12) everywhere, activations at the largest codes."""
    igemm_from(1)
    rng = rng_for("mx-igemm-scalar", act)
    w = mx_weight(rng, (53, 544))
    np.asarray(w.buf)[0:272] = 0x77                              # row 0: +6
    np.asarray(w.buf)[w.row_stride:w.row_stride + 272] = 0xFF    # row 1: -6
    x = act_rows(rng, 70, 544)
    x[1] = -1.0
    assert_bodies_equal_scalar(w, x, isa, act)


@pytest.mark.parametrize("act, bits", ACTS)
def test_igemm_extreme_scales_nan_and_zero(isa, igemm_from, act, bits):
    """Scale bytes 0 .. 3 (halved: 2^-128 .. 2^-125, subnormal) to 200, in whole and partial
    chunks: the spec's bits; a block of x with an inf gives its token NaN, a zero block adds
    nothing."""
    igemm_from(1)
    rng = rng_for("mx-igemm-extreme", act)
    w = mx_weight(rng, (19, 544), scales=[0, 1, 2, 3, 60, 127, 180, 200])
    x = rng.standard_normal((9, 544)).astype(F32)
    x[3, 40] = np.inf
    x[5, 64:96] = 0.0
    with np.errstate(all="ignore"):
        y = K.linear(x, w, threads=1, activations=act)
        np.testing.assert_array_equal(y, R.linear_igemm_ref(x, w, bits=bits))
    assert np.isnan(y[3]).all() and np.isfinite(np.delete(y, 3, axis=0)).all()


@pytest.mark.parametrize("act, bits", ACTS)
def test_igemm_crossover_and_row_kernel(isa, igemm_from, act, bits):
    """Below igemm_min_tokens the row kernel (a token's bits as alone), from it the spec's;
    both within the row kernel's tolerance of the float64 reference; a token's bits do not
    depend on the thread count or its place in a call on the GEMM path."""
    igemm_from(6)
    rng = rng_for("mx-igemm-crossover", act)
    w = mx_weight(rng, (61, 2880))
    x = rng.standard_normal((70, 2880)).astype(F32)
    for T in (5, 6, 7):
        y = K.linear(x[:T], w, threads=2, activations=act)
        alone = np.stack([K.linear(x[t], w, threads=1, activations=act) for t in range(T)])
        if T < 6:
            np.testing.assert_array_equal(y, alone)
        else:
            np.testing.assert_array_equal(y, R.linear_igemm_ref(x[:T], w, bits=bits))
        mag = iact_magnitude(x[:T], w, bits=bits)
        assert_dot_close(y, R.linear_iact_ref(x[:T], w, bits=bits), mag, f"T={T}")
        assert_dot_close(y, alone, mag, f"T={T} vs alone")
    block = K.linear(x, w, threads=1, activations=act)
    np.testing.assert_array_equal(K.linear(x, w, threads=2, activations=act), block)
    for t0, n in ((0, 6), (3, 11), (64, 6)):
        np.testing.assert_array_equal(K.linear(x[t0:t0 + n], w, threads=2, activations=act),
                                      block[t0:t0 + n])


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("act, bits", ACTS)
def test_igemm_expert_ffn(isa, igemm_from, threads, act, bits):
    """The expert FFN with an expert of many tokens (gate / up fused with the SiLU product,
    down, on the integer GEMM path) and experts of few (row kernel) in one call: against the
    float64 reference, against the whole call on the row kernels, the same bits for 1..3
    threads."""
    igemm_from(6)
    rng = rng_for("mx-igemm-ffn", act)
    E, D, I, T = 4, 96, 160, 23
    wg, wu, wd = (mx_weight(rng, s, (118, 124)) for s in ((E, I, D), (E, I, D), (E, D, I)))
    x = rng.standard_normal((T, D)).astype(F32)
    ids = np.zeros((T, 2), np.int32)
    ids[:, 1] = rng.choice([1, 2, 3], size=T, p=[0.8, 0.15, 0.05])
    wts = rng.random((T, 2)).astype(F32)
    y = K.expert_ffn(x, ids, wts, wg, wu, wd, threads=threads, activations=act)
    assert_iact_ffn_close(y, R.expert_ffn_iact_ref(x, ids, wts, wg, wu, wd, bits=bits),
                          act, bits)
    igemm_from(10 ** 9)
    rows = K.expert_ffn(x, ids, wts, wg, wu, wd, threads=threads, activations=act)
    igemm_from(6)
    assert not np.array_equal(y, rows), "the GEMM path was not taken"
    assert_iact_ffn_close(y, rows, act + " vs row kernels", bits)
    for n in (1, 2, 3):
        np.testing.assert_array_equal(
            K.expert_ffn(x, ids, wts, wg, wu, wd, threads=n, activations=act), y, f"{n}")
