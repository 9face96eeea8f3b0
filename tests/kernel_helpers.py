"""What the kernel tests (tests/test_kernels_*.py, one file per section of colibri/_kernels.pyx)
share: the parameters (formats, threads, ISA paths), the fixtures (isa; parallel_everything,
which every file imports), random weights and experts, and the tolerances of the comparisons
with the NumPy twins (colibri.kernels._reference).

The kernels run on every ISA path this machine runs, with 1 and 2 threads, all five weight
formats, and odd shapes.

Tolerances. The kernels accumulate in float32, the references in float64. For a dot product
the float32 rounding error is bounded by (number of sequential additions) * eps * sum|terms|;
with C <= 300 that is < 1e-5 * sum|x_c w_c|, which is the bound asserted (q4 adds the folded
offset term, so its magnitude counts |x| * 8|s| too). The GEMM (prefill) path, taken from
GEMM_MIN tokens per matrix on, sums 8 column lanes of up to C/8 terms and then the lanes: the
same bound holds for its C <= 544. A wrong layout, nibble order or scale gives errors of the
order of sum|terms| itself, far above it. Discrete results (expert ids, grouping) are compared
exactly, and so are results across thread counts. A token's result is bit-identical alone and
inside a block below GEMM_MIN tokens (the row kernel), and across any blocks of GEMM_MIN
tokens or more (the GEMM path); between the two paths it differs in the last bits.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from colibri import _kernels, dtypes
from colibri.format import quant
from colibri.kernels import runtime
from colibri.kernels.weights import WeightRef
from colibri.kernels import _reference as R

FORMATS = ["f32", "f16", "bf16", "q8", "q4"]
THREADS = [1, 2]
ISA_PARAMS = [
    pytest.param(isa, marks=pytest.mark.skipif(
        isa not in runtime.available_isas(), reason=f"this CPU/OS does not run the {isa} path"))
    for isa in runtime.ISAS
]
F32 = np.float32
GEMM_MIN = _kernels.get_gemm_min_tokens()      # tokens per matrix from which the GEMM path runs


@pytest.fixture(autouse=True)
def parallel_everything():
    """Every call with threads > 1 really runs in parallel (the default threshold would run
    these small test matrices on one thread and leave the parallel paths untested)."""
    previous = runtime.min_parallel_bytes()
    runtime.set_min_parallel_bytes(1)
    yield
    runtime.set_min_parallel_bytes(previous)


@pytest.fixture(params=ISA_PARAMS)
def isa(request):
    previous = runtime.get_isa()
    runtime.set_isa(request.param)
    yield request.param
    runtime.set_isa(previous)


def rng_for(*key) -> np.random.Generator:
    """A generator seeded by the test's own key (stable across runs and processes)."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def make_weight(rng, shape, fmt, group_size=32, scale=0.5) -> tuple[WeightRef, np.ndarray]:
    """A random WeightRef of logical shape (R, C) or (E, R, C), and its f32 source."""
    w = (rng.standard_normal(shape) * scale).astype(F32)
    return WeightRef.from_array(w, fmt, group_size if fmt in dtypes.QUANTIZED else 0), w


def magnitude(x: np.ndarray, w: WeightRef, expert: int = 0) -> np.ndarray:
    """sum_c |x_c| |w_c| per (token, row), plus the q4 offset term: the error scale of a dot."""
    W = np.abs(R.dequantize_ref(w, expert)).astype(np.float64)
    if w.dtype == "q4":
        start = w.offset + expert * w.expert_stride
        rows = np.asarray(w.buf)[start:start + w.rows * w.row_stride].reshape(w.rows, -1)
        _, scales = quant.split_rows(rows[:, :dtypes.row_stride("q4", w.cols, w.group_size)],
                                     "q4", w.cols, w.group_size)
        W = W + 8 * np.repeat(np.abs(scales.astype(np.float64)), w.group_size, axis=1)
    return np.abs(np.atleast_2d(x)).astype(np.float64) @ W.T


def assert_dot_close(y, y_ref, mag, what=""):
    err = np.abs(y.astype(np.float64) - y_ref.astype(np.float64)).reshape(mag.shape)
    bound = 1e-5 * mag + 1e-6
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (f"{what}: error {err[worst]:.3g} > bound {bound[worst]:.3g} "
                                  f"at {worst}")


def assert_ffn_close(y, y_ref, what=""):
    scale = float(np.abs(y_ref).max()) + 1e-6
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=2e-5 * scale, err_msg=what)


def ffn_dims(fmt):
    """(D, I, group): odd sizes where the format allows, group-size multiples otherwise."""
    return (64, 96, 32) if fmt in dtypes.QUANTIZED else (45, 67, 0)


def make_experts(rng, E, D, I, fmts, G):
    fg, fu, fd = fmts
    wg, _ = make_weight(rng, (E, I, D), fg, G, 0.3)
    wu, _ = make_weight(rng, (E, I, D), fu, G, 0.3)
    wd, _ = make_weight(rng, (E, D, I), fd, G, 0.3)
    return wg, wu, wd


def poison_expert(*weights_and_e):
    """Overwrite every byte of expert e of each WeightRef with 0xFF (NaN in every format)."""
    *ws, e = weights_and_e
    for w in ws:
        start = w.offset + e * w.expert_stride
        w.buf[start:start + (w.rows - 1) * w.row_stride + dtypes.row_stride(
            w.dtype, w.cols, w.group_size)] = 0xFF


def on_each_model_forced(converted, isa: int, cases, check,
                         activations=("f32", "int16", "int8")):
    """check(model) for each (case, fmt) of `cases` on each activations setting, the model
    the file converted(case, fmt) loaded with 2 threads, and path `isa` forced while check
    runs (as COLIBRI_ISA does; the previous path restored, the model closed)."""
    from colibri import api
    previous = runtime.get_isa()
    try:
        for case, fmt in cases:
            for act in activations:
                m = api.load(converted(case, fmt), threads=2, activations=act)
                try:
                    runtime.set_isa(isa)
                    check(m)
                finally:
                    runtime.set_isa(previous)
                    m.close()
    finally:
        runtime.set_isa(previous)
