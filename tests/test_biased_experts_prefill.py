"""BiasedExperts over T > 1 token rows (GPT-OSS's prefill and the ragged step of several
sequences) as one compiled call (kernels.prepare_biased_experts_grouped,
pyx/biased_experts.pxi): the slots grouped by expert once, per expert its gate / up rows with
their biases and the activation, its down rows with their bias, the weighted outputs added
per token in ascending expert order.

Its arithmetic is BiasedExperts.reference's (the specification: a prepared linear per
expert and matrix, the activation in NumPy) operation for operation, NumPy's exp included,
so it is compared bit for bit: every ISA path, f32 / int16 / int8 activations, MXFP4 / q4 /
q8 / bf16 stacks, experts below and above the GEMM crossovers in one call, several GEMM
passes, 1-3 threads, repeated ids, out aliasing x, an expert cache's slots, no biases; and
within float tolerances of the float64 reference (colibri.kernels._reference.biased_experts_ref)."""
from __future__ import annotations

import numpy as np
import pytest

from colibri import kernels as K
from colibri.format import mxfp4
from colibri.kernels import runtime
from colibri.kernels import _reference as R
from colibri.kernels.biased_experts import BiasedExperts
from colibri.kernels.weights import WeightRef
from kernel_helpers import F32, make_weight, rng_for
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)

E, D, I = 5, 96, 64
ALPHA, LIMIT = 1.702, 7.0
GEMM_FROM = 6                   # both GEMM crossovers the tests force: some experts each side


@pytest.fixture(autouse=True)
def crossovers():
    """gemm_min_tokens and igemm_min_tokens GEMM_FROM for the test (restored after)."""
    before = runtime.gemm_min_tokens(), runtime.igemm_min_tokens()
    runtime.set_gemm_min_tokens(GEMM_FROM)
    runtime.set_igemm_min_tokens(GEMM_FROM)
    yield
    runtime.set_gemm_min_tokens(before[0])
    runtime.set_igemm_min_tokens(before[1])


