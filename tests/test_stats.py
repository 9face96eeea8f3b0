"""colibri.tools.stats: every statistic against numbers worked out by hand on a 5-token, 2-layer,
4-expert, top-2 trace; streaming (chunked updates) equals one update; the auxiliary loss
against transformers' load_balancing_loss_func."""
from __future__ import annotations

import math

import numpy as np
import pytest

from colibri.tools.stats import RoutingStats, default_lru_sizes, entropy
from colibri.tools.trace import Trace

# experts by descending weight, weights; token t = row, one block per layer
L0 = [([0, 1], [0.6, 0.4]), ([1, 0], [0.7, 0.3]), ([1, 2], [0.5, 0.5]), ([2, 1], [0.8, 0.2]),
      ([0, 2], [0.9, 0.1])]
L1 = [([2, 3], [0.6, 0.4]), ([3, 2], [0.6, 0.4]), ([2, 0], [0.7, 0.3]), ([3, 0], [0.55, 0.45]),
      ([2, 3], [0.9, 0.1])]
# router distributions: layer 0 per token (top-2 of each matches the choice above), layer 1
# uniform (so its aux loss is exactly K whatever the counts)
P0 = [[0.5, 0.3, 0.1, 0.1], [0.25, 0.5, 0.125, 0.125], [0.1, 0.4, 0.4, 0.1],
      [0.1, 0.2, 0.6, 0.1], [0.5, 0.1, 0.3, 0.1]]
P1 = [[0.25] * 4] * 5


def H(*p):
    """Entropy in nats, written out: -Σ p ln p."""
    return -sum(x * math.log(x) for x in p if x > 0)


@pytest.fixture(scope="module")
def tr() -> Trace:
    experts = np.array([[L0[t][0], L1[t][0]] for t in range(5)])            # (5, 2, 2)
    weights = np.array([[L0[t][1], L1[t][1]] for t in range(5)])
    probs = np.stack([np.array(P0), np.array(P1)], axis=1)                  # (5, 2, 4)
    return Trace(experts, weights, probs=probs, layers=[0, 1])


@pytest.fixture(scope="module")
def st(tr) -> RoutingStats:
    return RoutingStats.from_trace(tr, lru_sizes=(1, 2, 3))


def test_counts_shares_utilisation(st):
    assert st.tokens == 5
    np.testing.assert_array_equal(st.counts, [[3, 4, 3, 0], [2, 0, 4, 4]])
    np.testing.assert_allclose(st.token_share, [[0.3, 0.4, 0.3, 0.0], [0.2, 0.0, 0.4, 0.4]])
    # weight sums: L0 1.8 1.8 1.4 0 of 5; L1 0.75 0 2.6 1.65 of 5
    np.testing.assert_allclose(st.weight_share, [[0.36, 0.36, 0.28, 0.0], [0.15, 0.0, 0.52, 0.33]])
    # fair share = T*K/E = 2.5 assignments
    np.testing.assert_allclose(st.utilisation, [[1.2, 1.6, 1.2, 0.0], [0.8, 0.0, 1.6, 1.6]])


def test_balance_measures(st):
    # L0: counts 3 4 3 0, mean 2.5, variance (0.25 + 2.25 + 0.25 + 6.25) / 4 = 2.25
    # L1: counts 2 0 4 4, variance (0.25 + 6.25 + 2.25 + 2.25) / 4 = 2.75
    np.testing.assert_allclose(st.cv, [1.5 / 2.5, math.sqrt(2.75) / 2.5])
    # P (mean router probability) of layer 0: 1.45/5, 1.5/5, 1.525/5, 0.525/5
    np.testing.assert_allclose(st.mean_probs[0], [0.29, 0.30, 0.305, 0.105])
    # aux = E * sum_e (c_e / T) * P_e: L0 4 * (0.6*0.29 + 0.8*0.30 + 0.6*0.305) = 2.388;
    # L1 has uniform P, so 4 * 0.25 * sum_e c_e / T = K = 2
    np.testing.assert_allclose(st.aux_loss, [2.388, 2.0])
    # all rows pooled: f = (0.5, 0.4, 0.7, 0.4), P = (0.27, 0.275, 0.2775, 0.1775)
    assert st.aux_loss_total == pytest.approx(4 * (0.5 * 0.27 + 0.4 * 0.275 + 0.7 * 0.2775
                                                   + 0.4 * 0.1775))
    assert st.aux_loss_total == pytest.approx(2.041)


