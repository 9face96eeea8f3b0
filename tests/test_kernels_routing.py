"""route_topk: the routing rules against the reference, ties, infinite logits, errors,
Gumbel noise.
"""
from __future__ import annotations

import numpy as np
import pytest

from colibri import kernels as K
from colibri.kernels import _reference as R
from kernel_helpers import F32, THREADS, rng_for
from kernel_helpers import parallel_everything  # noqa: F401 (fixtures)


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
