"""colibri.generation.scoring: (context, continuation) log-likelihoods, a shared context run once
and the continuations on prefix copies of its KV cache (KVCache.prefix_copy), against one whole
cache-free forward pass per pair (Model.forward), on the shipped model."""
from __future__ import annotations

import numpy as np
import pytest

import colibri
from colibri.api import default_model_path
from colibri.generation.sampling import log_softmax
from colibri.generation.scoring import score


@pytest.fixture(scope="module")
def model():
    m = colibri.load(default_model_path(), threads=1)
    yield m
    m.close()


def reference(model, ctx, cont):
    """(sum of log p(cont[i] | ctx + cont[:i]), every cont token the argmax) from one
    Model.forward over the whole sequence."""
    ids = np.array(list(ctx) + list(cont))
    logits = model.forward(ids)
    rows = logits[len(ctx) - 1:len(ids) - 1]
    lp = [log_softmax(r)[t] for r, t in zip(rows, cont)]
    return float(np.sum(lp)), bool(all(int(np.argmax(r)) == t for r, t in zip(rows, cont)))


def pairs(model):
    rng = np.random.default_rng(0)
    V = model.vocab_size
    shared = rng.integers(0, V, 23).tolist()
    out = [(shared, rng.integers(0, V, n).tolist()) for n in (1, 1, 4, 9)]
    out += [(rng.integers(0, V, 7).tolist(), rng.integers(0, V, 3).tolist()),
            (rng.integers(0, V, 40).tolist(), rng.integers(0, V, 1).tolist())]
    # a greedy continuation: is_greedy must come out True
    ctx = rng.integers(0, V, 5).tolist()
    cont = []
    for _ in range(3):
        cont.append(int(np.argmax(model.forward(np.array(ctx + cont))[-1])))
    out.append((ctx, cont))
    return out


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("batch_tokens", [512, 16])        # 16: contexts over several steps
def test_score_matches_whole_forward_passes(model, share, batch_tokens):
    reqs = pairs(model)
    seen = []
    got = score(model, reqs, batch_tokens=batch_tokens, max_sequences=3,
                share_contexts=share, progress=seen.append)
    assert sum(seen) == len(reqs)
    for (ctx, cont), s in zip(reqs, got):
        want_lp, want_greedy = reference(model, ctx, cont)
        assert s.token_logprobs.shape == (len(cont),)
        assert s.logprob == pytest.approx(want_lp, abs=2e-3 * len(cont))  # summation order
        assert s.is_greedy == want_greedy
    assert got[-1].is_greedy


def test_score_rejects_bad_requests(model):
    V = model.vocab_size
    with pytest.raises(ValueError, match="out of range"):
        score(model, [([1, 2], [V])])
    with pytest.raises(ValueError, match="non-empty"):
        score(model, [([], [1])])
    with pytest.raises(ValueError, match="batch_tokens"):
        score(model, [([1], [2])], batch_tokens=0)


def test_prefix_copy_continues_like_the_original(model):
    ids = np.arange(1, 12)
    a = model.new_cache(ctx=32)
    model.forward(ids[:8], cache=a)
    b = a.prefix_copy(8, ctx=16)
    np.testing.assert_allclose(model.forward(ids[8:], cache=b), model.forward(ids[8:], cache=a),
                               atol=1e-5)
    with pytest.raises(ValueError, match="prefix_copy"):
        a.prefix_copy(99)