def test_entropies(st):
    mean_h0 = np.mean([H(*p) for p in P0])
    np.testing.assert_allclose(st.entropy, [mean_h0, math.log(4)])
    np.testing.assert_allclose(st.marginal_entropy, [H(0.29, 0.30, 0.305, 0.105), math.log(4)])
    assert st.max_entropy == pytest.approx(math.log(4))
    assert entropy(np.array([0.5, 0.5, 0.0])) == pytest.approx(math.log(2))   # 0 ln 0 = 0


def test_dead_and_rare(st):
    np.testing.assert_array_equal(st.dead, [[0, 0, 0, 1], [0, 1, 0, 0]])
    np.testing.assert_array_equal(st.rare(0.5), [[0, 0, 0, 1], [0, 1, 0, 0]])
    np.testing.assert_array_equal(st.rare(0.9), [[0, 0, 0, 1], [1, 1, 0, 0]])   # 0.8 < 0.9
    np.testing.assert_array_equal(st.rare(), st.dead)           # default 0.1: only the dead


def test_coactivation(st):
    c0 = np.array([[3, 2, 1, 0],       # {0,1} x2, {1,2} x2, {0,2} x1
                   [2, 4, 2, 0],
                   [1, 2, 3, 0],
                   [0, 0, 0, 0]])
    c1 = np.array([[2, 0, 1, 1],       # {2,3} x3, {0,2} x1, {0,3} x1
                   [0, 0, 0, 0],
                   [1, 0, 4, 3],
                   [1, 0, 3, 4]])
    np.testing.assert_array_equal(st.coactivation, [c0, c1])
    rate = st.coactivation_rate
    assert rate[0, 1, 2] == pytest.approx(2 / 4) and rate[0, 2, 1] == pytest.approx(2 / 3)
    assert np.isnan(rate[0, 3]).all() and np.allclose(np.diagonal(rate[1])[[0, 2, 3]], 1)


def test_persistence(st):
    # L0 pairs keep 2, 1, 2, 1 of 2 experts; L1 keep 2, 1, 1, 1
    assert st.pairs == 4
    np.testing.assert_allclose(st.persistence, [6 / 8, 5 / 8])
    # L0: e0 in S_0, S_1 -> kept once (0->1); e1 in S_0..S_3 -> kept 3 times; e2 in S_2, S_3
    # -> kept twice; e3 never chosen
    np.testing.assert_allclose(st.persistence_per_expert[0], [0.5, 0.75, 1.0, np.nan])


def test_lru_hit_rates(st):
    # Cache = the n most recently used experts, newest first (top weight newest within a
    # token); hits are counted against the cache before the token updates it. Layer 0, n=2:
    #   t0 {0,1} cache []    -> 0, then [0,1]     t1 {1,0} [0,1] -> 2, then [1,0]
    #   t2 {1,2} [1,0]       -> 1, then [1,2,0]   t3 {2,1} [1,2] -> 2, then [2,1,0]
    #   t4 {0,2} [2,1]       -> 1                                      = 6 of T*K = 10
    # n=1: 0+1+1+1+1 = 4; n=3: 0+2+1+2+2 = 7. Layer 1 (S = {2,3} {3,2} {2,0} {3,0} {2,3}):
    # n=1: 0+1+0+0+1 = 2; n=2: 0+2+1+1+1 = 5; n=3: 0+2+1+2+2 = 7.
    np.testing.assert_allclose(st.lru_hit_rate, [[0.4, 0.6, 0.7], [0.2, 0.5, 0.7]])


