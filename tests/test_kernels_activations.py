"""Quantized activations (activations="int8": W4A8 / W8A8; "int16": 16-bit codes).

Tolerances. The integer part (isum per 32-block) is exact in the kernels and the
references; only the float part sum_b (s_b d_b) isum_b differs: float32 over C/32 terms
(the AVX2 body in 8 lanes, then a horizontal sum) against float64. That error is below
(C/32 + 4) * eps32 * sum_b |s_b d_b isum_b| < 1e-5 * that sum for C <= 1024: the bound
asserted (iact_magnitude). A wrong nibble order, packing or scale is of the order of the
sum itself. (For int16 the float conversion of a q8 block sum above 2^24 rounds: 6e-8
relative, inside the same bound.)
"""
from __future__ import annotations

import numpy as np
import pytest

from colibri import _kernels, kernels as K
from colibri.kernels import runtime
from colibri.kernels.weights import WeightRef
from colibri.kernels import _reference as R
from kernel_helpers import (
    F32, THREADS, assert_dot_close, ffn_dims, make_experts, make_weight, poison_expert,
    rng_for)
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)


QFORMATS = ["q4", "q8"]
ACTS = [("int8", 8), ("int16", 16)]             # activations, bits of the codes
INT8_SHAPES = [(1, 1, 32, 32), (2, 37, 64, 64), (3, 19, 256, 128), (4, 13, 96, 32),
               (5, 7, 288, 32), (130, 11, 128, 64), (3, 9, 192, 96), (1, 5, 1024, 32),
               (2, 3, 2048, 256), (4, 3, 1536, 512),      # 256, 512: one / 2+ chunks a group
               (3, 4, 800, 32), (2, 5, 1408, 64), (1, 6, 1408, 128)]   # partial last chunk


def iact_magnitude(x: np.ndarray, w: WeightRef, expert: int = 0, bits: int = 8) -> np.ndarray:
    """sum_b |s_b| d_b sum_i |code_i q_i| per (token, row): the error scale of an integer dot."""
    q, d = R.quantize_activations_ref(np.atleast_2d(x), bits)
    codes, scales = R._codes_scales(w, expert)
    T, C = q.shape
    nb = C // 32
    a = np.einsum("tbi,rbi->trb", np.abs(q.reshape(T, nb, 32).astype(np.int64)),
                  np.abs(codes.reshape(-1, nb, 32)))
    s = np.repeat(np.abs(scales.astype(np.float64)), w.group_size // 32, axis=1)
    return np.einsum("rb,tb,trb->tr", s, np.nan_to_num(d.astype(np.float64)), a)


def assert_iact_ffn_close(y, y_ref, what="", bits=8):
    # h = silu(gate) * up is rounded to float32 from sums taken in a different order by the
    # kernel (f32) and the reference (f64) before it is quantized, so an element of h lying
    # on a rounding tie of its grid may take the neighbouring code (1/127 of its block's amax
    # for int8, 1/32767 for int16): rare, and below 2e-3 (int8) / 1e-4 (int16) of the
    # output's scale; layout errors are of order 1.
    scale = float(np.abs(y_ref).max()) + 1e-6
    atol = (2e-3 if bits == 8 else 1e-4) * scale
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=atol, err_msg=what)


@pytest.fixture
def row_kernel():
    """Every call on the idot row kernel (the integer GEMM path off)."""
    previous = runtime.igemm_min_tokens()
    runtime.set_igemm_min_tokens(10 ** 9)
    yield
    runtime.set_igemm_min_tokens(previous)


