"""The sampling pieces batching adds: OpenAI presence / frequency penalties, log_softmax and
top_logprobs, Sampler.penalise / choose."""
from __future__ import annotations

import numpy as np
import pytest

from colibri.generation.sampling import (Sampler, apply_presence_frequency_penalty, log_softmax,
                                         top_logprobs)


def openai_reference(logits, generated, presence, frequency):
    """The formula of the OpenAI API docs, token by token:
    mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence."""
    out = np.array(logits, dtype=np.float64)
    for j in range(out.shape[0]):
        c = list(generated).count(j)
        out[j] = out[j] - c * frequency - float(c > 0) * presence
    return out


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 1.3), (0.7, -0.4),
                                                 (-2.0, 2.0)])
def test_presence_frequency_penalty_is_the_openai_formula(presence, frequency):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32) * 3
    generated = [3, 7, 3, 3, 49, 0, 7]
    got = apply_presence_frequency_penalty(logits, generated, presence, frequency)
    np.testing.assert_allclose(got, openai_reference(logits, generated, presence, frequency),
                               rtol=1e-6, atol=1e-6)
    assert got is not logits and logits[3] != got[3]                 # input untouched


def test_penalties_off_or_nothing_generated_return_the_input():
    x = np.arange(5, dtype=np.float32)
    assert apply_presence_frequency_penalty(x, [1, 2], 0.0, 0.0) is x
    assert apply_presence_frequency_penalty(x, [], 1.0, 1.0) is x
    with pytest.raises(ValueError, match=r"outside \[0, 5\)"):
        apply_presence_frequency_penalty(x, [5], 1.0, 0.0)


def test_log_softmax_and_top_logprobs():
    x = np.array([1.0, 3.0, -np.inf, 3.0, 0.5], np.float32)
    lp = log_softmax(x)
    p = np.exp(x.astype(np.float64) - x.max())
    live = np.isfinite(x)
    np.testing.assert_allclose(lp[live], np.log(p[live] / p.sum()), rtol=1e-12)
    assert lp[2] == -np.inf and np.exp(lp).sum() == pytest.approx(1.0)
    top = top_logprobs(lp, 3)
    assert [t for t, _ in top] == [1, 3, 0]                      # ties: the lower id first
    assert top[0][1] == pytest.approx(lp[1]) and top_logprobs(lp, 0) == []
    assert len(top_logprobs(lp, 99)) == 5


def test_sampler_applies_the_penalties_to_generated_tokens_only():
    x = np.array([2.0, 1.9, 0.0], np.float32)
    assert Sampler()(x, history=[0], generated=[0]) == 0
    assert Sampler(presence_penalty=0.2)(x, history=[0], generated=[0]) == 1
    assert Sampler(presence_penalty=0.2)(x, history=[0], generated=[]) == 0   # prompt only
    assert Sampler(frequency_penalty=0.06)(x, generated=[0]) == 0
    assert Sampler(frequency_penalty=0.06)(x, generated=[0, 0]) == 1
    s = Sampler(repetition_penalty=1.5, presence_penalty=0.3)
    np.testing.assert_allclose(s.penalise(x, [0], [0]), [2.0 / 1.5 - 0.3, 1.9, 0.0], rtol=1e-6)
    with pytest.raises(ValueError, match="presence_penalty must be a finite number"):
        Sampler(presence_penalty=float("nan"))
