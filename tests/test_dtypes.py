"""Tests of colibri.dtypes: the one table of weight formats, their codes, bits and sizes.

Expectations come from the spec's arithmetic (docs/format.md §6), not from the table.
"""
import numpy as np
import pytest

from colibri import dtypes as D
from colibri.format import quant as Q


# ---------------------------------------------------------------------------------------------
# sizes


@pytest.mark.parametrize("dtype,bits", [("f32", 32), ("f16", 16), ("bf16", 16), ("q8", 8),
                                        ("q4", 4), ("i32", 32), ("mxfp4", 4)])
def test_bits_and_codes(dtype, bits):
    assert D.dtype(dtype).bits == bits
    assert D.by_code(D.dtype(dtype).code).name == dtype
    assert {n: d.code for n, d in D.DTYPES.items()} == {
        "f32": 0, "f16": 1, "bf16": 2, "q8": 3, "q4": 4, "i32": 5, "mxfp4": 6}
    assert D.DTYPE_NAMES == ("f32", "f16", "bf16", "q8", "q4", "i32", "mxfp4")
    assert D.QUANTIZED == ("q8", "q4", "mxfp4")


@pytest.mark.parametrize("cols,g", [(32, 32), (4096, 32), (4096, 64), (14336, 128), (96, 96)])
def test_row_stride_and_nbytes(cols, g):
    # docs/format.md §6: row_stride = C * bits / 8 + (C / G) * 2.
    assert D.row_stride("q8", cols, g) == cols + 2 * (cols // g)
    assert D.row_stride("q4", cols, g) == cols // 2 + 2 * (cols // g)
    assert D.tensor_nbytes("q4", (3, 5, cols), g) == 15 * (cols // 2 + 2 * (cols // g))
    assert D.tensor_nbytes("q8", (cols,), g) == cols + 2 * (cols // g)
    assert D.tensor_nbytes("f32", (3, 5, cols)) == 60 * cols
    assert D.tensor_nbytes("bf16", (5, cols)) == 10 * cols
    assert D.tensor_nbytes("i32", (cols,)) == 4 * cols


def test_nbytes_no_overflow_and_bad_input():
    # Python ints: a hostile shape must not wrap around.
    assert D.tensor_nbytes("f32", (2**40, 2**30)) == 2**72
    with pytest.raises(ValueError, match="unknown dtype 'q3'"):
        D.tensor_nbytes("q3", (4,))
    with pytest.raises(ValueError, match=r"\(4, 0\)"):
        D.tensor_nbytes("f32", (4, 0))


@pytest.mark.parametrize("cols,g,pattern", [
    (96, 64, "group_size 64 does not divide its 96 columns"),
    (96, 48, "group_size 48 is not a positive multiple of 32"),
    (64, 0, "group_size 0 is not a positive multiple of 32"),
    (64, -32, "group_size -32 is not a positive multiple of 32"),
    (64, 16, "group_size 16 is not a positive multiple of 32"),
])
def test_bad_group_sizes_rejected(cols, g, pattern):
    with pytest.raises(ValueError, match=pattern) as exc:
        D.check_group_size(cols, g, "layers.0.moe.experts.1.w_up")
    assert "layers.0.moe.experts.1.w_up" in str(exc.value)
    with pytest.raises(ValueError, match=pattern):
        Q.quantize_q4(np.ones((2, cols), np.float32), g, name="x")
    with pytest.raises(ValueError, match=pattern):
        D.tensor_nbytes("q8", (2, cols), g)