def mx_stack(rng, n, rows, cols) -> WeightRef:
    codes = rng.integers(0, 256, size=(n, rows, cols // 2), dtype=np.uint8)
    scales = rng.integers(119, 123, size=(n, rows, cols // 32)).astype(np.uint8)
    return WeightRef(buf=mxfp4.rows(codes, scales).reshape(-1).copy(), offset=0, dtype="mxfp4",
                     rows=rows, cols=cols, group_size=32, n_experts=n)


def stacks(rng, fmt, n=E):
    shapes = ((n, I, D), (n, I, D), (n, D, I))
    if fmt == "mxfp4":
        return tuple(mx_stack(rng, *s) for s in shapes)
    return tuple(make_weight(rng, s, fmt, 32, 0.3)[0] for s in shapes)


def biases(rng, n=E):
    return [(rng.standard_normal(s) * 0.1).astype(F32) for s in ((n, I), (n, I), (n, D))]


def experts(rng, fmt, activations, activation="swigluoai", threads=2, with_bias=True):
    bs = biases(rng) if with_bias else [None] * 3
    return BiasedExperts(*stacks(rng, fmt), *bs, activation, ALPHA, LIMIT, threads, activations)


def case(rng, T, k=2, skew=True):
    """x (T, D) reaching the clamps; ids (T, k) distinct per token, expert 0 chosen by most
    tokens when skew (above the crossovers) and the others by few; weights (T, k)."""
    x = (rng.standard_normal((T, D)) * 2).astype(F32)
    p = np.array([0.55, 0.2, 0.15, 0.07, 0.03]) if skew else np.full(E, 1 / E)
    ids = np.stack([rng.choice(E, size=k, replace=False, p=p) for _ in range(T)]).astype(np.int32)
    return x, ids, rng.random((T, k)).astype(F32)


def grouped(be: BiasedExperts, x, ids, wts, slots=None):
    out = np.empty_like(x)
    be(x, ids, wts, out, slots)
    return out


def spec(be: BiasedExperts, x, ids, wts, slots=None):
    out = np.empty_like(x)
    be.reference(x, ids, wts, out, slots)
    return out


@pytest.mark.parametrize("activations", ["f32", "int16", "int8"])
@pytest.mark.parametrize("fmt", ["mxfp4", "q4", "q8"])
def test_grouped_call_is_the_reference_bit_for_bit(isa, fmt, activations):
    """Several token counts: few per expert (row kernels), expert 0 above the crossover,
    T = 200 (expert 0 over 64 tokens: two GEMM passes)."""
    rng = rng_for("bx-prefill", fmt, activations)
    be = experts(rng, fmt, activations)
    for T in (2, 5, 23, 200):
        x, ids, wts = case(rng, T)
        np.testing.assert_array_equal(grouped(be, x, ids, wts), spec(be, x, ids, wts),
                                      f"{isa} {fmt} {activations} T={T}")


def test_int16_mxfp4_without_the_integer_gemm(isa):
    """Where the integer GEMM does not take an expert's tokens (igemm_min_tokens 10^9, as on
    the avx2 path), an int16 MXFP4 expert with >= 8 tokens runs on f32 activations
    (kernels.mxfp4_f32_activations), the others on the int16 row kernel: the reference's
    bits, and not those with the integer GEMM on."""
    rng = rng_for("bx-f32-twin")
    be = experts(rng, "mxfp4", "int16")
    x, ids, wts = case(rng, 40)
    with_igemm = grouped(be, x, ids, wts)
    runtime.set_igemm_min_tokens(10 ** 9)
    counts = np.bincount(ids.reshape(-1), minlength=E)
    assert counts.max() >= 8 and counts.min() < 8
    np.testing.assert_array_equal(grouped(be, x, ids, wts), spec(be, x, ids, wts))
    assert not np.array_equal(grouped(be, x, ids, wts), with_igemm)


@pytest.mark.parametrize("activations", ["f32", "int16"])
def test_silu_bf16_and_no_biases(isa, activations):
    """The silu activation, bf16 stacks (the f32 path for every activations setting), no
    biases: the reference's bits."""
    rng = rng_for("bx-silu", activations)
    for fmt, bias in (("bf16", True), ("mxfp4", False)):
        be = experts(rng, fmt, activations, activation="silu", with_bias=bias)
        x, ids, wts = case(rng, 31)
        np.testing.assert_array_equal(grouped(be, x, ids, wts), spec(be, x, ids, wts),
                                      f"{fmt} bias={bias}")


@pytest.mark.parametrize("activations", ["f32", "int16", "int8"])
def test_threads_repeated_ids_and_out_is_x(isa, activations):
    """The same bits for 1, 2, 3 threads; a token choosing one expert twice (summed in slot
    order); out aliasing x (one token too: the grouped call then)."""
    rng = rng_for("bx-threads", activations)
    be = {n: experts(rng_for("bx-threads-w"), "mxfp4", activations, threads=n) for n in (1, 2, 3)}
    x, ids, wts = case(rng, 40, k=3)
    ids[5] = ids[5, 0]
    ids[9, 1] = ids[9, 2]
    want = spec(be[1], x, ids, wts)
    for n in (1, 2, 3):
        np.testing.assert_array_equal(grouped(be[n], x, ids, wts), want, f"threads {n}")
    xa = x.copy()
    assert be[2](xa, ids, wts, xa) is xa
    np.testing.assert_array_equal(xa, want)
    one = x[7:8].copy()
    np.testing.assert_array_equal(be[2](one, ids[7:8], wts[7:8], one),
                                  spec(be[2], x[7:8], ids[7:8], wts[7:8]))


def test_expert_cache_slots(isa):
    """Over an arena's slots: expert ids[t, k]'s weights from stack row slots[t, k], its
    biases from row ids[t, k]: the reference's bits, and the bits of the plain stacks."""
    rng = rng_for("bx-slots")
    ws = stacks(rng, "mxfp4")
    bs = biases(rng)
    perm = np.array([3, 0, 4, 1, 2], np.int32)          # expert e lives in slot perm[e]
    inv = np.argsort(perm)
    slot_ws = []
    for w in ws:
        stride = w.expert_stride
        buf = np.concatenate([np.asarray(w.buf)[inv[s] * stride:(inv[s] + 1) * stride]
                              for s in range(E)])
        slot_ws.append(WeightRef(buf=buf, offset=0, dtype=w.dtype, rows=w.rows, cols=w.cols,
                                 group_size=w.group_size, n_experts=E))
    plain = BiasedExperts(*ws, *bs, "swigluoai", ALPHA, LIMIT, 2, "int16")
    arena = BiasedExperts(*slot_ws, *bs, "swigluoai", ALPHA, LIMIT, 2, "int16", n_experts=E)
    x, ids, wts = case(rng, 37)
    slots = perm[ids]
    got = grouped(arena, x, ids, wts, slots)
    np.testing.assert_array_equal(got, spec(arena, x, ids, wts, slots))
    np.testing.assert_array_equal(got, grouped(plain, x, ids, wts))


@pytest.mark.parametrize("fmt", ["mxfp4", "q8"])
def test_against_float64_reference(fmt):
    """f32 activations against colibri.kernels._reference.biased_experts_ref (decoded weights,
    float64): float32 rounding only."""
    rng = rng_for("bx-f64", fmt)
    be = experts(rng, fmt, "f32")
    x, ids, wts = case(rng, 29)
    want = R.biased_experts_ref(x, ids, wts, be.w_gate, be.w_up, be.w_down, be.b_gate,
                                be.b_up, be.b_down, "swigluoai", ALPHA, LIMIT)
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(grouped(be, x, ids, wts), want, rtol=1e-4, atol=2e-5 * scale)


def test_bad_arguments_name_what_is_wrong():
    rng = rng_for("bx-bad")
    be = experts(rng, "mxfp4", "int8")
    p = K.prepare_biased_experts_grouped(be.w_gate, be.w_up, be.w_down, be.b_gate, be.b_up,
                                         be.b_down, "swigluoai", ALPHA, LIMIT, threads=2,
                                         activations="int8")
    x, ids, wts = case(rng, 4)
    out = np.empty_like(x)
    bad = ids.copy()
    bad[2, 1] = E
    with pytest.raises(ValueError, match=r"expert id 5 at \(2, 1\) is out of range for 5"):
        p(x, bad, wts, out)
    with pytest.raises(ValueError, match=r"slot -1 at \(0, 0\) is out of range"):
        p(x, ids, wts, out, np.full_like(ids, -1))
    with pytest.raises(ValueError, match=r"must both be \(T, 96\)"):
        p(x, ids, wts, np.empty((3, D), F32))
    with pytest.raises(ValueError, match="ids"):
        p(x, ids[:3], wts, out)
    with pytest.raises(ValueError, match="activation must be"):
        K.prepare_biased_experts_grouped(be.w_gate, be.w_up, be.w_down, None, None, None,
                                         "gelu", ALPHA, LIMIT)
    with pytest.raises(ValueError, match=r"b_up has shape \(4, 64\)"):
        K.prepare_biased_experts_grouped(be.w_gate, be.w_up, be.w_down, None,
                                         np.zeros((4, I), F32), None, "silu", ALPHA, LIMIT)


def test_more_than_one_token_takes_the_compiled_call(monkeypatch):
    """BiasedExperts.__call__ with T > 1 never runs the Python loop (NumPy's exp loop is
    found on the supported NumPy versions)."""
    assert K.EXP_LOOP
    rng = rng_for("bx-call")
    be = experts(rng, "mxfp4", "int16")
    x, ids, wts = case(rng, 9)
    want = spec(be, x, ids, wts)

    def loop(*args, **kwargs):
        raise AssertionError("the Python loop ran")
    monkeypatch.setattr(BiasedExperts, "reference", loop)
    np.testing.assert_array_equal(grouped(be, x, ids, wts), want)
