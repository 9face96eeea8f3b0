"""colibri.kernels.runtime: the environment variables read at import (in a fresh interpreter each),
the knobs' records and checks, the BLAS limit and the timings.

The ISA, thread-count and per-knob behaviour of the kernels (results unchanged whatever the
setting) is tested beside the kernels, in test_kernels.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import threadpoolctl

from colibri.kernels import runtime

# What a fresh interpreter reports; cwd away from the checkout (tmp_path) so the installed
# package (with its compiled kernels) is imported, not the source folder.
REPORT = ("import json; from colibri.kernels import runtime as r; print(json.dumps({"
          "'isa': r.get_isa(), 'threads': r.default_threads(), "
          "**{k.name: k.get() for k in r.KNOBS}}))")
VARIABLES = ("COLIBRI_ISA", "COLIBRI_NUM_THREADS", "OMP_NUM_THREADS",
             *(k.env for k in runtime.KNOBS if k.env))


def fresh(tmp_path, **env: str) -> subprocess.CompletedProcess:
    """Run REPORT in a new interpreter with exactly these of VARIABLES set."""
    base = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    return subprocess.run([sys.executable, "-c", REPORT], capture_output=True, text=True,
                          env={**base, **env}, timeout=120, cwd=tmp_path)


def test_defaults_and_their_variables():
    """The documented defaults and variable names (README, docs/performance.md)."""
    assert {k.name: (k.env, k.default, k.minimum) for k in runtime.KNOBS} == {
        "min_parallel_bytes": ("COLIBRI_MIN_PARALLEL_BYTES", 1 << 18, 1),
        "gemm_min_tokens": (None, 4, 1),
        "igemm_min_tokens": (None, 0, 0),
        "spin_us": ("COLIBRI_SPIN_US", 500, 0),
    }


def test_fresh_interpreter_without_variables(tmp_path):
    res = fresh(tmp_path)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    native = [n for n in runtime.available_isas() if n != "amx-emu"]  # emulation: never default
    assert got["isa"] == native[-1]                                 # the widest path
    assert 1 <= got["threads"] <= runtime.MAX_THREADS
    assert {k.name: got[k.name] for k in runtime.KNOBS} == {
        k.name: k.default for k in runtime.KNOBS}


@pytest.mark.parametrize("knob", [k for k in runtime.KNOBS if k.env], ids=lambda k: k.env)
def test_knob_variables_take_effect(tmp_path, knob):
    for value, ok in (("1", True), (" 4096 ", True), ("", True), ("0", knob.minimum == 0),
                      ("-3", False), ("soon", False), ("2.5", False)):
        res = fresh(tmp_path, **{knob.env: value})
        if ok:
            assert res.returncode == 0, res.stderr
            want = int(value) if value.strip() else knob.default
            assert json.loads(res.stdout)[knob.name] == want, value
        else:
            assert res.returncode != 0 and f"{knob.env}={value.strip()!r}" in res.stderr, value


def test_isa_variable_takes_effect(tmp_path):
    for name in runtime.available_isas():
        res = fresh(tmp_path, COLIBRI_ISA=f" {name.upper()} ")          # case, spaces: fine
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["isa"] == name
    res = fresh(tmp_path, COLIBRI_ISA="mmx")
    assert res.returncode != 0 and "COLIBRI_ISA='mmx'" in res.stderr and "unknown ISA" in res.stderr
    for name in set(runtime.ISAS) - set(runtime.available_isas()):
        res = fresh(tmp_path, COLIBRI_ISA=name)
        assert res.returncode != 0 and "not supported" in res.stderr


def test_thread_variables_take_effect(tmp_path):
    for env, want in (({"OMP_NUM_THREADS": "3,2"}, 3), ({"COLIBRI_NUM_THREADS": "5"}, 5),
                      ({"COLIBRI_NUM_THREADS": "1", "OMP_NUM_THREADS": "4"}, 1)):
        res = fresh(tmp_path, **env)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["threads"] == want


def test_knob_set_checks_and_restores():
    for knob in runtime.KNOBS:
        try:
            knob.set(knob.minimum + 7)
            assert knob.get() == knob.minimum + 7
            for bad in (knob.minimum - 1, 2.0, True, "8"):
                with pytest.raises(ValueError, match=knob.name):
                    knob.set(bad)
            assert knob.get() == knob.minimum + 7                    # a refused value: no change
            knob.set(np.int64(knob.minimum + 1))
            assert knob.get() == knob.minimum + 1
        finally:
            knob.set(None)
        assert knob.get() == knob.default
    # the accessors by name are the records' methods
    assert runtime.spin_us == runtime.SPIN_US.get and runtime.set_spin_us == runtime.SPIN_US.set


def test_resolve_threads():
    assert runtime.resolve_threads(3) == 3
    assert runtime.resolve_threads(np.int32(2)) == 2
    assert runtime.resolve_threads(None) == runtime.default_threads()
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="threads"):
            runtime.resolve_threads(bad)


def test_blas_on_one_thread_restores_the_counts():
    before = [i["num_threads"] for i in threadpoolctl.threadpool_info()
              if i["user_api"] == "blas"]
    with runtime.blas_on_one_thread():
        assert all(i["num_threads"] == 1 for i in threadpoolctl.threadpool_info()
                   if i["user_api"] == "blas")
    assert [i["num_threads"] for i in threadpoolctl.threadpool_info()
            if i["user_api"] == "blas"] == before


def test_timings():
    t = runtime.Timings()
    assert list(t.seconds) == list(runtime.STAGES) and t.total == 0 and t.summary() == ""
    t0 = t.add("router", 0.0)                     # perf_counter() seconds since its epoch
    assert t0 > 0 and t.seconds["router"] == t0 and t.total == t0
    assert t.summary().startswith("router ") and t.copy() == t.seconds
    t.reset()
    assert t.total == 0
