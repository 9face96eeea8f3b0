"""MXFP4 against int8 / int16 activations (csrc/mxfp4.h's integer bodies): the doubled FP4
codes dotted exactly with the activation codes, scale 2^(e - 127) / 2 times the activation
block's d. Against the NumPy twin (colibri.kernels._reference.linear_iact_ref) on every ISA path,
each SIMD body against the scalar one, the VNNI bodies bit for bit against the AVX2 one.
Tolerances as tests/test_kernels_activations.py (its iact_magnitude bound). The integer GEMM
path is off here (igemm_min_tokens 10^9: these are the row kernels' tests);
tests/test_mxfp4_gemm.py has its MXFP4 body."""
from __future__ import annotations

import numpy as np
import pytest

from colibri import kernels as K
from colibri.format import mxfp4
from colibri.kernels import runtime
from colibri.kernels import _reference as R
from colibri.kernels.weights import WeightRef
from kernel_helpers import F32, THREADS, assert_dot_close, rng_for
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)
from test_kernels_activations import assert_iact_ffn_close, iact_magnitude

ACTS = [("int8", 8), ("int16", 16)]
# (tokens, rows, cols): one block, odd block counts, partial last chunks, GPT-OSS's 2880
SHAPES = [(1, 1, 32), (2, 37, 64), (3, 19, 96), (4, 13, 256), (5, 7, 288), (7, 5, 544),
          (1, 6, 2880), (130, 3, 128)]


@pytest.fixture(autouse=True)
def row_kernels_only():
    """Every call on the row kernel, whatever its token count (restored after)."""
    previous = runtime.igemm_min_tokens()
    runtime.set_igemm_min_tokens(10 ** 9)
    yield
    runtime.set_igemm_min_tokens(previous)


