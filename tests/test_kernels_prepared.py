"""The prepared kernel calls (PreparedLinear, PreparedRoute, PreparedExperts): equal to the
kernels, and their argument errors.
"""
from __future__ import annotations

import numpy as np
import pytest

from colibri import kernels as K
from colibri.kernels import runtime
from colibri.kernels.weights import WeightRef
from kernel_helpers import F32, ffn_dims, make_experts, make_weight, rng_for
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)


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
