"""Kernels against their NumPy twins (colibri._reference), on every ISA path this machine runs,
with 1 and 2 threads, all five weight formats, and odd shapes.

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

import mmap
import subprocess
import sys
import types
import zlib

import numpy as np
import pytest

from colibri import _kernels, kernels as K, quant, runtime
from colibri import _reference as R
from colibri.weights import WeightRef

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
    return WeightRef.from_array(w, fmt, group_size if fmt in quant.QUANTIZED else 0), w


def magnitude(x: np.ndarray, w: WeightRef, expert: int = 0) -> np.ndarray:
    """sum_c |x_c| |w_c| per (token, row), plus the q4 offset term: the error scale of a dot."""
    W = np.abs(R.dequantize_ref(w, expert)).astype(np.float64)
    if w.dtype == "q4":
        start = w.offset + expert * w.expert_stride
        rows = np.asarray(w.buf)[start:start + w.rows * w.row_stride].reshape(w.rows, -1)
        _, scales = quant.split_rows(rows[:, :quant.row_stride("q4", w.cols, w.group_size)],
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


# ---------------------------------------------------------------------------------------------
# ISA selection and threads


def test_isa_selection():
    isas = runtime.available_isas()
    assert isas[0] == "scalar" and set(isas) <= set(runtime.ISAS)
    previous = runtime.get_isa()
    try:
        for name in isas:
            runtime.set_isa(name)
            assert runtime.get_isa() == name
        runtime.set_isa(None)
        assert runtime.get_isa() == isas[-1]           # the widest supported path
        with pytest.raises(ValueError, match="unknown ISA"):
            runtime.set_isa("sse9")
        for name in set(runtime.ISAS) - set(isas):
            with pytest.raises(ValueError, match="not supported"):
                runtime.set_isa(name)
    finally:
        runtime.set_isa(previous)


def test_env_forces_isa_at_import(tmp_path):
    # cwd away from the checkout, so the installed package (with its compiled kernels) is
    # imported, not the source folder
    code = "from colibri import runtime; print(runtime.get_isa())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "COLIBRI_ISA": "scalar"}, timeout=120,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "scalar"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "COLIBRI_ISA": "mmx"}, timeout=120,
                         cwd=tmp_path)
    assert res.returncode != 0 and "COLIBRI_ISA" in res.stderr


def test_spin_us_setting_and_env(tmp_path):
    """The pool's idle spin: set_spin_us / COLIBRI_SPIN_US, validated; results unchanged."""
    assert runtime.spin_us() == runtime.SPIN_US.default >= 0
    rng = rng_for("spin")
    w, _ = make_weight(rng, (300, 64), "q4", 32)
    x = rng.standard_normal((3, 64)).astype(F32)
    y = K.linear(x, w, threads=1)
    for us in (0, 5, 100000):
        runtime.set_spin_us(us)
        assert runtime.spin_us() == us
        assert np.array_equal(K.linear(x, w, threads=2), y)
    with pytest.raises(ValueError, match="spin_us"):
        runtime.set_spin_us(-1)
    runtime.set_spin_us(None)
    assert runtime.spin_us() == runtime.SPIN_US.default
    code = "from colibri import runtime; print(runtime.spin_us())"
    for value, ok in (("0", True), ("250", True), ("soon", False), ("-3", False)):
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**__import__("os").environ, "COLIBRI_SPIN_US": value},
                             timeout=120, cwd=tmp_path)
        if ok:
            assert res.returncode == 0 and res.stdout.strip() == value, res.stderr
        else:
            assert res.returncode != 0 and "COLIBRI_SPIN_US" in res.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX threads build")
def test_build_has_the_thread_pool():
    """A Linux build must have the pool (COLIBRI_NO_THREADS=1 is the only way to lose it)."""
    assert _kernels.threaded()


def test_pool_more_threads_than_cores_and_limit():
    """Threads beyond the cores (and beyond the work items) give the same bits; the pool's
    limit is a clear error."""
    rng = rng_for("pool", "oversubscribed")
    w, _ = make_weight(rng, (203, 128), "q4", 32)
    x = rng.standard_normal((5, 128)).astype(F32)
    y1 = K.linear(x, w, threads=1)
    for n in (7, 16, 64, runtime.MAX_THREADS):
        assert np.array_equal(K.linear(x, w, threads=n), y1), n
    small, _ = make_weight(rng, (2, 128), "q8", 32)
    assert np.array_equal(K.linear(x, small, threads=8), K.linear(x, small, threads=1))
    assert runtime.MAX_THREADS == 127
    with pytest.raises(ValueError, match=r"threads must be in 1\.\.127, found 128"):
        K.linear(x, w, threads=128)


@pytest.mark.skipif(not _kernels.threaded(), reason="a build without the thread pool")
@pytest.mark.parametrize("threads", [2, 64, runtime.MAX_THREADS])
def test_pool_workers_take_part(threads):
    """The workers really run items, at every thread count the pool accepts (a count that
    did not fit the pool's job word once left every item to the caller)."""
    rng = rng_for("pool", "workers")
    w, _ = make_weight(rng, (4096, 1024), "q4", 32)
    x = rng.standard_normal((1, 1024)).astype(F32)
    want = K.linear(x, w, threads=1)
    before = _kernels.pool_worker_items()
    for _ in range(20):
        assert np.array_equal(K.linear(x, w, threads=threads), want)
    assert _kernels.pool_worker_items() > before


