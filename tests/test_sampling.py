"""colibri.generation.sampling: each filter against a direct statement of its rule, and the Sampler."""
import numpy as np
import pytest

from colibri.errors import ColibriError
from colibri.generation.sampling import (Sampler, apply_repetition_penalty, apply_temperature,
                                         greedy, min_p_filter, sample_from_logits, softmax,
                                         top_k_filter, top_p_filter)


def _probs(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_repetition_penalty_transformers_convention():
    x = np.array([2.0, -2.0, 1.0, -1.0, 0.5], np.float32)
    out = apply_repetition_penalty(x, [0, 1, 1, 4], 2.0)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0, -1.0, 0.25])
    np.testing.assert_array_equal(x, [2.0, -2.0, 1.0, -1.0, 0.5])   # input untouched
    assert apply_repetition_penalty(x, [0], 1.0) is x


def test_repetition_penalty_matches_transformers():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    rng = np.random.default_rng(0)
    x = rng.normal(size=50).astype(np.float32)
    hist = rng.integers(0, 50, size=20)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.from_numpy(hist[None]), torch.from_numpy(x[None].copy()))
    np.testing.assert_allclose(apply_repetition_penalty(x, hist, 1.3), ref[0].numpy(), rtol=1e-6)


def test_repetition_penalty_rejects_bad_ids():
    with pytest.raises(ValueError, match="outside"):
        apply_repetition_penalty(np.zeros(4, np.float32), [4], 1.2)


def test_top_k_keeps_k_largest():
    x = np.array([0.1, 3.0, -1.0, 2.0, 2.5], np.float32)
    out = top_k_filter(x, 2)
    assert set(np.flatnonzero(np.isfinite(out))) == {1, 4}
    assert top_k_filter(x, 0) is x          # 0 = off
    assert top_k_filter(x, 10) is x


def test_top_p_keeps_crossing_token():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    x = np.log(p).astype(np.float32)
    kept = lambda q: set(np.flatnonzero(np.isfinite(top_p_filter(x, q))))
    assert kept(0.5) == {0}
    assert kept(0.6) == {0, 1}
    assert kept(0.81) == {0, 1, 2}
    assert kept(0.01) == {0}
    assert top_p_filter(x, 1.0) is x


def test_top_p_matches_transformers():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import TopPLogitsWarper
    rng = np.random.default_rng(1)
    for _ in range(20):
        x = (rng.normal(size=64) * 3).astype(np.float32)
        q = float(rng.uniform(0.05, 0.95))
        ref = TopPLogitsWarper(q)(None, torch.from_numpy(x[None].copy()))[0].numpy()
        np.testing.assert_array_equal(np.isfinite(top_p_filter(x, q)), np.isfinite(ref))


def test_min_p():
    p = np.array([0.6, 0.3, 0.07, 0.03])
    x = np.log(p).astype(np.float32)
    assert set(np.flatnonzero(np.isfinite(min_p_filter(x, 0.1)))) == {0, 1, 2}
    assert set(np.flatnonzero(np.isfinite(min_p_filter(x, 0.4)))) == {0, 1}
    assert min_p_filter(x, 0.0) is x


def test_temperature_and_greedy():
    x = np.array([1.0, 3.0, 2.0], np.float32)
    np.testing.assert_allclose(apply_temperature(x, 0.5), [2.0, 6.0, 4.0])
    with pytest.raises(ValueError):
        apply_temperature(x, 0.0)
    assert greedy(x) == 1
    assert greedy(np.array([5.0, 5.0, 1.0], np.float32)) == 0


def test_sample_distribution_follows_softmax():
    x = np.array([0.0, 1.0, 2.0, -np.inf], np.float32)
    rng = np.random.default_rng(2)
    draws = np.bincount([sample_from_logits(x, rng) for _ in range(20000)], minlength=4) / 20000
    np.testing.assert_allclose(draws, _probs(x), atol=0.015)
    assert draws[3] == 0


def test_sampler_seed_reproducible_and_different_seeds_differ():
    rng = np.random.default_rng(3)
    rows = (rng.normal(size=(40, 100)) * 2).astype(np.float32)
    run = lambda seed: [Sampler(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, seed=seed)(r)
                        for r in rows]
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_sampler_temperature_zero_is_greedy():
    rng = np.random.default_rng(4)
    rows = rng.normal(size=(10, 30)).astype(np.float32)
    s = Sampler(temperature=0.0, top_k=3, top_p=0.5, seed=1)
    assert [s(r) for r in rows] == [int(np.argmax(r)) for r in rows]


def test_sampler_greedy_with_penalty_avoids_repeats():
    x = np.array([3.0, 2.9, 0.0], np.float32)
    assert Sampler()(x, history=[0]) == 0
    assert Sampler(repetition_penalty=1.5)(x, history=[0]) == 1


def test_sampler_top_k_1_is_greedy_at_any_temperature():
    rng = np.random.default_rng(5)
    s = Sampler(temperature=2.0, top_k=1, seed=0)
    for r in rng.normal(size=(10, 30)).astype(np.float32):
        assert s(r) == int(np.argmax(r))


def test_sampler_no_nan_on_extreme_logits():
    x = np.array([1e30, -1e30, 0.0, 3e38], np.float32)
    s = Sampler(temperature=0.01, top_p=0.9, seed=0)
    assert s(x) == 3
    assert np.isfinite(softmax(np.array([-1e38, -1e38], np.float32))).all()


def test_sampler_rejects_nan_logits_and_bad_settings():
    with pytest.raises(ColibriError, match="NaN"):
        Sampler(temperature=1.0, seed=0)(np.array([0.0, np.nan], np.float32))
    for kw in [dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
               dict(min_p=2.0), dict(repetition_penalty=0.0)]:
        with pytest.raises(ValueError):
            Sampler(**kw)


def test_a_tiny_repetition_penalty_gives_huge_finite_logits():
    """repetition_penalty 5e-324 (> 0, so allowed): the seen token's logit is divided into
    float32's largest finite value, not inf, and sampling still picks a token (the seen one)."""
    logits = np.array([1.0, 2.0, -3.0, 0.5], dtype=np.float32)
    out = apply_repetition_penalty(logits, [0, 2], 5e-324)
    assert np.isfinite(out).all()
    assert out[0] == np.finfo(np.float32).max and out[1] == 2.0
    assert Sampler(temperature=1.0, repetition_penalty=5e-324, seed=0)(logits, [0]) == 0


@pytest.mark.parametrize("where", [0, 3, 9])
def test_greedy_refuses_a_nan_anywhere(where):
    """greedy checks NaN with argmax itself (NaN is its maximum): at any position, beside
    larger finite logits and infinities, it is a ColibriError; without one the first largest."""
    from colibri.generation.sampling import greedy
    x = np.array([0, 5, 1, -np.inf, 2, np.inf, 3, 4, 1, 0], np.float32)
    assert greedy(x) == 5
    x[where] = np.nan
    with pytest.raises(ColibriError, match="1 NaN"):
        greedy(x)