def test_quantize_activations_matches_reference_bit_for_bit(isa):
    rng = rng_for("q8act")
    T, C = 6, 32 * 12
    x = (rng.standard_normal((T, C)) * rng.choice([1e-3, 1.0, 1e3], size=(T, 1))).astype(F32)
    x[0, :32] = 0.0                                      # zero block: d = 0, q = 0
    x[1, 40] = np.nan                                    # NaN block: d = NaN, q = 0
    x[2, 70] = np.inf
    x[2, 100] = -np.inf
    x[3, :32] = np.array([127.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5, 3.5]
                         + [0.25] * 22, F32)             # d = 1, id = 1: ties at .5 -> even
    x[3, 32:64] = 1e-39                                  # 1 / d overflows: treated as zero
    x[4, 64:96] = np.float32(1e-30)                      # tiny but representable
    x[5, 96:128] = -3.0
    q, d = K.quantize_activations(x)
    qr, dr = R.quantize_activations_ref(x)
    assert q.dtype == np.int8 and q.shape == (T, C) and d.dtype == F32 and d.shape == (T, 12)
    assert np.array_equal(q, qr)
    assert np.array_equal(d.view(np.uint32)[~np.isnan(d)], dr.view(np.uint32)[~np.isnan(dr)])
    assert np.array_equal(np.isnan(d), np.isnan(dr))
    assert np.abs(q.astype(int)).max() <= 127
    assert d[0, 0] == 0 and not q[0, :32].any()
    assert np.isnan(d[1, 1]) and not q[1, 32:64].any() and np.isfinite(d[1, 0])
    assert np.isnan(d[2, 2]) and np.isnan(d[2, 3])
    assert d[3, 0] == 1.0 and list(q[3, :10]) == [127, 0, 0, 2, -2, 2, -2, 126, -126, 4]
    assert d[3, 1] == 0 and not q[3, 32:64].any()
    assert (q[4, 64:96] == 127).all() and (q[5, 96:128] == -127).all()
    assert K.quantize_activations(np.empty((0, 64), F32))[0].shape == (0, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        K.quantize_activations(np.ones((2, 48), F32))


def test_quantize_activations_int16_matches_reference_bit_for_bit(isa):
    rng = rng_for("q16act")
    T, C = 6, 32 * 12
    x = (rng.standard_normal((T, C)) * rng.choice([1e-3, 1.0, 1e3], size=(T, 1))).astype(F32)
    x[0, :32] = 0.0                                      # zero block: d = 0, q = 0
    x[1, 40] = np.nan                                    # NaN block: d = NaN, q = 0
    x[2, 70] = -np.inf
    x[3, :32] = np.array([32767.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 32766.5, -32766.5, 3.5]
                         + [0.25] * 22, F32)             # d = 1: ties at .5 -> even
    x[3, 32:64] = 1e-39                                  # 1 / d overflows: treated as zero
    x[4, 64:96] = np.float32(1e-30)
    x[5, 96:128] = -3.0
    q, d = K.quantize_activations(x, bits=16)
    qr, dr = R.quantize_activations_ref(x, 16)
    assert q.dtype == np.int16 and q.shape == (T, C) and d.dtype == F32 and d.shape == (T, 12)
    assert np.array_equal(q, qr)
    assert np.array_equal(d.view(np.uint32)[~np.isnan(d)], dr.view(np.uint32)[~np.isnan(dr)])
    assert np.array_equal(np.isnan(d), np.isnan(dr))
    assert np.abs(q.astype(int)).max() <= 32767
    assert d[0, 0] == 0 and not q[0, :32].any()
    assert np.isnan(d[1, 1]) and not q[1, 32:64].any() and np.isnan(d[2, 2])
    assert d[3, 0] == 1.0 and list(q[3, :10]) == [32767, 0, 0, 2, -2, 2, -2, 32766, -32766, 4]
    assert d[3, 1] == 0 and not q[3, 32:64].any()
    assert (q[4, 64:96] == 32767).all() and (q[5, 96:128] == -32767).all()
    # the codes reproduce x to 2^-16 of each block's largest magnitude
    ok = np.isfinite(d) & (d > 0)
    xb, qb = x.reshape(T, -1, 32)[ok], q.reshape(T, -1, 32)[ok].astype(np.float64)
    err = np.abs(qb * d[ok][:, None] - xb).max(axis=1) / np.abs(xb).max(axis=1)
    assert err.max() <= 2.0 ** -16 * 1.001
    with pytest.raises(ValueError, match="bits must be 8 or 16"):
        K.quantize_activations(x, bits=12)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize("act, bits", ACTS)
def test_linear_iact_matches_reference(isa, threads, fmt, act, bits):
    rng = rng_for("linear-iact", fmt, act)
    for T, Rr, C, G in INT8_SHAPES:
        w, _ = make_weight(rng, (Rr, C), fmt, G)
        x = rng.standard_normal((T, C)).astype(F32)
        y = K.linear(x, w, threads=threads, activations=act)
        assert y.shape == (T, Rr) and y.dtype == F32
        mag = iact_magnitude(x, w, bits=bits)
        what = f"{act} {fmt} T={T} R={Rr} C={C} G={G}"
        assert_dot_close(y, R.linear_iact_ref(x, w, bits=bits), mag, what)
        bias = rng.standard_normal(Rr).astype(F32)
        yb = K.linear(x, w, bias, threads=threads, activations=act)
        assert_dot_close(yb, R.linear_iact_ref(x, w, bias, bits=bits), mag + np.abs(bias),
                         "bias " + what)
        y1 = K.linear(x[0], w, threads=threads, activations=act)     # one token, 1-D
        assert y1.shape == (Rr,)
        if T < runtime.igemm_min_tokens():           # both on the row kernel: the same bits
            assert np.array_equal(y1, y[0])
        else:                                        # y on the integer GEMM path
            assert_dot_close(y1[None], y[:1], mag[:1], "alone " + what)


@pytest.mark.parametrize("fmt", QFORMATS)
def test_linear_iact_close_to_f32_path(isa, fmt):
    """int8 is the f32 path up to Q8_0's rounding of x: within 2% of the output's scale on
    random data (a half-step error on each of C inputs, ~0.3% typical); int16's steps are 258x
    finer: within 1e-4, and at least 50x closer than int8."""
    rng = rng_for("iact-vs-f32", fmt)
    w, _ = make_weight(rng, (64, 512), fmt, 32)
    x = rng.standard_normal((8, 512)).astype(F32)
    y32 = K.linear(x, w)
    scale = np.abs(y32).max()
    e8 = np.abs(K.linear(x, w, activations="int8") - y32).max()
    y16 = K.linear(x, w, activations="int16")
    e16 = np.abs(y16 - y32).max()
    assert 0 < e8 < 0.02 * scale
    assert 0 < e16 < 1e-4 * scale and e16 < e8 / 50


@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize("act", [a for a, _ in ACTS])
def test_iact_bit_identical_across_threads_and_token_blocks(isa, row_kernel, fmt, act):
    """Same bits for 1, 2, 3 threads, and for a token alone or at any place in a block of
    tokens: linear (group 32 and 128), the expert FFN and swiglu, on the row kernel (the
    integer GEMM path's own identities: tests/test_igemm.py)."""
    rng = rng_for("iact-identity", fmt, act)
    for G in (32, 128):
        w, _ = make_weight(rng, (203, 256), fmt, G)
        x = rng.standard_normal((11, 256)).astype(F32)
        y1 = K.linear(x, w, threads=1, activations=act)
        for n in (2, 3):
            assert np.array_equal(K.linear(x, w, threads=n, activations=act), y1), (G, n)
        for t in range(x.shape[0]):
            assert np.array_equal(K.linear(x[t:t + 1], w, threads=1, activations=act)[0],
                                  y1[t]), (G, t)
    D, I, G = ffn_dims(fmt)
    wg, wu, wd = make_experts(rng, 4, D, I, (fmt,) * 3, G)
    x = rng.standard_normal((9, D)).astype(F32)
    ids = np.argsort(rng.random((9, 4)), axis=1)[:, :2].astype(np.int32)
    weights = rng.random((9, 2)).astype(F32)
    block = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=1, activations=act)
    for n in (2, 3):
        assert np.array_equal(
            K.expert_ffn(x, ids, weights, wg, wu, wd, threads=n, activations=act), block)
    for t in range(x.shape[0]):
        one = K.expert_ffn(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], wg, wu, wd, threads=2,
                           activations=act)
        assert np.array_equal(one[0], block[t]), t
    e = (wg.expert(1), wu.expert(1), wd.expert(1))
    dense = K.swiglu(x, *e, threads=1, activations=act)
    assert np.array_equal(K.swiglu(x, *e, threads=2, activations=act), dense)
    assert np.array_equal(K.swiglu(x[4:5], *e, threads=2, activations=act)[0], dense[4])


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize("act, bits", ACTS)
def test_expert_ffn_iact_matches_reference(isa, threads, fmt, act, bits):
    rng = rng_for("ffn-iact", fmt, act)
    E = 5
    for D, I, G in ((64, 96, 32), (128, 256, 64)):
        wg, wu, wd = make_experts(rng, E, D, I, (fmt,) * 3, G)
        poison_expert(wg, wu, wd, 3)                # expert 3 is never chosen below
        choices = np.array([0, 1, 2, 4])
        for T, Kk in [(1, 1), (1, 2), (2, 2), (5, 2), (33, 3)]:
            x = rng.standard_normal((T, D)).astype(F32)
            ids = np.stack([rng.choice(choices, size=Kk, replace=False) for _ in range(T)])
            ids = ids.astype(np.int32)
            weights = rng.random((T, Kk)).astype(F32)
            y = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=threads, activations=act)
            assert y.shape == (T, D) and y.dtype == F32 and np.isfinite(y).all()
            assert_iact_ffn_close(
                y, R.expert_ffn_iact_ref(x, ids, weights, wg, wu, wd, bits=bits),
                f"{act} D={D} I={I} G={G} T={T} K={Kk}", bits)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("fmts", [("q4", "q4", "q4"), ("q8", "q8", "q8"), ("q4", "bf16", "q8"),
                                  ("bf16", "f16", "q4"), ("q8", "q4", "f32")])
