"""The AMX tile bodies of the integer GEMM (csrc/igemm_amx.h) over the emulated tiles
(path amx-emu, any CPU with avx512vnni) and, where the CPU and OS run them, the real ones
(path amx). Both equal the scalar specification bit for bit (test_igemm.py runs every one of
its tests on both paths too); here the int16 split (hi * 256 + lo through TDPBSSD and
TDPBUSD) against the avx512vnni int16 body, and the real tiles against the emulation.
"""
from __future__ import annotations

import numpy as np
import pytest

from colibri import kernels as K
from colibri.kernels import runtime
from colibri.kernels import _reference as R
from kernel_helpers import F32, make_weight, rng_for
from kernel_helpers import parallel_everything  # noqa: F401 (fixture)
from test_igemm import act_rows, full_range_codes

NEEDS_EMU = pytest.mark.skipif("amx-emu" not in runtime.available_isas(),
                               reason="this CPU does not run avx512vnni (amx-emu's base)")
NEEDS_AMX = pytest.mark.skipif("amx" not in runtime.available_isas(),
                               reason="this CPU/OS does not run AMX tiles (CPUID, XCR0 or "
                                      "arch_prctl(ARCH_REQ_XCOMP_PERM) say no)")


def linear_on(path, w, x, act):
    previous = runtime.get_isa()
    runtime.set_isa(path)
    try:
        return [K.linear(x[:T], w, threads=2, activations=act) for T in (16, 17, 33, 64, 130)]
    finally:
        runtime.set_isa(previous)


@pytest.fixture(autouse=True)
def igemm_from_one():
    previous = runtime.igemm_min_tokens()
    runtime.set_igemm_min_tokens(1)
    yield
    runtime.set_igemm_min_tokens(previous)


@NEEDS_EMU
@pytest.mark.parametrize("fmt", ["q4", "q8", "mxfp4"])
@pytest.mark.parametrize("act, bits", [("int8", 8), ("int16", 16)])
def test_amx_emu_equals_avx512vnni_and_spec(fmt, act, bits):
    """From 16 tokens (the tile bodies) amx-emu gives the avx512vnni body's bits and the
    NumPy spec's, for every weight format and both activation widths."""
    rng = rng_for("amx-emu", fmt, act)
    w = make_weight(rng, (101, 544), fmt, 32)[0]
    if fmt != "mxfp4":
        w = full_range_codes(w, rng)
    x = act_rows(rng, 130, 544)
    emu, vnni = linear_on("amx-emu", w, x, act), linear_on("avx512vnni", w, x, act)
    for T, a, b in zip((16, 17, 33, 64, 130), emu, vnni):
        assert np.array_equal(a, b), (fmt, act, T)
        if fmt != "mxfp4":
            assert np.array_equal(a, R.linear_igemm_ref(x[:T], w, bits=bits)), (fmt, act, T)


@NEEDS_AMX
@pytest.mark.parametrize("fmt", ["q4", "q8", "mxfp4"])
@pytest.mark.parametrize("act", ["int8", "int16"])
def test_amx_real_equals_emulation(fmt, act):
    """The real tiles against their emulation, bit for bit."""
    rng = rng_for("amx-real", fmt, act)
    w = make_weight(rng, (101, 544), fmt, 32)[0]
    x = act_rows(rng, 130, 544).astype(F32)
    for a, b in zip(linear_on("amx", w, x, act), linear_on("amx-emu", w, x, act)):
        assert np.array_equal(a, b), (fmt, act)


def test_amx_never_chosen_by_itself_when_emulated():
    """The emulation is a test path: the default path is never amx-emu."""
    runtime.set_isa(None)
    assert runtime.get_isa() != "amx-emu"
