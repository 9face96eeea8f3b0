"""The MXFP4 panel decode of the f32 GEMM path (csrc/gemm.h): the decoded floats are exact, so
on every ISA path an MXFP4 matrix multiplies to the same bits as an f32 matrix holding its
dequantized values (the same micro-kernel over the same panel), for scales across the whole
E8M0 range, the subnormal ones (bytes 0, 1) included."""
from __future__ import annotations

import numpy as np
import pytest

from colibri import kernels as K, mxfp4
from colibri import _reference as R
from colibri.weights import WeightRef
from kernel_helpers import F32, GEMM_MIN, THREADS, rng_for
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)


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