@pytest.mark.parametrize("act, bits", ACTS)
def test_swiglu_and_mixed_formats_iact_match_reference(isa, threads, fmts, act, bits):
    """Plain-format matrices keep the f32 path inside a quantized-activation FFN (h is
    quantized only for a q4/q8 w_down); the references make the same choice per matrix."""
    rng = rng_for("swiglu-iact", fmts, act)
    D, I = 64, 160
    wg, wu, wd = (w.expert(0) for w in make_experts(rng, 1, D, I, fmts, 32))
    for T in (1, 3, 6):
        x = rng.standard_normal((T, D)).astype(F32)
        y = K.swiglu(x, wg, wu, wd, threads=threads, activations=act)
        assert_iact_ffn_close(y, R.swiglu_iact_ref(x, wg, wu, wd, bits=bits),
                              f"{act} {fmts} T={T}", bits)
    stack = make_experts(rng, 3, D, I, fmts, 32)
    x = rng.standard_normal((7, D)).astype(F32)
    ids = rng.integers(0, 3, size=(7, 2)).astype(np.int32)
    weights = rng.random((7, 2)).astype(F32)
    y = K.expert_ffn(x, ids, weights, *stack, threads=threads, activations=act)
    assert_iact_ffn_close(y, R.expert_ffn_iact_ref(x, ids, weights, *stack, bits=bits),
                          f"{act} {fmts} experts", bits)


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("act", [a for a, _ in ACTS])
def test_iact_leaves_plain_formats_on_the_f32_path(isa, fmt, act):
    rng = rng_for("iact-plain", fmt, act)
    w, _ = make_weight(rng, (21, 64), fmt)
    x = rng.standard_normal((5, 64)).astype(F32)
    assert np.array_equal(K.linear(x, w, activations=act), K.linear(x, w))
    wg, wu, wd = make_experts(rng, 3, 64, 96, (fmt,) * 3, 0)
    ids = np.array([[0, 2], [1, 0], [2, 1]], np.int32)
    weights = rng.random((3, 2)).astype(F32)
    assert np.array_equal(K.expert_ffn(x[:3], ids, weights, wg, wu, wd, activations=act),
                          K.expert_ffn(x[:3], ids, weights, wg, wu, wd))


