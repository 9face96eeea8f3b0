"""The MXFP4 weight format (colibri/format/mxfp4.py, csrc/mxfp4.h): its bytes against transformers'
MXFP4 decoder, the quantizer, and the kernels (row kernel, GEMM path, expert FFN, dequantize)
on every ISA path against the NumPy references; each SIMD body against the scalar one. (The
int8 / int16 activation bodies: tests/test_mxfp4_idot.py; the GEMM panel: test_mxfp4_gemm.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from colibri import _kernels, dtypes, kernels as K
from colibri.format import mxfp4, quant
from colibri.kernels import runtime
from colibri.kernels import _reference as R
from colibri.kernels.weights import WeightRef
from kernel_helpers import (F32, GEMM_MIN, THREADS, assert_dot_close, assert_ffn_close,
                            magnitude, rng_for)
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)


def mx_weight(rng, shape, scale=0.5, spread=4) -> WeightRef:
    """A random MXFP4 WeightRef (R, C) or (E, R, C): random codes, scales 2^-spread..2^spread
    around `scale`, every nibble and sign present."""
    *lead, C = shape
    codes = rng.integers(0, 256, size=(*lead, C // 2), dtype=np.uint8)
    e0 = 127 + int(np.round(np.log2(scale)))
    scales = rng.integers(e0 - spread, e0 + spread + 1, size=(*lead, C // 32)).astype(np.uint8)
    buf = mxfp4.rows(codes, scales).reshape(-1).copy()
    E = shape[0] if len(shape) == 3 else 1
    return WeightRef(buf=buf, offset=0, dtype="mxfp4", rows=shape[-2], cols=C, group_size=32,
                     n_experts=E)


def test_the_format_row():
    assert dtypes.DTYPES["mxfp4"].code == 6 and dtypes.by_code(6).name == "mxfp4"
    assert dtypes.row_stride("mxfp4", 64, 32) == 32 + 2
    assert dtypes.tensor_nbytes("mxfp4", (3, 5, 96), 32) == 15 * (48 + 3)
    with pytest.raises(ValueError, match="mxfp4 has group size 32, found 64"):
        dtypes.row_stride("mxfp4", 128, 64)


def test_decoding_matches_transformers():
    """The bytes as the checkpoint's *_blocks / *_scales: transformers' decoder (before its
    transpose) gives colibri.format.mxfp4.dequantize's values, the reference's and the kernel's."""
    torch = pytest.importorskip("torch")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    rng = rng_for("hf-mxfp4")
    E, Rr, C = 2, 6, 96
    blocks = rng.integers(0, 256, size=(E, Rr, C // 32, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, size=(E, Rr, C // 32), dtype=np.uint8)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                      dtype=torch.float32).transpose(1, 2).numpy()   # (E, R, C)
    got = mxfp4.dequantize(blocks.reshape(E, Rr, C // 2), scales)
    np.testing.assert_array_equal(got, want)
    w = WeightRef(buf=mxfp4.rows(blocks.reshape(E, Rr, C // 2), scales).reshape(-1).copy(),
                  offset=0, dtype="mxfp4", rows=Rr, cols=C, group_size=32, n_experts=E)
    for e in range(E):
        np.testing.assert_array_equal(R.dequantize_ref(w, e), want[e])
        np.testing.assert_array_equal(K.dequantize(w, e), want[e])
    raw = np.frombuffer(w.buf, np.uint8)
    np.testing.assert_array_equal(quant.decode(raw, "mxfp4", (E, Rr, C), 32), want)


def test_quantizer_round_trip_and_rule():
    rng = rng_for("mx-quant")
    w = (rng.standard_normal((7, 128)) * 3).astype(F32)
    w[0, :32] = 0.0                                       # an all-zero block
    raw = quant.encode(w, "mxfp4", 32)
    back = quant.decode(raw, "mxfp4", w.shape, 32)
    codes, scales = mxfp4.quantize(w)
    assert scales[0, 0] == 0 and (back[0, :32] == 0).all()
    # each block: scale 2^(floor(log2 amax) - 2), so amax / scale in [4, 8) and the error of
    # every element at most half a step of the FP4 grid at that scale (1 for |v| in [4, 6]),
    # or the saturation at 6 (less than 2) above it
    s = mxfp4.e8m0_to_f32(scales)[..., None]
    v = np.abs(w.reshape(7, 4, 32)) / s
    err = np.abs(back - w).reshape(7, 4, 32) / s
    step = np.where(v < 2, 0.25, np.where(v < 4, 0.5, np.where(v <= 6, 1.0, v - 6)))
    assert (v < 8).all() and (v[np.abs(w.reshape(7, 4, 32)).max(-1) > 0].max() >= 4)
    assert (err <= step + 1e-6).all()
    exact = mxfp4.FP4_VALUES[rng.integers(0, 16, size=(3, 64))] * np.float32(0.25)
    np.testing.assert_array_equal(quant.decode(quant.encode(exact, "mxfp4", 32), "mxfp4",
                                               exact.shape, 32), exact)  # representable: exact


@pytest.mark.parametrize("threads", THREADS)
def test_linear_matches_reference(isa, threads):
    rng = rng_for("mx-linear")
    for T, Rr, C in ((1, 1, 32), (3, 37, 128), (2 * GEMM_MIN + 1, 19, 256), (GEMM_MIN, 5, 96)):
        w = mx_weight(rng, (Rr, C))
        x = rng.standard_normal((T, C)).astype(F32)
        bias = rng.standard_normal(Rr).astype(F32)
        y = K.linear(x, w, bias, threads=threads)       # the GEMM path from GEMM_MIN tokens
        assert_dot_close(y, R.linear_ref(x, w, bias), magnitude(x, w) + np.abs(bias),
                         f"T={T} R={Rr} C={C}")
        for t in range(min(T, 3)):                      # the row kernel, one token
            assert_dot_close(K.linear(x[t], w, threads=threads), R.linear_ref(x[t], w),
                             magnitude(x[t], w), f"token {t}")


def test_expert_stacks_and_ffn(isa):
    rng = rng_for("mx-ffn")
    E, D, I, T = 4, 64, 96, 7
    wg, wu, wd = (mx_weight(rng, s, 0.1) for s in ((E, I, D), (E, I, D), (E, D, I)))
    x = rng.standard_normal((T, D)).astype(F32)
    ids = rng.integers(0, E, size=(T, 2)).astype(np.int32)
    ids[:, 1] = (ids[:, 0] + 1) % E
    wts = rng.random((T, 2)).astype(F32)
    y = K.expert_ffn(x, ids, wts, wg, wu, wd, threads=2)
    assert_ffn_close(y, R.expert_ffn_ref(x, ids, wts, wg, wu, wd), "mxfp4 experts")
    for e in range(E):
        assert_dot_close(K.linear(x, wg, expert=e), R.linear_ref(x, wg, expert=e),
                         magnitude(x, wg, e), f"expert {e}")


def test_isa_paths_agree_with_scalar():
    """The AVX2 and AVX-512 bodies against the scalar body, row kernel and GEMM path."""
    rng = rng_for("mx-agree")
    w = mx_weight(rng, (29, 256))
    previous = runtime.get_isa()
    try:
        for T in (3, 2 * GEMM_MIN):
            x = rng.standard_normal((T, 256)).astype(F32)
            runtime.set_isa("scalar")
            ref = K.linear(x, w)
            for name in runtime.available_isas()[1:]:
                runtime.set_isa(name)
                assert_dot_close(K.linear(x, w), ref, magnitude(x, w), f"{name} vs scalar T={T}")
    finally:
        runtime.set_isa(previous)
    assert "avx512" in runtime.available_isas() or "avx2" in runtime.available_isas()


def test_bad_group_size_is_refused():
    buf = np.zeros(2 * (64 + 2), np.uint8)
    with pytest.raises(ValueError, match="group size 32"):
        WeightRef(buf=buf, offset=0, dtype="mxfp4", rows=2, cols=128, group_size=64)
    ref = WeightRef(buf=np.zeros(2 * 34, np.uint8), offset=0, dtype="mxfp4", rows=2, cols=64,
                    group_size=32)
    with pytest.raises(ValueError, match="group_size 64 must be 32"):
        _kernels.weight_span(type("W", (), dict(
            buf=ref.buf, dtype="mxfp4", offset=0, rows=1, cols=128, group_size=64,
            row_stride=68, n_experts=1, expert_stride=0))(), "w")