def test_pool_concurrent_callers():
    """Python threads calling kernels at once (the GIL is released inside): one uses the
    workers, the others run alone; every result is exact."""
    import threading
    rng = rng_for("pool", "concurrent")
    D, I = 64, 96
    wg, wu, wd = make_experts(rng, 4, D, I, ("q4",) * 3, 32)
    w, _ = make_weight(rng, (517, D), "q8", 32)
    x = rng.standard_normal((6, D)).astype(F32)
    ids = np.argsort(rng.random((6, 4)), axis=1)[:, :2].astype(np.int32)
    weights = rng.random((6, 2)).astype(F32)
    want = (K.linear(x, w, threads=1), K.expert_ffn(x, ids, weights, wg, wu, wd, threads=1))
    bad = []

    def work(n):
        for i in range(60):
            got = (K.linear(x, w, threads=n, activations="int8" if i % 3 == 2 else "f32"),
                   K.expert_ffn(x, ids, weights, wg, wu, wd, threads=n))
            if i % 3 != 2 and not (np.array_equal(got[0], want[0])
                                   and np.array_equal(got[1], want[1])):
                bad.append((n, i))

    threads = [threading.Thread(target=work, args=(n,)) for n in (2, 2, 3, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads) and not bad, bad


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork()")
def test_pool_after_fork():
    """A child forked after the pool started has no workers: its kernels still run (on new
    workers) and give the same bits; it must not hang on the parent's."""
    import os
    rng = rng_for("pool", "fork")
    w, _ = make_weight(rng, (203, 128), "q4", 32)
    x = rng.standard_normal((5, 128)).astype(F32)
    y = K.linear(x, w, threads=2)                    # the parent's workers exist now
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:                                      # child: one byte, 1 = same bits
        try:
            ok = np.array_equal(K.linear(x, w, threads=2), y)
            os.write(wfd, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(wfd)
    got = os.read(r, 1)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert got == b"1" and os.waitstatus_to_exitcode(status) == 0


def test_default_threads(monkeypatch):
    monkeypatch.delenv("COLIBRI_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    n = runtime.default_threads()
    assert 1 <= n <= (__import__("os").cpu_count() or 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3,2")
    assert runtime.default_threads() == 3
    monkeypatch.setenv("COLIBRI_NUM_THREADS", "5")         # colibri's own variable wins
    assert runtime.default_threads() == 5
    monkeypatch.setenv("COLIBRI_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="COLIBRI_NUM_THREADS"):
        runtime.default_threads()
    w, _ = make_weight(np.random.default_rng(0), (3, 8), "f32")
    with pytest.raises(ValueError, match="threads"):
        K.linear(np.ones((1, 8), F32), w, threads=0)


# ---------------------------------------------------------------------------------------------
# decoding the formats


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_quant_and_reference(fmt):
    rng = rng_for("deq", fmt)
    for G in ((32, 64) if fmt in quant.QUANTIZED else (0,)):
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


# ---------------------------------------------------------------------------------------------
# linear

PLAIN_SHAPES = [(1, 1, 1), (1, 33, 7), (3, 17, 45), (9, 67, 100), (6, 5, 300)]      # T, R, C
QUANT_SHAPES = [(1, 1, 32, 32), (1, 37, 128, 64), (5, 19, 256, 128), (9, 13, 96, 32)]


def linear_cases(fmt):
    if fmt in quant.QUANTIZED:
        return QUANT_SHAPES
    return [(T, Rr, C, 0) for T, Rr, C in PLAIN_SHAPES]


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_matches_reference(isa, threads, fmt):
    rng = rng_for("linear", fmt)
    for T, Rr, C, G in linear_cases(fmt):
        w, _ = make_weight(rng, (Rr, C), fmt, G)
        x = rng.standard_normal((T, C)).astype(F32)
        y = K.linear(x, w, threads=threads)
        assert y.shape == (T, Rr) and y.dtype == F32
        assert_dot_close(y, R.linear_ref(x, w), magnitude(x, w), f"{fmt} T={T} R={Rr} C={C}")
        bias = rng.standard_normal(Rr).astype(F32)
        yb = K.linear(x, w, bias, threads=threads)
        assert_dot_close(yb, R.linear_ref(x, w, bias), magnitude(x, w) + np.abs(bias), "bias")
        y1 = K.linear(x[0], w, threads=threads)                        # one token, 1-D
        assert y1.shape == (Rr,)
        assert_dot_close(y1, y[0], magnitude(x[0], w), "one token")


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_expert_stack_and_out(isa, fmt):
    rng = rng_for("stack", fmt)
    C = 64 if fmt in quant.QUANTIZED else 50
    w, _ = make_weight(rng, (4, 11, C), fmt, 32)
    x = rng.standard_normal((6, C)).astype(F32)
    out = np.full((6, 11), np.nan, dtype=F32)
    for e in range(4):
        y = K.linear(x, w, threads=2, out=out, expert=e)
        assert y is out
        assert_dot_close(out, R.linear_ref(x, w, expert=e), magnitude(x, w, e), f"expert {e}")
        assert np.array_equal(out, K.linear(x, w.expert(e), threads=1))
    with pytest.raises(ValueError, match="expert 4 out of range"):
        K.linear(x, w, expert=4)


def test_linear_argument_errors():
    rng = np.random.default_rng(1)
    w, _ = make_weight(rng, (8, 16), "f32")
    x = rng.standard_normal((3, 16)).astype(F32)
    with pytest.raises(TypeError, match="float32"):
        K.linear(x.astype(np.float64), w)
    with pytest.raises(ValueError, match="16"):
        K.linear(np.ones((3, 15), F32), w)
    with pytest.raises(ValueError, match="out"):
        K.linear(x, w, out=np.empty((3, 7), F32))
    with pytest.raises(ValueError, match="bias"):
        K.linear(x, w, np.ones(7, F32))
    big = np.zeros((8, 16), F32)
    with pytest.raises(ValueError, match="overlap"):                  # out aliasing x
        K.linear(big, WeightRef.from_array(np.eye(16, dtype=F32), "f32"), out=big[:, :16])
    assert K.linear(np.empty((0, 16), F32), w).shape == (0, 8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_bit_identical_across_threads(isa, fmt):
    rng = rng_for("threads", fmt)
    C = 128 if fmt in quant.QUANTIZED else 99
    w, _ = make_weight(rng, (203, C), fmt, 64)
    x = rng.standard_normal((7, C)).astype(F32)
    y1 = K.linear(x, w, threads=1)
    for n in (2, 3):
        assert np.array_equal(K.linear(x, w, threads=n), y1), n


@pytest.fixture
def row_kernel_only():
    """Turn the GEMM path off (every call on the row kernel), restoring GEMM_MIN after."""
    _kernels.set_gemm_min_tokens(1 << 40)
    yield
    _kernels.set_gemm_min_tokens(GEMM_MIN)


@pytest.mark.parametrize("fmt", FORMATS)
def test_token_result_independent_of_batch(isa, fmt, row_kernel_only):
    """On the row kernel (fewer than GEMM_MIN tokens per matrix; here forced for every
    count), a token's output has the same bits alone (decode) and inside a block of tokens,
    at every position of the block: linear and the expert FFN. (From GEMM_MIN tokens on the
    GEMM path takes over: test_gemm_token_result_independent_of_batch.)"""
    rng = rng_for("batch", fmt)
    C = 128 if fmt in quant.QUANTIZED else 99
    w, _ = make_weight(rng, (37, C), fmt, 32)
    x = rng.standard_normal((11, C)).astype(F32)
    block = K.linear(x, w, threads=2)
    for t in range(x.shape[0]):
        assert np.array_equal(K.linear(x[t:t + 1], w, threads=1)[0], block[t]), t
    D, I, G = ffn_dims(fmt)
    wg, wu, wd = make_experts(rng, 4, D, I, (fmt,) * 3, G)
    x = rng.standard_normal((9, D)).astype(F32)
    ids = np.argsort(rng.random((9, 4)), axis=1)[:, :2].astype(np.int32)
    weights = rng.random((9, 2)).astype(F32)
    block = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=2)
    for t in range(x.shape[0]):
        one = K.expert_ffn(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], wg, wu, wd, threads=1)
        assert np.array_equal(one[0], block[t]), t


def test_min_parallel_bytes_changes_nothing_but_speed(isa):
    rng = rng_for("threshold")
    wg, wu, wd = make_experts(rng, 4, 64, 96, ("q4",) * 3, 32)
    x = rng.standard_normal((6, 64)).astype(F32)
    ids = np.argsort(rng.random((6, 4)), axis=1)[:, :2].astype(np.int32)
    weights = rng.random((6, 2)).astype(F32)
    w, _ = make_weight(rng, (50, 64), "q4", 32)
    results = []
    for nbytes in (1, 1 << 12, 1 << 40):
        runtime.set_min_parallel_bytes(nbytes)
        assert runtime.min_parallel_bytes() == nbytes
        results.append((K.linear(x, w, threads=2),
                        K.expert_ffn(x, ids, weights, wg, wu, wd, threads=2)))
    for a, b in results[1:]:
        assert np.array_equal(a, results[0][0]) and np.array_equal(b, results[0][1])
    with pytest.raises(ValueError, match="positive"):
        runtime.set_min_parallel_bytes(0)
    runtime.set_min_parallel_bytes(None)
    assert runtime.min_parallel_bytes() == runtime.MIN_PARALLEL_BYTES.default


@pytest.mark.parametrize("fmt", FORMATS)
def test_isa_paths_agree_with_scalar(fmt):
    """Every SIMD path against the scalar path: same data, within the dot-product bound."""
    rng = rng_for("agree", fmt)
    C = 256 if fmt in quant.QUANTIZED else 173
    w, _ = make_weight(rng, (29, C), fmt, 32)
    x = rng.standard_normal((5, C)).astype(F32)
    previous = runtime.get_isa()
    try:
        runtime.set_isa("scalar")
        ref = K.linear(x, w)
        for name in runtime.available_isas()[1:]:
            runtime.set_isa(name)
            assert_dot_close(K.linear(x, w), ref, magnitude(x, w), f"{name} vs scalar")
    finally:
        runtime.set_isa(previous)


# ---------------------------------------------------------------------------------------------
# the GEMM (prefill) path: from GEMM_MIN tokens per matrix, panels of rows decoded once

GEMM_TOKENS = sorted({GEMM_MIN - 1, GEMM_MIN, GEMM_MIN + 1, 13, 130} - {0})
# (R, C, G): R not a multiple of the panel (24) or micro-panel (3) rows; C not a multiple of
# the 256-column K-chunk; groups 32, 64 and 96 / 160 (a group straddling a chunk boundary);
# plain C with a tail of < 8 columns, and C < 8
GEMM_QUANT_SHAPES = [(53, 320, 32), (29, 544, 32), (53, 320, 64), (7, 288, 96), (26, 320, 160)]
GEMM_PLAIN_SHAPES = [(53, 300, 0), (25, 45, 0), (4, 5, 0), (50, 512, 0)]


def gemm_shapes(fmt):
    return GEMM_QUANT_SHAPES if fmt in quant.QUANTIZED else GEMM_PLAIN_SHAPES


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
    C = 320 if fmt in quant.QUANTIZED else 301
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
    C = 320 if fmt in quant.QUANTIZED else 99
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


# ---------------------------------------------------------------------------------------------
# routing

ROUTE_CASES = [("softmax_topk", False), ("softmax_topk", True), ("topk_softmax", False)]


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("rule,norm", ROUTE_CASES)
def test_route_matches_reference(rule, norm, threads):
    rng = rng_for("route", rule, norm)
    for T, E, k in [(1, 8, 2), (37, 8, 1), (37, 8, 8), (19, 60, 4), (5, 3, 2)]:
        logits = (rng.standard_normal((T, E)) * 3).astype(F32)
        for seed in (None, 1234):
            ids, w = K.route_topk(logits, k, rule=rule, norm_topk_prob=norm, noise_seed=seed,
                                  threads=threads)
            rids, rw = R.route_topk_ref(logits, k, rule=rule, norm_topk_prob=norm,
                                        noise_seed=seed)
            assert ids.dtype == np.int32 and w.dtype == F32 and ids.shape == (T, k)
            assert np.array_equal(ids, rids), (T, E, k, seed)
            np.testing.assert_allclose(w, rw, rtol=1e-5, atol=1e-7)
            assert (np.diff(w, axis=1) <= 0).all()                   # listed by weight
            for row in ids:
                assert len(set(row.tolist())) == k                   # k distinct experts
            if norm or rule == "topk_softmax":
                np.testing.assert_allclose(w.sum(1), 1.0, rtol=1e-5)


def test_route_softmax_weights_are_the_full_softmax():
    logits = np.array([[2.0, -1.0, 0.5, 3.0, 0.0]], F32)
    p = np.exp(logits[0].astype(np.float64) - 3.0)
    p /= p.sum()
    ids, w = K.route_topk(logits, 2)
    assert ids.tolist() == [[3, 0]]
    np.testing.assert_allclose(w[0], p[[3, 0]], rtol=1e-6)
    ids, w = K.route_topk(logits, 2, norm_topk_prob=True)
    np.testing.assert_allclose(w[0], p[[3, 0]] / p[[3, 0]].sum(), rtol=1e-6)
    ids, w = K.route_topk(logits, 2, rule="topk_softmax")
    e = np.exp([0.0, -1.0])
    np.testing.assert_allclose(w[0], e / e.sum(), rtol=1e-6)


@pytest.mark.parametrize("rule,norm", ROUTE_CASES)
def test_route_ties_go_to_lower_index(rule, norm):
    logits = np.array([[1.0, 1.0, 1.0, 1.0],
                       [1.0, 3.0, 3.0, 2.0],
                       [0.0, 3.0, 2.0, 3.0],
                       [5.0, 5.0, -1.0, 5.0]], F32)
    ids, w = K.route_topk(logits, 2, rule=rule, norm_topk_prob=norm)
    assert ids.tolist() == [[0, 1], [1, 2], [1, 3], [0, 1]]
    assert (w[:, 0] == w[:, 1]).all()
    ids3, _ = K.route_topk(logits, 3, rule=rule, norm_topk_prob=norm)
    assert ids3.tolist() == [[0, 1, 2], [1, 2, 3], [1, 3, 2], [0, 1, 3]]


@pytest.mark.parametrize("rule,norm", ROUTE_CASES)
def test_route_infinite_and_huge_logits(rule, norm):
    inf, big = np.inf, 3e38
    logits = np.array([[-inf, -inf, -inf, -inf],
                       [0.0, -inf, 1.0, -inf],
                       [inf, 0.0, inf, -inf],
                       [big, -big, 1.0, big],
                       [-big, -big, -1e30, -2e30],
                       [88.0, -100.0, 87.0, -103.0]], F32)
    for seed in (None, 7):
        ids, w = K.route_topk(logits, 2, rule=rule, norm_topk_prob=norm, noise_seed=seed)
        assert np.isfinite(w).all() and (w >= 0).all() and (w.sum(1) <= 1 + 1e-6).all()
        rids, rw = R.route_topk_ref(logits, 2, rule=rule, norm_topk_prob=norm, noise_seed=seed)
        assert np.array_equal(ids, rids)
        np.testing.assert_allclose(w, rw, rtol=1e-5, atol=1e-7)
    ids, w = K.route_topk(logits, 2, rule=rule, norm_topk_prob=norm)
    assert ids[0].tolist() == [0, 1] and w[0, 0] == w[0, 1] > 0      # all -inf: uniform
    assert ids[1].tolist() == [2, 0]
    assert ids[2].tolist() == [0, 2] and w[2, 0] == w[2, 1] > 0      # +inf share the mass
    assert ids[3].tolist() == [0, 3]


def test_route_argument_errors():
    logits = np.zeros((2, 4), F32)
    for k in (0, 5):
        with pytest.raises(ValueError, match="k"):
            K.route_topk(logits, k)
    with pytest.raises(ValueError, match="rule"):
        K.route_topk(logits, 1, rule="sigmoid")
    bad = logits.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        K.route_topk(bad, 1)
    with pytest.raises(TypeError):
        K.route_topk(logits.astype(np.float64), 1)


def test_route_gumbel_noise():
    rng = np.random.default_rng(5)
    T, E = 4000, 4
    logits = np.zeros((T, E), F32)
    a1, w1 = K.route_topk(logits, 1, noise_seed=42, threads=1)
    a2, w2 = K.route_topk(logits, 1, noise_seed=42, threads=2)
    assert np.array_equal(a1, a2) and np.array_equal(w1, w2)          # reproducible, any threads
    assert np.array_equal(a1, R.route_topk_ref(logits, 1, noise_seed=42)[0])
    assert not np.array_equal(a1, K.route_topk(logits, 1, noise_seed=43)[0])
    counts = np.bincount(a1[:, 0], minlength=E) / T                    # equal logits: uniform
    assert np.abs(counts - 0.25).max() < 0.04, counts
    assert (w1 == 0.25).all()                                          # weights: un-noised
    # Gumbel-max samples the softmax: p = (0.25, 0.75) -> expert 1 three times in four
    two = np.tile(np.array([[0.0, np.log(3.0)]], F32), (T, 1))
    picks, w = K.route_topk(two, 1, noise_seed=int(rng.integers(1 << 62)))
    assert abs((picks[:, 0] == 1).mean() - 0.75) < 0.03
    # per-token noise differs between tokens of the same call
    g = R.gumbel_ref(42, 3, E)
    assert not np.array_equal(g[0], g[1])


# ---------------------------------------------------------------------------------------------
# dispatch


def test_group_by_expert():
    rng = np.random.default_rng(3)
    for T, Kk, E in [(1, 1, 1), (1, 2, 8), (50, 2, 8), (33, 3, 40), (10, 2, 3)]:
        ids = rng.integers(0, E, size=(T, Kk)).astype(np.int32)
        off, slots = K.group_by_expert(ids, E)
        roff, rslots = R.group_by_expert_ref(ids, E)
        assert off.dtype == np.int64 and slots.dtype == np.int32
        assert np.array_equal(off, roff) and np.array_equal(slots, rslots)
        for e in range(E):
            s = slots[off[e]:off[e + 1]]
            assert (ids.reshape(-1)[s] == e).all() and (np.diff(s) > 0).all()
    with pytest.raises(ValueError, match="0..3"):
        K.group_by_expert(np.array([[0, 4]]), 4)
    with pytest.raises(ValueError):
        K.group_by_expert(np.array([[-1, 0]]), 4)


# ---------------------------------------------------------------------------------------------
# expert FFN


def ffn_dims(fmt):
    """(D, I, group): odd sizes where the format allows, group-size multiples otherwise."""
    return (64, 96, 32) if fmt in quant.QUANTIZED else (45, 67, 0)


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
        w.buf[start:start + (w.rows - 1) * w.row_stride + quant.row_stride(
            w.dtype, w.cols, w.group_size)] = 0xFF


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_ffn_matches_reference(isa, threads, fmt):
    rng = rng_for("ffn", fmt)
    D, I, G = ffn_dims(fmt)
    E = 5
    wg, wu, wd = make_experts(rng, E, D, I, (fmt,) * 3, G)
    poison_expert(wg, wu, wd, 3)                    # expert 3 is never chosen below
    choices = np.array([0, 1, 2, 4])
    for T, Kk in [(1, 1), (1, 2), (7, 2), (33, 3)]:
        x = rng.standard_normal((T, D)).astype(F32)
        ids = np.stack([rng.choice(choices, size=Kk, replace=False) for _ in range(T)])
        ids = ids.astype(np.int32)
        weights = rng.random((T, Kk)).astype(F32)
        y = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=threads)
        assert y.shape == (T, D) and y.dtype == F32 and np.isfinite(y).all()
        assert_ffn_close(y, R.expert_ffn_ref(x, ids, weights, wg, wu, wd), f"T={T} K={Kk}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_ffn_all_tokens_on_one_expert(isa, fmt):
    rng = rng_for("one", fmt)
    D, I, G = ffn_dims(fmt)
    wg, wu, wd = make_experts(rng, 4, D, I, (fmt,) * 3, G)
    poison_expert(wg, wu, wd, 3)
    T = 21
    x = rng.standard_normal((T, D)).astype(F32)
    ids = np.full((T, 1), 1, np.int32)
    weights = np.ones((T, 1), F32)
    y = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=2)
    assert_ffn_close(y, R.expert_ffn_ref(x, ids, weights, wg, wu, wd))
    # and equals the dense FFN of that expert
    assert_ffn_close(y, K.swiglu(x, wg.expert(1), wu.expert(1), wd.expert(1)))
    # every token on the same pair, and a token listing one expert twice
    ids2 = np.tile(np.array([[2, 0]], np.int32), (T, 1))
    ids2[5] = [2, 2]
    w2 = rng.random((T, 2)).astype(F32)
    y2 = K.expert_ffn(x, ids2, w2, wg, wu, wd, threads=2)
    assert_ffn_close(y2, R.expert_ffn_ref(x, ids2, w2, wg, wu, wd))


@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_ffn_bit_identical_across_threads(isa, fmt):
    rng = rng_for("ffn-threads", fmt)
    D, I, G = ffn_dims(fmt)
    wg, wu, wd = make_experts(rng, 6, D, I, (fmt,) * 3, G)
    T = 40
    x = rng.standard_normal((T, D)).astype(F32)
    ids = np.argsort(rng.random((T, 6)), axis=1)[:, :2].astype(np.int32)
    weights = rng.random((T, 2)).astype(F32)
    y1 = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=1)
    for n in (2, 3):
        assert np.array_equal(K.expert_ffn(x, ids, weights, wg, wu, wd, threads=n), y1)
    xc = x.copy()                                   # out may be x itself
    K.expert_ffn(xc, ids, weights, wg, wu, wd, threads=2, out=xc)
    assert np.array_equal(xc, y1)


def test_expert_ffn_mixed_formats(isa):
    rng = np.random.default_rng(11)
    D, I = 64, 128
    wg, wu, wd = make_experts(rng, 3, D, I, ("q4", "q8", "bf16"), 64)
    x = rng.standard_normal((9, D)).astype(F32)
    ids = rng.integers(0, 3, size=(9, 2)).astype(np.int32)
    weights = rng.random((9, 2)).astype(F32)
    y = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=2)
    assert_ffn_close(y, R.expert_ffn_ref(x, ids, weights, wg, wu, wd))


def test_expert_ffn_argument_errors():
    rng = np.random.default_rng(2)
    wg, wu, wd = make_experts(rng, 3, 32, 64, ("f32",) * 3, 0)
    x = np.ones((2, 32), F32)
    w = np.ones((2, 2), F32)
    with pytest.raises(ValueError, match="0..2"):
        K.expert_ffn(x, np.array([[0, 3], [1, 2]]), w, wg, wu, wd)
    with pytest.raises(ValueError, match="weights"):
        K.expert_ffn(x, np.array([[0, 1], [1, 2]]), np.ones((2, 3), F32), wg, wu, wd)
    with pytest.raises(ValueError, match="disagree"):
        K.expert_ffn(x, np.array([[0, 1], [1, 2]]), w, wg, wu, wg)
    with pytest.raises(ValueError, match="columns"):
        K.expert_ffn(np.ones((2, 31), F32), np.array([[0, 1], [1, 2]]), w, wg, wu, wd)
    y = K.expert_ffn(np.empty((0, 32), F32), np.empty((0, 2), np.int32), np.empty((0, 2), F32),
                     wg, wu, wd)
    assert y.shape == (0, 32)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_swiglu_matches_reference(isa, threads, fmt):
    rng = rng_for("swiglu", fmt)
    D, I, G = ffn_dims(fmt)
    wg, wu, wd = (w.expert(0) for w in make_experts(rng, 1, D, I, (fmt,) * 3, G))
    for T in (1, 6):
        x = rng.standard_normal((T, D)).astype(F32)
        y = K.swiglu(x, wg, wu, wd, threads=threads)
        assert_ffn_close(y, R.swiglu_ref(x, wg, wu, wd), f"T={T}")
    stack = make_experts(rng, 2, D, I, (fmt,) * 3, G)
    with pytest.raises(ValueError, match="n_experts"):
        K.swiglu(x, *stack)


# ---------------------------------------------------------------------------------------------
# read-only inputs, including a real read-only mapping of a file


def test_read_only_arrays(isa):
    rng = np.random.default_rng(8)
    wg, wu, wd = make_experts(rng, 4, 64, 96, ("q4",) * 3, 32)
    for w in (wg, wu, wd):
        w.buf.setflags(write=False)
    x = rng.standard_normal((5, 64)).astype(F32)
    logits = rng.standard_normal((5, 4)).astype(F32)
    for a in (x, logits):
        a.setflags(write=False)
    ids, weights = K.route_topk(logits, 2, norm_topk_prob=True)
    ids.setflags(write=False)
    weights.setflags(write=False)
    K.group_by_expert(ids, 4)
    y = K.expert_ffn(x, ids, weights, wg, wu, wd, threads=2)
    assert_ffn_close(y, R.expert_ffn_ref(x, ids, weights, wg, wu, wd))
    assert_dot_close(K.linear(x, wg, expert=1), R.linear_ref(x, wg, expert=1),
                     magnitude(x, wg, 1))
    K.swiglu(x, wg.expert(0), wu.expert(0), wd.expert(0))
    K.dequantize(wd, 3)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q4"])
def test_read_only_mmap_with_file_layout(tmp_path, isa, fmt):
    """Experts at a page-aligned stride after an odd offset, as in a .colibri file, read
    straight from a read-only mapping (unaligned element loads included)."""
    rng = rng_for("mmap", fmt)
    E, D, I, G = 4, 64, 96, 32
    page, head = 4096, 101                  # odd: unaligned elements
    mats = {n: (rng.standard_normal(s) * 0.3).astype(F32)
            for n, s in (("gate", (E, I, D)), ("up", (E, I, D)), ("down", (E, D, I)))}
    g = G if fmt in quant.QUANTIZED else 0
    sizes = {n: quant.tensor_nbytes(fmt, m.shape[1:], g) for n, m in mats.items()}
    stride = -(-sum(sizes.values()) // page) * page
    blob = bytearray(head + E * stride)
    blob[:head] = rng.integers(0, 256, head, dtype=np.uint8).tobytes()
    offsets = {"gate": head, "up": head + sizes["gate"],
               "down": head + sizes["gate"] + sizes["up"]}
    for n, m in mats.items():
        for e in range(E):
            enc = quant.encode(m[e], fmt, g).tobytes()
            start = offsets[n] + e * stride
            blob[start:start + len(enc)] = enc
    path = tmp_path / "experts.bin"
    path.write_bytes(bytes(blob))
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        buf = np.frombuffer(mm, dtype=np.uint8)
        assert not buf.flags.writeable
        ws = {n: WeightRef(buf, offsets[n], fmt, m.shape[1], m.shape[2], g,
                           n_experts=E, expert_stride=stride) for n, m in mats.items()}
        x = rng.standard_normal((6, D)).astype(F32)
        ids = np.array([[0, 2]] * 3 + [[2, 3]] * 3, np.int32)
        weights = rng.random((6, 2)).astype(F32)
        y = K.expert_ffn(x, ids, weights, ws["gate"], ws["up"], ws["down"], threads=2)
        assert_ffn_close(y, R.expert_ffn_ref(x, ids, weights, ws["gate"], ws["up"], ws["down"]))
        for e in range(E):
            assert np.array_equal(K.dequantize(ws["down"], e),
                                  quant.decode(quant.encode(mats["down"][e], fmt, g), fmt,
                                               (D, I), g))
        del buf, ws
    finally:
        try:
            mm.close()
        except BufferError:                  # a failed assertion still holds a view
            pass


def _pages_present(addr: int, nbytes: int) -> np.ndarray | None:
    """Per page of [addr, addr + nbytes): is it mapped in this process (Linux pagemap)?"""
    page = mmap.PAGESIZE
    first, last = addr // page, (addr + nbytes - 1) // page
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            raw = f.read((last - first + 1) * 8)
    except OSError:
        return None
    if len(raw) != (last - first + 1) * 8:
        return None
    return (np.frombuffer(raw, dtype="<u8") >> np.uint64(63)).astype(bool)


@pytest.mark.parametrize("activations", K.ACTIVATIONS)
def test_unchosen_expert_pages_are_never_touched(tmp_path, isa, activations):
    """Not activated = not touched: after expert_ffn over a read-only mapping, no page of an
    expert that no token chose is mapped into the process, while the chosen ones are."""
    rng = np.random.default_rng(12)
    E, D, I, G = 4, 64, 96, 32
    # Far beyond the kernel's fault-around window and its large page-cache folios (a fault
    # may map a whole 2 MB folio of the file).
    stride = 4 << 20
    ws, blob = {}, bytearray(E * stride)
    sizes = {"gate": (I, D), "up": (I, D), "down": (D, I)}
    offset = 0
    for name, shape in sizes.items():
        for e in range(E):
            enc = quant.encode((rng.standard_normal(shape) * 0.3).astype(F32), "q4", G)
            blob[e * stride + offset:e * stride + offset + enc.size] = enc.tobytes()
        ws[name] = offset
        offset += quant.tensor_nbytes("q4", shape, G)
    path = tmp_path / "sparse.bin"
    path.write_bytes(bytes(blob))
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        buf = np.frombuffer(mm, dtype=np.uint8)
        addr = buf.__array_interface__["data"][0]
        before = _pages_present(addr, buf.size)
        if before is None or before.any():
            pytest.skip("no usable /proc/self/pagemap on this system")
        refs = [WeightRef(buf, ws[n], "q4", *sizes[n], G, n_experts=E, expert_stride=stride)
                for n in ("gate", "up", "down")]
        x = rng.standard_normal((5, D)).astype(F32)
        ids = np.array([[0, 2]] * 5, np.int32)
        y = K.expert_ffn(x, ids, rng.random((5, 2)).astype(F32), *refs, threads=2,
                         activations=activations)
        assert np.isfinite(y).all()
        for e, chosen in ((0, True), (1, False), (2, True), (3, False)):
            present = _pages_present(addr + e * stride, offset)
            assert present.any() == chosen, (e, present)
        del buf, refs
    finally:
        try:
            mm.close()
        except BufferError:
            pass


# ---------------------------------------------------------------------------------------------
# bad weight references: ValueError, never a read outside the buffer


def test_bad_weight_refs_raise():
    buf = quant.encode(np.ones((4, 64), F32), "q4", 32)               # 4 rows of 36 bytes
    ok = dict(buf=buf, offset=0, dtype="q4", rows=4, cols=64, group_size=32)
    WeightRef(**ok)
    bad = [
        (dict(offset=1), "past the end"),
        (dict(offset=-1), "negative"),
        (dict(rows=5), "past the end"),
        (dict(offset=10**20), "past the end"),
        (dict(dtype="q5"), "dtype"),
        (dict(dtype="i32"), "dtype"),
        (dict(group_size=48), "group_size"),
        (dict(group_size=0), "group_size"),
        (dict(row_stride=35), "row_stride"),
        (dict(n_experts=2, expert_stride=144), "past the end"),
        (dict(n_experts=2, expert_stride=8, rows=1), "expert_stride"),
        (dict(buf=buf.view(np.float32)), "uint8"),
        (dict(buf=np.zeros((2, 72), np.uint8)), "1-D"),
        (dict(buf=np.zeros(300, np.uint8)[::2]), "contiguous"),
        (dict(rows=0), "rows"),
        (dict(cols=2.0), "cols"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            WeightRef(**{**ok, **change})


def test_kernels_recheck_bounds_at_call_time():
    """A WeightRef altered after construction, or any object with the fields, is checked
    again by the compiled kernels before they touch memory."""
    rng = np.random.default_rng(4)
    w, _ = make_weight(rng, (3, 8, 64), "q4", 32)
    x = np.ones((2, 64), F32)
    broken = WeightRef(w.buf, w.offset, w.dtype, w.rows, w.cols, w.group_size,
                       n_experts=3, expert_stride=w.expert_stride)
    object.__setattr__(broken, "n_experts", 4)                         # bypasses validation
    with pytest.raises(ValueError, match="past the end"):
        K.linear(x, broken, expert=3)
    fake = types.SimpleNamespace(**{f: getattr(w, f) for f in (
        "buf", "offset", "dtype", "rows", "cols", "group_size", "row_stride", "n_experts",
        "expert_stride")})
    fake.offset = w.buf.size - 10
    with pytest.raises(ValueError, match="past the end"):
        K.linear(x, fake)
    with pytest.raises(ValueError, match="past the end"):
        K.expert_ffn(x, np.zeros((2, 1), np.int32), np.ones((2, 1), F32), w, w, fake)
    with pytest.raises(ValueError, match="past the end"):
        K.dequantize(fake)
    fake.offset, fake.buf = 0, w.buf.astype(np.int16)
    with pytest.raises(ValueError, match="uint8"):
        _kernels.weight_span(fake)


# ---------------------------------------------------------------------------------------------
# memory read kernel


def test_read_sum_and_bandwidth(isa):
    rng = np.random.default_rng(9)
    for n in (1, 7, 4096 + 13, 3 * 65536 + 5):
        buf = rng.integers(0, 256, n, dtype=np.uint8)
        words = n // 8 * 8
        expect = int(buf[:words].view("<u8").sum(dtype=np.uint64)) + int(buf[words:].sum())
        expect %= 1 << 64
        for threads in (1, 2):
            assert _kernels.read_sum(buf, threads) == expect, (n, threads)
    assert K.read_bandwidth(1 << 20, 2, repeats=2) > 0


# ---------------------------------------------------------------------------------------------
# quantized activations (activations="int8": W4A8 / W8A8; "int16": 16-bit codes)
#
# Tolerances. The integer part (isum per 32-block) is exact in the kernels and the
# references; only the float part sum_b (s_b d_b) isum_b differs: float32 over C/32 terms
# (the AVX2 body in 8 lanes, then a horizontal sum) against float64. That error is below
# (C/32 + 4) * eps32 * sum_b |s_b d_b isum_b| < 1e-5 * that sum for C <= 1024: the bound
# asserted (iact_magnitude). A wrong nibble order, packing or scale is of the order of the
# sum itself. (For int16 the float conversion of a q8 block sum above 2^24 rounds: 6e-8
# relative, inside the same bound.)

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
        assert y1.shape == (Rr,) and np.array_equal(y1, y[0])


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
def test_iact_bit_identical_across_threads_and_token_blocks(isa, fmt, act):
    """Same bits for 1, 2, 3 threads, and for a token alone or at any place in a block of
    tokens: linear (group 32 and 128), the expert FFN and swiglu."""
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


def test_gemm_min_tokens_public_setting():
    """runtime.set_gemm_min_tokens switches the prefill path: above the threshold a token's
    result equals its decode (row kernel) bits; None restores the default; bad values fail."""
    rng = np.random.default_rng(5)
    w = WeightRef.from_array(rng.standard_normal((40, 96)).astype(np.float32), "q4", 32)
    x = rng.standard_normal((8, 96)).astype(np.float32)
    alone = np.concatenate([K.linear(x[i:i + 1], w, threads=1) for i in range(8)])
    try:
        runtime.set_gemm_min_tokens(1 << 40)
        assert runtime.gemm_min_tokens() == 1 << 40
        np.testing.assert_array_equal(K.linear(x, w, threads=1), alone)
    finally:
        runtime.set_gemm_min_tokens(None)
    assert runtime.gemm_min_tokens() == runtime.GEMM_MIN_TOKENS.default == GEMM_MIN
    np.testing.assert_allclose(K.linear(x, w, threads=1), alone, rtol=1e-5, atol=1e-5)
    for bad in (0, -3, 2.5, True, "4"):
        with pytest.raises(ValueError, match="gemm_min_tokens must be a positive int"):
            runtime.set_gemm_min_tokens(bad)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8])
@pytest.mark.parametrize("bad, where", [(8, (1, 0)), (-1, (0, 1))])
def test_expert_ffn_rejects_out_of_range_ids(dtype, bad, where):
    """An id outside 0..E-1 is a ValueError before any weight is read, whatever its dtype
    (int32 ids, what route_topk returns, are checked once, in the compiled kernel)."""
    if bad < 0 and np.dtype(dtype).kind == "u":
        pytest.skip("unsigned ids cannot be negative")
    rng = np.random.default_rng(9)
    E, D, I = 8, 64, 32
    ws = [WeightRef.from_array(rng.standard_normal(s).astype(np.float32), "q4", 32)
          for s in ((E, I, D), (E, I, D), (E, D, I))]
    x = rng.standard_normal((2, D)).astype(np.float32)
    ids = np.array([[0, 1], [2, 3]], dtype=dtype)
    ids[where] = bad
    w = np.full((2, 2), 0.5, np.float32)
    with pytest.raises(ValueError, match=f"{bad}"):
        K.expert_ffn(x, ids, w, *ws, threads=1)
    with pytest.raises(ValueError, match=f"{bad}"):
        K.group_by_expert(ids, E)


# ---------------------------------------------------------------------------------------------
# decode attention (attend_decode)

ATTEND_SHAPES = [(16, 4, 64, 100), (4, 4, 24, 1), (6, 2, 8, 13), (8, 1, 128, 37), (2, 2, 5, 7),
                 (4, 2, 40, 9), (4, 2, 64, 8), (4, 2, 64, 16)]


def _attend_inputs(rng, H, Hkv, Dh, n, spread=2.0):
    """q (H, Dh); k, v strided slices (Hkv, n, Dh) of a larger cache, as the model passes."""
    q = rng.standard_normal((H, Dh)).astype(F32)
    k = (rng.standard_normal((Hkv, n + 10, Dh)) * spread).astype(F32)[:, 3:3 + n]
    v = rng.standard_normal((Hkv, n + 10, Dh)).astype(F32)[:, 3:3 + n]
    return q, k, v


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", ATTEND_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attend_decode_matches_reference(isa, threads, shape):
    H, Hkv, Dh, n = shape
    q, k, v = _attend_inputs(rng_for("attend", shape), H, Hkv, Dh, n)
    y = K.attend_decode(q, k, v, Dh ** -0.5, threads=threads)
    ref = R.attend_decode_ref(q, k, v, Dh ** -0.5)
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    assert np.array_equal(K.attend_decode(q, k, v, Dh ** -0.5, threads=3), y)   # any count


@pytest.mark.parametrize("shape", ATTEND_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attend_decode_isa_paths_agree_with_scalar(shape):
    H, Hkv, Dh, n = shape
    q, k, v = _attend_inputs(rng_for("attend-isa", shape), H, Hkv, Dh, n, spread=6.0)
    previous = runtime.get_isa()
    try:
        runtime.set_isa("scalar")
        want = K.attend_decode(q, k, v, 0.3)
        for name in runtime.available_isas():
            runtime.set_isa(name)
            got = K.attend_decode(q, k, v, 0.3)
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max(),
                                       err_msg=name)
    finally:
        runtime.set_isa(previous)


def test_attend_decode_extremes(isa):
    """A dominant score takes all the weight (exp underflows to 0 elsewhere, no NaN); a NaN
    or inf in q or k makes that head NaN and leaves the others alone; out= is filled."""
    rng = rng_for("attend-extremes")
    q, k, v = _attend_inputs(rng, 4, 2, 16, 11)
    k = np.ascontiguousarray(k)
    k[0, 5] = q[0] * 100                          # head 0 (kv head 0): position 5 dominates
    y = K.attend_decode(q, k, v, 1.0)
    np.testing.assert_allclose(y[0], v[0, 5], rtol=1e-6, atol=1e-6)
    assert np.isfinite(y).all()
    q[3, 2] = np.nan
    out = np.full((4, 16), 7.0, F32)
    K.attend_decode(q, k, v, 1.0, out=out)
    assert np.isnan(out[3]).all() and np.isfinite(out[:3]).all()
    np.testing.assert_array_equal(out[:3], y[:3])


def test_attend_decode_argument_errors():
    q, k, v = _attend_inputs(rng_for("attend-errors"), 4, 2, 16, 5)
    with pytest.raises(ValueError, match="multiple"):
        K.attend_decode(q[:3], k, v, 1.0)
    with pytest.raises(ValueError, match="must both be"):
        K.attend_decode(q, k, v[:, :4], 1.0)
    with pytest.raises(ValueError, match="n = 0"):
        K.attend_decode(q, k[:, :0], v[:, :0], 1.0)
    with pytest.raises(ValueError, match="out"):
        K.attend_decode(q, k, v, 1.0, out=np.empty((4, 15), F32))
    with pytest.raises(ValueError, match="overlap"):
        K.attend_decode(q, k, v, 1.0, out=q)
    with pytest.raises(ValueError, match="float32"):
        K.attend_decode(q, k.astype(np.float64), v, 1.0)
    # non-contiguous rows are copied, not misread
    kt = np.ascontiguousarray(np.swapaxes(np.ascontiguousarray(k), 1, 2))
    kf = np.swapaxes(kt, 1, 2)                    # (Hkv, n, Dh) with strided rows
    np.testing.assert_array_equal(K.attend_decode(q, kf, np.ascontiguousarray(v), 1.0),
                                  K.attend_decode(q, np.ascontiguousarray(k),
                                                  np.ascontiguousarray(v), 1.0))


# ---------------------------------------------------------------------------------------------
# the decode step's row operations and the prepared kernel calls

ROW_SHAPES = [(1, 1), (1, 7), (1, 8), (3, 64), (1, 129), (1, 1024), (2, 2048), (1, 5000)]


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_rows_matches_reference_and_numpy(shape):
    """Within float32 rounding of the float64 twin, and the same bits as the NumPy code of
    the general path (attention.rms_norm: the same operations, summed in NumPy's order)."""
    from colibri.attention import rms_norm
    rng = rng_for("rms-rows", shape)
    for scale in (1.0, 1e3, 1e-3):
        x = (rng.standard_normal(shape) * scale).astype(F32)
        w = rng.standard_normal(shape[1]).astype(F32)
        y = K.rms_norm_rows(x, w, 1e-5)
        np.testing.assert_allclose(y, R.rms_norm_rows_ref(x, w, 1e-5), rtol=2e-6,
                                   atol=1e-6 * np.abs(w).max())
        np.testing.assert_array_equal(y, rms_norm(x, w, 1e-5))
        np.testing.assert_array_equal(K.rms_norm_rows(x[0], w, 1e-5), y[0])    # 1-D x
        K.rms_norm_rows(x, w, 1e-5, out=x)                                     # in place
        np.testing.assert_array_equal(x, y)


def test_rope_rows_matches_reference_and_apply_rope():
    from colibri.attention import apply_rope
    rng = rng_for("rope-rows")
    for N, Dh, h in [(20, 64, 32), (5, 128, 16), (3, 10, 4), (1, 2, 1)]:
        x = (rng.standard_normal((N, Dh)) * 3).astype(F32)
        ang = rng.uniform(0, 100, h).astype(F32)
        c, s = np.cos(ang), np.sin(ang)
        want = R.rope_rows_ref(x, c, s)
        numpy_ops = apply_rope(x[None, :, None], c, s)[0, :, 0]
        y = x.copy()
        assert K.rope_rows(y, c, s) is y
        np.testing.assert_allclose(y, want, rtol=0, atol=2e-6 * np.abs(want).max())
        np.testing.assert_array_equal(y, numpy_ops)
        np.testing.assert_array_equal(y[:, 2 * h:], x[:, 2 * h:])      # past R: unchanged


def test_row_ops_argument_errors():
    x, w = np.ones((2, 8), F32), np.ones(8, F32)
    with pytest.raises(ValueError, match="float32"):
        K.rms_norm_rows(x.astype(np.float64), w, 1e-5)
    with pytest.raises(ValueError, match="not contiguous"):
        K.rms_norm_rows(np.ones((8, 2), F32).T, w, 1e-5)
    with pytest.raises(ValueError, match="weight has 7 elements, expected 8"):
        K.rms_norm_rows(x, w[:7], 1e-5)
    with pytest.raises(ValueError, match="out has shape"):
        K.rms_norm_rows(x, w, 1e-5, out=np.empty((2, 9), F32))
    buf = np.ones(9, F32)
    with pytest.raises(ValueError, match="overlaps"):
        K.rms_norm_rows_into(buf[:8].reshape(2, 4), w[:4], 1e-5, buf[1:].reshape(2, 4))
    with pytest.raises(ValueError, match="writable"):
        ro = np.ones((2, 8), F32)
        ro.flags.writeable = False
        K.rope_rows(ro, np.ones(4, F32), np.ones(4, F32))
    with pytest.raises(ValueError, match="2h <= 8"):
        K.rope_rows(x.copy(), np.ones(5, F32), np.ones(5, F32))
    with pytest.raises(ValueError, match="same length"):
        K.rope_rows(x.copy(), np.ones(4, F32), np.ones(3, F32))
    with pytest.raises(ValueError):                       # the compiled form checks types too
        K.rms_norm_rows_into(x.astype(np.float64), w, 1e-5, x)


@pytest.mark.parametrize("activations", ["f32", "int8"])
@pytest.mark.parametrize("fmt", ["f32", "q8", "q4"])
def test_prepared_calls_equal_the_kernels(isa, fmt, activations):
    """prepare_linear / prepare_route / prepare_expert_ffn give the bits of linear /
    route_topk / expert_ffn, also after the ISA changes under them."""
    rng = rng_for("prepared", fmt, activations)
    D, I, G = ffn_dims(fmt)
    wg, wu, wd = make_experts(rng, 6, D, I, (fmt,) * 3, G)
    router, _ = make_weight(rng, (6, D), "f32")
    bias = rng.standard_normal(I).astype(F32)
    lin = K.prepare_linear(wg.expert(1), bias, threads=2, activations=activations)
    route = K.prepare_route(2, rule="softmax_topk", norm_topk_prob=True, threads=2)
    ffn = K.prepare_expert_ffn(wg, wu, wd, threads=2, activations=activations)
    for name in runtime.available_isas():
        runtime.set_isa(name)
        for T in (1, 3, 9):
            x = rng.standard_normal((T, D)).astype(F32)
            y = np.empty((T, I), F32)
            lin(x, y)
            np.testing.assert_array_equal(y, K.linear(x, wg.expert(1), bias, threads=2,
                                                      activations=activations))
            logits = K.linear(x, router)
            ids, wts = route(logits)
            want_ids, want_w = K.route_topk(logits, 2, norm_topk_prob=True)
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_array_equal(wts, want_w)
            out = np.empty((T, D), F32)
            ffn(x, ids, wts, out)
            np.testing.assert_array_equal(out, K.expert_ffn(x, ids, wts, wg, wu, wd, threads=2,
                                                            activations=activations))


def test_prepared_calls_argument_errors():
    rng = rng_for("prepared-errors")
    wg, wu, wd = make_experts(rng, 4, 64, 32, ("f32",) * 3, 32)
    with pytest.raises(ValueError, match="WeightRef"):
        K.prepare_linear(np.ones((4, 4), F32))
    with pytest.raises(ValueError, match="bias has 3 elements"):
        K.prepare_linear(wg.expert(0), np.ones(3, F32))
    with pytest.raises(ValueError, match="activations"):
        K.prepare_linear(wg.expert(0), activations="int4")
    with pytest.raises(ValueError, match="threads"):
        K.prepare_linear(wg.expert(0), threads=0)
    lin = K.prepare_linear(wg.expert(0))
    with pytest.raises(ValueError, match="x has 63 columns"):
        lin(np.ones((1, 63), F32), np.empty((1, 32), F32))
    with pytest.raises(ValueError, match="out has shape"):
        lin(np.ones((1, 64), F32), np.empty((2, 32), F32))
    with pytest.raises(ValueError):                        # a dtype the kernel cannot read
        lin(np.ones((1, 64)), np.empty((1, 32), F32))
    with pytest.raises(ValueError, match="routing rule"):
        K.prepare_route(2, rule="sigmoid")
    route = K.prepare_route(3)
    with pytest.raises(ValueError, match="k = 3"):
        route(np.ones((1, 2), F32))
    with pytest.raises(ValueError, match="NaN"):
        route(np.array([[0.0, 1.0, 2.0, np.nan]], F32))
    ffn = K.prepare_expert_ffn(wg, wu, wd)
    x, w2 = np.ones((2, 64), F32), np.ones((2, 2), F32)
    with pytest.raises(ValueError, match="expert id 4 at"):
        ffn(x, np.array([[0, 1], [4, 2]], np.int32), w2, np.empty((2, 64), F32))
    with pytest.raises(ValueError, match="expert id -1"):
        ffn(x, np.array([[0, -1], [3, 2]], np.int32), w2, np.empty((2, 64), F32))
    with pytest.raises(ValueError, match="weights has shape"):
        ffn(x, np.zeros((2, 2), np.int32), np.ones((2, 3), F32), np.empty((2, 64), F32))
    with pytest.raises(ValueError, match="FFN weights disagree"):
        K.prepare_expert_ffn(wg, wu, wg)


@pytest.mark.parametrize("threads", THREADS)
def test_attend_cached_equals_write_then_attend(isa, threads):
    """The cache write and the attention in one call: the same cache contents and the same
    bits as KVCache.write_one followed by attend_decode, for a whole cache and a window."""
    from colibri.kv_cache import KVCache
    rng = rng_for("attend-cached", threads)
    H, Hkv, Dh, S = 8, 2, 16, 12
    for n_before, start in [(0, 0), (5, 0), (9, 4), (11, 11)]:
        caches = [KVCache(2, 1, Hkv, S, Dh) for _ in range(2)]
        old = rng.standard_normal((2, 1, Hkv, S, Dh)).astype(F32)
        for c in caches:
            c.k[1][...], c.v[1][...] = old
            c.length = n_before
        q = rng.standard_normal((H, Dh)).astype(F32)
        kn, vn = rng.standard_normal((2, Hkv, Dh)).astype(F32)
        k, v = caches[0].write_one(1, kn, vn, start)
        want = K.attend_decode(q, k, v, 0.25, threads=threads)
        got = np.full((H, Dh), np.nan, F32)
        K.attend_cached_into(q, caches[1].k[1], caches[1].v[1], kn, vn, n_before, start, 0.25,
                             got, threads)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(caches[1].k[1], caches[0].k[1])
        np.testing.assert_array_equal(caches[1].v[1], caches[0].v[1])


def test_attend_cached_argument_errors():
    H, Hkv, Dh, S = 4, 2, 8, 6
    q, out = np.ones((H, Dh), F32), np.empty((H, Dh), F32)
    kc, vc = np.zeros((1, Hkv, S, Dh), F32), np.zeros((1, Hkv, S, Dh), F32)
    kn = np.ones((Hkv, Dh), F32)
    with pytest.raises(ValueError, match="inside the cache"):
        K.attend_cached_into(q, kc, vc, kn, kn, S, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="inside the cache"):
        K.attend_cached_into(q, kc, vc, kn, kn, 2, 3, 1.0, out, 1)
    with pytest.raises(ValueError, match="multiple"):
        K.attend_cached_into(q[:3], kc, vc, kn, kn, 2, 0, 1.0, out[:3], 1)
    with pytest.raises(ValueError, match="k_new"):
        K.attend_cached_into(q, kc, vc, kn[:1], kn, 2, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="differ"):
        K.attend_cached_into(q, kc, np.zeros((1, Hkv, S - 1, Dh), F32), kn, kn, 2, 0, 1.0,
                             out, 1)
    with pytest.raises(ValueError, match="writable C-contiguous float32 array of 4"):
        K.attend_cached_into(q, kc[:, :, ::2], vc[:, :, ::2], kn, kn, 2, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="float32"):
        K.attend_cached_into(q.astype(np.float64), kc, vc, kn, kn, 2, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="overlap"):
        K.attend_cached_into(q, kc, vc, kn, kn, 2, 0, 1.0, q, 1)
    with pytest.raises(ValueError, match="overlap"):
        K.attend_cached_into(q, kc, kc, kn, kn, 2, 0, 1.0, out, 1)
    with pytest.raises(ValueError, match="threads"):
        K.attend_cached_into(q, kc, vc, kn, kn, 2, 0, 1.0, out, 0)
