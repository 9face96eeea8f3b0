"""BiasedExperts (colibri/kernels/biased_experts.py, GPT-OSS's experts: biases, swigluoai) on
MXFP4 stacks: against a NumPy reference (decoded weights, float64), and bit for bit against the
plain per-expert composition of kernels.linear calls (what it did before it grouped and prepared
its calls; one token, the compiled call, up to its activation's exp: a few ulp); experts with
many tokens take each matrix's GEMM path as kernels.linear does (on int8 / int16 activations the
integer GEMM, csrc/igemm.h), or on int16 where that path does not take them the f32 GEMM
(kernels.mxfp4_f32_activations). tests/test_biased_experts_prefill.py has the grouped call
against BiasedExperts.reference."""
from __future__ import annotations

import numpy as np
import pytest

from colibri import kernels as K
from colibri.format import mxfp4
from colibri.kernels import runtime
from colibri.kernels import _reference as R
from colibri.kernels.biased_experts import BiasedExperts, swigluoai
from colibri.kernels.weights import WeightRef
from kernel_helpers import F32, rng_for
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)

E, D, I, KK = 5, 96, 64, 2
ALPHA, LIMIT = 1.702, 7.0


def stack(rng, R_, C) -> WeightRef:
    codes = rng.integers(0, 256, size=(E, R_, C // 2), dtype=np.uint8)
    scales = rng.integers(119, 123, size=(E, R_, C // 32)).astype(np.uint8)
    return WeightRef(buf=mxfp4.rows(codes, scales).reshape(-1).copy(), offset=0, dtype="mxfp4",
                     rows=R_, cols=C, group_size=32, n_experts=E)


def experts(rng, activations, activation="swigluoai", threads=2):
    ws = stack(rng, I, D), stack(rng, I, D), stack(rng, D, I)
    bs = [(rng.standard_normal(s) * 0.1).astype(F32) for s in ((E, I), (E, I), (E, D))]
    return BiasedExperts(*ws, *bs, activation, ALPHA, LIMIT, threads, activations)


def reference(be: BiasedExperts, x, ids, wts) -> np.ndarray:
    """The NumPy twins of each matrix (colibri.kernels._reference: float64 products of the decoded
    weights, the activations quantized as the kernels do), the activation in float32 as
    transformers; an expert's activations as BiasedExperts picks them."""
    bits = {"f32": 0, "int16": 16, "int8": 8}[be.activations]
    counts = np.bincount(ids.reshape(-1), minlength=E)

    def lin(v, w, b, e):
        b_ = 0 if K.mxfp4_f32_activations(w, be.activations, counts[e]) else bits
        if not b_:
            return R.linear_ref(v, w, b, expert=e)
        return R.linear_iact_ref(v, w, b, expert=e, bits=b_)

    y = np.zeros((x.shape[0], D))
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            g = lin(x[t:t + 1], be.w_gate, be.b_gate[e], e)
            u = lin(x[t:t + 1], be.w_up, be.b_up[e], e)
            h = (swigluoai(g, u, ALPHA, LIMIT) if be.activation == "swigluoai"
                 else g * (F32(1) / (F32(1) + np.exp(-g))) * u)
            y[t] += float(wts[t, k]) * lin(h.astype(F32), be.w_down, be.b_down[e], e)[0]
    return y.astype(F32)


def per_expert_calls(be: BiasedExperts, x, ids, wts) -> np.ndarray:
    """The plain composition: per chosen expert, three kernels.linear calls, np.add.at."""
    slots = ids.reshape(-1)
    order = np.argsort(slots, kind="stable")
    experts_, starts = np.unique(slots[order], return_index=True)
    acc = np.zeros((x.shape[0], D), F32)
    for e, group in zip(experts_.tolist(), np.split(order, starts[1:])):
        tokens = group // ids.shape[1]
        act = ("f32" if K.mxfp4_f32_activations(be.w_gate, be.activations, len(group))
               else be.activations)
        xs = np.ascontiguousarray(x[tokens])
        g = K.linear(xs, be.w_gate, be.b_gate[e], expert=e, threads=2, activations=act)
        u = K.linear(xs, be.w_up, be.b_up[e], expert=e, threads=2, activations=act)
        h = (swigluoai(g, u, ALPHA, LIMIT) if be.activation == "swigluoai"
             else g * (F32(1) / (F32(1) + np.exp(-g))) * u)
        y = K.linear(np.ascontiguousarray(h, F32), be.w_down, be.b_down[e], expert=e,
                     threads=2, activations=act)
        y *= wts.reshape(-1)[group][:, None]
        np.add.at(acc, tokens, y)
    return acc


def case(rng, T):
    x = (rng.standard_normal((T, D)) * 2).astype(F32)          # reaches the clamps
    ids = np.stack([rng.permutation(E)[:KK] for _ in range(T)]).astype(np.int32)
    return x, ids, rng.random((T, KK)).astype(F32)


@pytest.mark.parametrize("activations", ["f32", "int16", "int8"])
@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
def test_matches_reference_and_the_per_expert_calls(isa, activations, activation):
    rng = rng_for("biased", activations, activation)
    be = experts(rng, activations, activation)
    for T in (1, 3, 40):                        # decode; few tokens; 16 per expert
        x, ids, wts = case(rng, T)
        y = be(x, ids, wts, np.empty((T, D), F32))
        want = reference(be, x, ids, wts)
        scale = float(np.abs(want).max())
        if T > 1:
            np.testing.assert_array_equal(y, per_expert_calls(be, x, ids, wts), f"T={T}")
        else:       # one compiled call: the same row kernels, its own activation's exp
            np.testing.assert_allclose(y, per_expert_calls(be, x, ids, wts), rtol=0,
                                       atol={"f32": 2e-6, "int16": 2e-5, "int8": 2e-3}
                                       [activations] * scale)
        # h rounds to float32 from sums in another order before it is quantized for
        # w_down: a code on a rounding tie may move by one (test_kernels_activations)
        atol = {"f32": 2e-5, "int16": 1e-4, "int8": 2e-3}[activations] * scale
        np.testing.assert_allclose(y, want, rtol=1e-3, atol=atol, err_msg=f"T={T}")


def test_out_may_be_x_and_repeated_ids():
    rng = rng_for("biased-alias")
    be = experts(rng, "int16")
    x, ids, wts = case(rng, 6)
    ids[2] = ids[2, 0]                          # a token choosing one expert twice
    want = per_expert_calls(be, x, ids, wts)
    y = be(x, ids, wts, x)
    assert y is x
    np.testing.assert_array_equal(x, want)


@pytest.mark.parametrize("igemm_from, f32", [(10 ** 9, True), (1, False)])
def test_many_int16_tokens_without_the_integer_gemm_take_f32(isa, igemm_from, f32):
    """An expert with >= 8 tokens on int16 gives the f32-activation bits where the integer
    GEMM does not take it (igemm_min_tokens 10^9: the avx2 path's default), the integer
    GEMM's int16 bits where it does; fewer tokens: the int16 row kernel either way."""
    previous = runtime.igemm_min_tokens()
    runtime.set_igemm_min_tokens(igemm_from)
    try:
        rng = rng_for("biased-gemm")
        b16 = experts(rng, "int16")
        b32 = BiasedExperts(b16.w_gate, b16.w_up, b16.w_down, b16.b_gate, b16.b_up,
                            b16.b_down, "swigluoai", ALPHA, LIMIT, 2, "f32")
        x = rng.standard_normal((8, D)).astype(F32)
        ids = np.tile(np.array([[1, 3]], np.int32), (8, 1))
        wts = rng.random(ids.shape).astype(F32)
        assert K.mxfp4_f32_activations(b16.w_gate, "int16", 8) is f32
        assert not K.mxfp4_f32_activations(b16.w_gate, "int16", 7)
        assert not K.mxfp4_f32_activations(b16.w_gate, "int8", 8)
        same = np.array_equal(b16(x, ids, wts, np.empty_like(x)),
                              b32(x, ids, wts, np.empty_like(x)))
        assert same is f32
        np.testing.assert_array_equal(b16(x, ids, wts, np.empty_like(x)),
                                      per_expert_calls(b16, x, ids, wts))
        few = slice(0, 7)
        assert not np.array_equal(b16(x[few], ids[few], wts[few], np.empty_like(x[few])),
                                  b32(x[few], ids[few], wts[few], np.empty_like(x[few])))
    finally:
        runtime.set_igemm_min_tokens(previous)
