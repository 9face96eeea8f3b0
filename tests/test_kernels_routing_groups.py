"""route_topk's group rules (DeepSeek): softmax_group_topk and sigmoid_group_topk against
the NumPy specification (colibri.kernels._reference.route_group_ref) and against transformers'
router modules themselves, ties, infinite logits, the prepared call, errors."""
from __future__ import annotations

import numpy as np
import pytest

from colibri import kernels as K
from colibri.kernels import _reference as R
from kernel_helpers import F32, THREADS, rng_for

GROUP_RULES = ("softmax_group_topk", "sigmoid_group_topk")
SHAPES = [(1, 8, 2, 4, 2), (37, 8, 1, 2, 1), (19, 64, 6, 8, 3), (5, 12, 3, 3, 3),
          (9, 8, 8, 1, 1), (11, 16, 4, 4, 1)]            # T, E, k, n_group, topk_group


def _route(rule, logits, k, bias, G, TG, norm, threads=None):
    return K.route_topk(logits, k, rule=rule, norm_topk_prob=norm, bias=bias, n_group=G,
                        topk_group=TG, threads=threads)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("rule", GROUP_RULES)
def test_group_rules_match_reference(rule, norm, threads):
    rng = rng_for("route-group", rule, norm)
    for T, E, k, G, TG in SHAPES:
        logits = (rng.standard_normal((T, E)) * 3).astype(F32)
        bias = (rng.standard_normal(E) * 0.5).astype(F32)
        ids, w = _route(rule, logits, k, bias, G, TG, norm, threads)
        rids, rw = R.route_topk_ref(logits, k, rule=rule, norm_topk_prob=norm, bias=bias,
                                    n_group=G, topk_group=TG)
        assert ids.dtype == np.int32 and w.dtype == F32 and ids.shape == (T, k)
        assert np.array_equal(ids, rids), (T, E, k, G, TG)
        np.testing.assert_allclose(w, rw, rtol=1e-6, atol=1e-7)
        assert (np.diff(w, axis=1) <= 0).all()
        size = E // G
        for row in ids:                                    # k distinct experts in <= TG groups
            assert len(set(row.tolist())) == k
            assert len(set((row // size).tolist())) <= TG
        p = K.prepare_route(k, rule=rule, norm_topk_prob=norm, bias=bias, n_group=G,
                            topk_group=TG, threads=threads)
        pids, pw = p(logits)
        assert np.array_equal(pids, ids) and np.array_equal(pw, w)


def _hf_router(cls_name, config_cls, E, k, G, TG, norm, scaling=1.0, **extra):
    import torch
    import transformers
    config = getattr(transformers, config_cls)(
        hidden_size=E, num_attention_heads=4, num_experts_per_tok=k, n_routed_experts=E,
        n_group=G, topk_group=TG,
        norm_topk_prob=norm, routed_scaling_factor=scaling, **extra)
    mod = getattr(transformers.models, config.model_type)
    router = getattr(getattr(mod, f"modeling_{config.model_type}"), cls_name)(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))               # logits = the input rows
    return router


@pytest.mark.parametrize("norm", [False, True])
def test_sigmoid_group_topk_is_transformers_v3_router(norm):
    """DeepseekV3TopkRouter's choice and weights (divided by routed_scaling_factor)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    rng = rng_for("v3-router", norm)
    for T, E, k, G, TG in [(64, 16, 4, 4, 2), (32, 8, 3, 2, 1), (16, 12, 2, 1, 1)]:
        router = _hf_router("DeepseekV3TopkRouter", "DeepseekV3Config", E, k, G, TG, norm, 2.5)
        bias = (rng.standard_normal(E) * 0.3).astype(F32)
        with torch.no_grad():
            router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        logits = (rng.standard_normal((T, E)) * 2).astype(F32)
        with torch.no_grad():
            _, tw, ti = router(torch.from_numpy(logits))
        ids, w = _route("sigmoid_group_topk", logits, k, bias, G, TG, norm)
        order = np.argsort(ti.numpy(), axis=1)
        want_ids = np.take_along_axis(ti.numpy(), order, 1)
        want_w = np.take_along_axis(tw.numpy(), order, 1) / np.float32(2.5)
        order = np.argsort(ids, axis=1)
        np.testing.assert_array_equal(np.take_along_axis(ids, order, 1), want_ids)
        np.testing.assert_allclose(np.take_along_axis(w, order, 1), want_w, rtol=1e-6)


def test_softmax_group_topk_is_transformers_v2_router():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    rng = rng_for("v2-router")
    for T, E, k, G, TG in [(64, 16, 4, 4, 2), (32, 8, 3, 2, 1), (16, 8, 2, 8, 3)]:
        router = _hf_router("DeepseekV2TopkRouter", "DeepseekV2Config", E, k, G, TG, False,
                            topk_method="group_limited_greedy")
        logits = (rng.standard_normal((T, E)) * 2).astype(F32)
        with torch.no_grad():
            _, tw, ti = router(torch.from_numpy(logits))
        ids, w = _route("softmax_group_topk", logits, k, None, G, TG, False)
        o1, o2 = np.argsort(ti.numpy(), axis=1), np.argsort(ids, axis=1)
        np.testing.assert_array_equal(np.take_along_axis(ids, o2, 1),
                                      np.take_along_axis(ti.numpy(), o1, 1))
        np.testing.assert_allclose(np.take_along_axis(w, o2, 1),
                                   np.take_along_axis(tw.numpy(), o1, 1), rtol=1e-6)


def test_group_rules_ties_and_infinities():
    inf = np.inf
    logits = np.array([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                       [-inf, -inf, 0.0, 0.0, inf, -inf, 3.0, 3.0],
                       [5.0, -inf, -inf, -inf, -inf, -inf, -inf, -inf]], F32)
    bias = np.zeros(8, F32)
    for rule in GROUP_RULES:
        ids, w = _route(rule, logits, 2, bias, 4, 2, False)
        rids, rw = R.route_topk_ref(logits, 2, rule=rule, bias=bias, n_group=4, topk_group=2)
        assert np.array_equal(ids, rids) and np.isfinite(w).all()
        np.testing.assert_allclose(w, rw, rtol=1e-6)
        assert ids[0].tolist() == [0, 1]                  # ties: lower group, lower expert


def test_group_rule_errors():
    logits = np.zeros((2, 8), F32)
    bias = np.zeros(8, F32)
    with pytest.raises(ValueError, match="n_group = 3 must divide the E = 8"):
        _route("softmax_group_topk", logits, 2, None, 3, 1, False)
    with pytest.raises(ValueError, match="topk_group = 5 must be in 1..n_group = 4"):
        _route("softmax_group_topk", logits, 2, None, 4, 5, False)
    with pytest.raises(ValueError, match="k = 5 exceeds the 4 experts"):
        _route("sigmoid_group_topk", logits, 5, bias, 4, 2, False)
    with pytest.raises(ValueError, match="needs the correction bias"):
        _route("sigmoid_group_topk", logits, 2, None, 4, 2, False)
    with pytest.raises(ValueError, match="bias has 7 elements, expected E = 8"):
        _route("sigmoid_group_topk", logits, 2, bias[:7], 4, 2, False)
    with pytest.raises(ValueError, match="groups of 1 expert"):
        _route("sigmoid_group_topk", logits, 2, bias, 8, 4, False)
    with pytest.raises(ValueError, match="takes no noise_seed"):
        K.route_topk(logits, 2, rule="softmax_group_topk", n_group=2, noise_seed=1)