def test_chunked_updates_equal_one_update(tr, st):
    parts = RoutingStats(tr.layers, 4, 2, lru_sizes=(1, 2, 3))
    for part in (tr[:2], tr[2:3], tr[3:]):
        parts.update(part)
    for name in ("counts", "weight_sum", "prob_sum", "entropy_sum", "coactivation", "kept",
                 "kept_from", "lru_hits"):
        np.testing.assert_allclose(getattr(parts, name), getattr(st, name), err_msg=name)
    assert parts.pairs == st.pairs and parts.tokens == st.tokens


def test_sequence_boundaries_stop_persistence(tr):
    t = Trace(tr.experts, tr.weights, probs=tr.probs, positions=[0, 1, 2, 0, 1])
    s = RoutingStats.from_trace(t, lru_sizes=(2,))
    assert s.pairs == 3                      # (0,1), (1,2), (3,4): not (2,3)
    np.testing.assert_allclose(s.persistence, [(2 + 1 + 1) / 6, (2 + 1 + 1) / 6])
    # the LRU cache stays warm across sequences: same hits as one sequence
    np.testing.assert_allclose(s.lru_hit_rate[:, 0], [0.6, 0.5])


def test_no_probabilities_give_nan_not_wrong_numbers(tr):
    s = RoutingStats.from_trace(Trace(tr.experts, tr.weights, n_experts=4))
    assert np.isnan(s.aux_loss).all() and np.isnan(s.entropy).all()
    np.testing.assert_array_equal(s.counts, [[3, 4, 3, 0], [2, 0, 4, 4]])


def test_summary_and_table(st):
    s = st.summary()
    assert s["tokens"] == 5 and s["layers"] == [0, 1] and s["lru_sizes"] == [1, 2, 3]
    assert s["aux_loss"] == pytest.approx(2.041, abs=1e-4)
    l0, l1 = s["per_layer"]
    assert l0["dead"] == [3] and l1["dead"] == [1] and l0["busiest_expert"] == 1
    assert l1["lru_hit_rate"] == {"1": 0.2, "2": 0.5, "3": 0.7}
    assert l0["token_share"] == [0.3, 0.4, 0.3, 0.0]
    import json
    json.dumps(s, allow_nan=False)                       # JSON-clean
    text = st.format_summary()
    assert "5 tokens, 2 MoE layers, top-2 of 4 experts" in text
    assert "LRU3" in text and "utilisation" in text and "1.60" in text
    html = st._repr_html_()
    assert "RoutingStats" in html and "<table" in html


def test_mismatch_and_empty_errors(tr):
    s = RoutingStats([0], 4, 2)
    with pytest.raises(ValueError, match="does not match"):
        s.update(tr)
    with pytest.raises(ValueError, match="no tokens yet"):
        s.utilisation
    with pytest.raises(ValueError, match="top_k"):
        RoutingStats([0], 4, 5)


def test_default_lru_sizes():
    assert default_lru_sizes(4, 2) == (2,)
    assert default_lru_sizes(64, 8) == (8, 16, 32)
    assert default_lru_sizes(128, 8) == (8, 16, 32, 64)


def test_aux_loss_matches_transformers_function():
    torch = pytest.importorskip("torch")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    rng = np.random.default_rng(0)
    T, L, E, K = 37, 3, 8, 2
    logits = (rng.standard_normal((T, L, E)) * 2).astype(np.float32)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[..., :K]
    weights = np.take_along_axis(probs, experts, -1)
    s = RoutingStats.from_trace(Trace(experts, weights, logits=logits))
    hf = lambda ls: float(load_balancing_loss_func(  # noqa: E731
        tuple(torch.from_numpy(np.ascontiguousarray(x)) for x in ls), E, K))
    assert s.aux_loss_total == pytest.approx(hf([logits[:, j] for j in range(L)]), rel=1e-5)
    for j in range(L):
        assert s.aux_loss[j] == pytest.approx(hf([logits[:, j]]), rel=1e-5)