def test_default_activations_are_f32(isa):
    rng = rng_for("int8-default")
    w, _ = make_weight(rng, (21, 64), "q4")
    x = rng.standard_normal((5, 64)).astype(F32)
    assert np.array_equal(K.linear(x, w), K.linear(x, w, activations="f32"))
    assert K.ACTIVATIONS == ("f32", "int8", "int16")


@pytest.mark.parametrize("act", [a for a, _ in ACTS])
def test_iact_nan_and_inf_inputs_give_nan_rows(isa, act):
    rng = rng_for("iact-nan", act)
    for fmt in QFORMATS:
        w, _ = make_weight(rng, (9, 128), fmt)
        x = rng.standard_normal((4, 128)).astype(F32)
        x[1, 77] = np.nan
        x[2, 3] = -np.inf
        y = K.linear(x, w, activations=act)
        assert np.isnan(y[1]).all() and np.isnan(y[2]).all()
        assert np.isfinite(y[[0, 3]]).all()
        x[3] = 0.0
        assert (K.linear(x, w, activations=act)[3] == 0).all()


@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize("act, bits", ACTS)
def test_iact_isa_paths_agree_with_scalar(fmt, act, bits):
    rng = rng_for("iact-agree", fmt, act)
    previous = runtime.get_isa()
    for G, C in ((32, 544), (128, 1024), (96, 288)):          # scale modes 0, 1, 3; odd blocks
        w, _ = make_weight(rng, (29, C), fmt, G)
        x = rng.standard_normal((5, C)).astype(F32)
        try:
            runtime.set_isa("scalar")
            ref = K.linear(x, w, activations=act)
            for name in runtime.available_isas()[1:]:
                runtime.set_isa(name)
                assert_dot_close(K.linear(x, w, activations=act), ref,
                                 iact_magnitude(x, w, bits=bits), f"{act} {name} vs scalar")
        finally:
            runtime.set_isa(previous)