def mx_weight(rng, shape, scales=(120, 134)) -> WeightRef:
    """Random MXFP4 (R, C) or (E, R, C): every nibble; scale bytes in [lo, hi) or from a list."""
    *lead, C = shape
    codes = rng.integers(0, 256, size=(*lead, C // 2), dtype=np.uint8)
    if isinstance(scales, tuple):
        sc = rng.integers(*scales, size=(*lead, C // 32)).astype(np.uint8)
    else:
        sc = rng.choice(np.asarray(scales, np.uint8), size=(*lead, C // 32))
    E = shape[0] if len(shape) == 3 else 1
    return WeightRef(buf=mxfp4.rows(codes, sc).reshape(-1).copy(), offset=0, dtype="mxfp4",
                     rows=shape[-2], cols=C, group_size=32, n_experts=E)


def test_reference_codes_are_twice_the_fp4_values():
    rng = rng_for("mx-codes")
    w = mx_weight(rng, (3, 64))
    codes, scales = R._codes_scales(w, 0)
    np.testing.assert_array_equal(codes.reshape(3, 2, 32) * scales[:, :, None].astype(np.float64),
                                  R.dequantize_ref(w).reshape(3, 2, 32))


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("act, bits", ACTS)
def test_linear_matches_reference(isa, threads, act, bits):
    rng = rng_for("mx-iact", act)
    for T, Rr, C in SHAPES:
        w = mx_weight(rng, (Rr, C))
        x = rng.standard_normal((T, C)).astype(F32)
        bias = rng.standard_normal(Rr).astype(F32)
        y = K.linear(x, w, bias, threads=threads, activations=act)
        assert_dot_close(y, R.linear_iact_ref(x, w, bias, bits=bits),
                         iact_magnitude(x, w, bits=bits) + np.abs(bias), f"{act} T={T} C={C}")
        # the quantized path, not the f32 one: close to it but not its bits
        assert not np.array_equal(y, K.linear(x, w, bias, threads=threads)) or C == 32


@pytest.mark.parametrize("act, bits", ACTS)
def test_extreme_scales_and_codes(isa, act, bits):
    """Scale bytes 0 and 1 (halved: 2^-128, 2^-127, subnormal) to 200; all-+-6 rows (code
    +-12, the largest products)."""
    rng = rng_for("mx-iact-extreme", act)
    w = mx_weight(rng, (9, 288), scales=[0, 1, 2, 60, 127, 180, 200])
    buf = np.asarray(w.buf)
    buf[0:144] = 0x77                                   # row 0: +6 everywhere
    buf[w.row_stride:w.row_stride + 144] = 0xFF         # row 1: -6 everywhere
    x = rng.standard_normal((4, 288)).astype(F32)
    x[1] = -1.0                                         # codes all -127 / -32767
    x[2] = np.where(np.arange(288) % 2, 1.0, -1.0)
    y = K.linear(x, w, activations=act)
    assert_dot_close(y, R.linear_iact_ref(x, w, bits=bits), iact_magnitude(x, w, bits=bits),
                     f"{act} extreme")


@pytest.mark.parametrize("act", [a for a, _ in ACTS])
def test_nan_inf_and_zero_rows(isa, act):
    rng = rng_for("mx-iact-nan", act)
    w = mx_weight(rng, (9, 128))
    x = rng.standard_normal((4, 128)).astype(F32)
    x[1, 77] = np.nan
    x[2, 3] = -np.inf
    x[3] = 0.0
    y = K.linear(x, w, activations=act)
    assert np.isnan(y[1]).all() and np.isnan(y[2]).all()
    assert np.isfinite(y[0]).all() and (y[3] == 0).all()


@pytest.mark.parametrize("act", [a for a, _ in ACTS])
def test_bit_identical_across_threads_and_token_blocks(isa, act):
    rng = rng_for("mx-iact-blocks", act)
    w = mx_weight(rng, (41, 288))
    x = rng.standard_normal((11, 288)).astype(F32)
    full = K.linear(x, w, threads=1, activations=act)
    np.testing.assert_array_equal(K.linear(x, w, threads=2, activations=act), full)
    for t in range(11):
        np.testing.assert_array_equal(K.linear(x[t], w, activations=act), full[t])


@pytest.mark.parametrize("act, bits", ACTS)
def test_isa_paths_agree_with_scalar(act, bits):
    rng = rng_for("mx-iact-agree", act)
    previous = runtime.get_isa()
    try:
        for C in (32, 96, 288, 544, 2880):
            w = mx_weight(rng, (29, C))
            x = rng.standard_normal((5, C)).astype(F32)
            runtime.set_isa("scalar")
            ref = K.linear(x, w, activations=act)
            for name in runtime.available_isas()[1:]:
                runtime.set_isa(name)
                assert_dot_close(K.linear(x, w, activations=act), ref,
                                 iact_magnitude(x, w, bits=bits), f"{act} {name} vs scalar C={C}")
    finally:
        runtime.set_isa(previous)


@pytest.mark.parametrize("name", ["avxvnni", "avx512vnni"])
@pytest.mark.parametrize("act", [a for a, _ in ACTS])
def test_vnni_paths_equal_avx2_bitwise(name, act):
    """vpdpbusd on code2 + 128 (less 16 s) and vpdpwssd give the AVX2 body's integers, and the
    float text is shared: the same bits, for 1..7 tokens and the extreme codes."""
    available = runtime.available_isas()
    if name not in available or "avx2" not in available:
        pytest.skip(f"this CPU/OS does not run the {name} path")
    rng = rng_for("mx-vnni", name, act)
    previous = runtime.get_isa()
    try:
        for C in (32, 96, 288, 544, 2880):
            w = mx_weight(rng, (13, C))
            np.asarray(w.buf)[0:C // 2] = 0xFF                  # -6 everywhere in row 0
            x = rng.standard_normal((7, C)).astype(F32)
            x[1] = -1.0
            for nt in (1, 2, 3, 4, 7):
                runtime.set_isa("avx2")
                ref = K.linear(x[:nt], w, activations=act)
                runtime.set_isa(name)
                np.testing.assert_array_equal(K.linear(x[:nt], w, activations=act), ref,
                                              f"{name} {act} C={C} nt={nt}")
    finally:
        runtime.set_isa(previous)


@pytest.mark.parametrize("act, bits", ACTS)
def test_expert_ffn_matches_reference(isa, act, bits):
    rng = rng_for("mx-iact-ffn", act)
    E, D, I = 4, 96, 64
    wg, wu, wd = (mx_weight(rng, s, (118, 124)) for s in ((E, I, D), (E, I, D), (E, D, I)))
    for T in (1, 3, 40):
        x = rng.standard_normal((T, D)).astype(F32)
        ids = rng.integers(0, E, size=(T, 2)).astype(np.int32)
        ids[:, 1] = (ids[:, 0] + 1) % E
        wts = rng.random((T, 2)).astype(F32)
        y = K.expert_ffn(x, ids, wts, wg, wu, wd, threads=2, activations=act)
        assert_iact_ffn_close(y, R.expert_ffn_iact_ref(x, ids, wts, wg, wu, wd, bits=bits),
                              f"{act} T={T}", bits)
