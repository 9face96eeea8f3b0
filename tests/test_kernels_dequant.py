"""Decoding the weight formats: dequantize against quant and the reference, and an identity
input that reads every weight back exactly.
"""
from __future__ import annotations

import numpy as np
import pytest

from colibri import dtypes, kernels as K
from colibri.format import quant
from colibri.kernels.weights import WeightRef
from colibri.kernels import _reference as R
from kernel_helpers import F32, FORMATS, make_weight, rng_for
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_quant_and_reference(fmt):
    rng = rng_for("deq", fmt)
    for G in ((32, 64) if fmt in dtypes.QUANTIZED else (0,)):
        shape = (3, 5, 128) if G else (3, 5, 37)
        w, src = make_weight(rng, shape, fmt, G)
        full = quant.decode(w.buf, fmt, shape, G)
        for e in range(3):
            got = K.dequantize(w, e)
            assert np.array_equal(got, full[e]), (fmt, G, e)
            assert np.array_equal(R.dequantize_ref(w, e), full[e]), (fmt, G, e)
        if fmt == "f32":
            assert np.array_equal(full, src)


@pytest.mark.parametrize("fmt", FORMATS)
def test_identity_input_reads_every_weight_exactly(isa, fmt):
    """linear(I_C, W) = W.T bit for bit: with one-hot inputs every output is one weight times
    1 plus exact zeros, so any error in the layout, the f16/bf16 widening (every finite bit
    pattern, subnormals included), the nibble order or the offset fold shows up exactly."""
    C = 64
    if fmt in ("f16", "bf16"):
        bits = np.arange(1 << 16, dtype=np.uint32)
        exp_mask = 0x7C00 if fmt == "f16" else 0x7F80              # inf/NaN exponent
        finite = bits[(bits & exp_mask) != exp_mask].astype("<u2")
        buf = finite.view(np.uint8)
        w = WeightRef(buf, 0, fmt, finite.size // C, C)
    else:
        w, _ = make_weight(rng_for("eye", fmt), (45, 128), fmt, 32)
        C = 128
    y = K.linear(np.eye(C, dtype=F32), w, threads=2)
    assert np.array_equal(y, R.dequantize_ref(w).T)
