"""The runtime of the kernels: the ISA choice (set_isa, COLIBRI_ISA), the thread pool
(threads, spin_us, workers, fork, concurrent callers), default_threads, and the knobs that
change only speed (min_parallel_bytes, gemm_min_tokens).
"""
from __future__ import annotations

import subprocess
import sys

import time

import numpy as np
import pytest

from colibri import _kernels, kernels as K
from colibri.kernels import runtime
from colibri.kernels.weights import WeightRef
from kernel_helpers import F32, GEMM_MIN, make_experts, make_weight, rng_for
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)


def test_isa_selection():
    isas = runtime.available_isas()
    assert isas[0] == "scalar" and set(isas) <= set(runtime.ISAS)
    previous = runtime.get_isa()
    try:
        for name in isas:
            runtime.set_isa(name)
            assert runtime.get_isa() == name
        runtime.set_isa(None)
        native = [n for n in isas if n != "amx-emu"]         # the emulation is never the default
        assert runtime.get_isa() == native[-1]               # the widest supported path
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
    code = "from colibri.kernels import runtime; print(runtime.get_isa())"
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
    code = "from colibri.kernels import runtime; print(runtime.spin_us())"
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
    # on a loaded machine the caller may claim every item of a call before a worker is
    # scheduled: call until a worker took part, within a bound that fails a pool that never
    # lets them
    deadline, calls = time.monotonic() + 10.0, 0
    while calls < 20 or (_kernels.pool_worker_items() == before and time.monotonic() < deadline):
        assert np.array_equal(K.linear(x, w, threads=threads), want)
        calls += 1
    assert _kernels.pool_worker_items() > before, f"no worker ran an item in {calls} calls"


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