def test_activations_argument_errors():
    rng = np.random.default_rng(3)
    w, _ = make_weight(rng, (8, 64), "q4")
    x = np.ones((2, 64), F32)
    for bad in ("int4", "F32", None, 8):
        with pytest.raises(ValueError, match="'f32', 'int8', 'int16'"):
            K.linear(x, w, activations=bad)
    wg, wu, wd = make_experts(rng, 2, 64, 96, ("q4",) * 3, 32)
    with pytest.raises(ValueError, match="'f32', 'int8', 'int16'"):
        K.expert_ffn(x, np.zeros((2, 1), np.int32), np.ones((2, 1), F32), wg, wu, wd,
                     activations="fp8")
    with pytest.raises(ValueError, match="'f32', 'int8', 'int16'"):
        K.swiglu(x, wg.expert(0), wu.expert(0), wd.expert(0), activations="bf16")
    with pytest.raises(ValueError, match="'f32', 'int8', 'int16'"):
        _kernels.linear(x, w, None, np.empty((2, 8), F32), 0, 1, "int4")


WIDE_ISAS = [name for name in ("avx512", "avxvnni", "avx512vnni") if name in runtime.ISAS]


@pytest.mark.parametrize("name", WIDE_ISAS)
@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize("act, bits", ACTS)
def test_wide_paths_equal_avx2_bitwise(row_kernel, name, fmt, act, bits):
    """The row-kernel bodies past AVX2 (the integer GEMM path off) give the AVX2 bodies'
    bits: the VNNI ones (vpdpbusd / vpdpwssd, csrc/vnni.h; 512-bit pair products on
    avx512vnni) and avx512's 512-bit int16 body (csrc/avx512_int.h) compute the same
    exact integer block sums in the same lanes and share the float text; so do the small-M
    bodies (csrc/smallm.h: avx512vnni, avx512's int16), in passes of up to 8 tokens. Every
    scale mode, partial last chunks, odd block counts, 1..17 tokens; q8 with the extreme codes (-128 weights against -127 / 127
    activations, the largest vpmaddubsw pairs) and q4 with all-15 nibbles."""
    if name not in runtime.available_isas() or "avx2" not in runtime.available_isas():
        pytest.skip(f"this CPU/OS does not run the {name} path")
    rng = rng_for("vnni-bitwise", name, fmt, act)
    previous = runtime.get_isa()
    try:
        for G, C in ((32, 544), (64, 1408), (128, 1024), (256, 2048), (512, 1536), (96, 288),
                     (32, 32), (32, 96)):
            w, _ = make_weight(rng, (13, C), fmt, G)
            buf = np.asarray(w.buf)
            for r in (0, 5):                                  # extreme codes in two rows
                start = w.offset + r * w.row_stride
                buf[start:start + (C if fmt == "q8" else C // 2)] = 0x80 if fmt == "q8" else 0xFF
            x = rng.standard_normal((17, C)).astype(F32)
            x[1] = -1.0                                        # codes all -127 / -32767
            x[2] = np.where(np.arange(C) % 2, 1.0, -1.0)
            for nt in (1, 2, 3, 4, 7, 8, 9, 17):     # the small-M bodies: passes of <= 8
                runtime.set_isa("avx2")
                ref = K.linear(x[:nt], w, activations=act)
                runtime.set_isa(name)
                got = K.linear(x[:nt], w, activations=act)
                assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (G, C, nt)
    finally:
        runtime.set_isa(previous)
