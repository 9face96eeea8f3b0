"""colibri.generation.prompt_logprobs' block helpers: each row the same as sampling.log_softmax and
sampling.top_logprobs on that row alone (ties lower id first, -inf entries, a bad row)."""
from __future__ import annotations

import numpy as np
import pytest

from colibri.errors import ColibriError
from colibri.generation.prompt_logprobs import _score_rows
from colibri.generation.sampling import log_softmax, top_ids, top_logprobs


@pytest.mark.parametrize("V", [50, 4099])
@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_rows_match_the_one_row_functions(k, V):
    rng = np.random.default_rng(V + k)
    x = (rng.standard_normal((9, V)) * 4).astype(np.float32)
    x[1, :] = 0.25                       # every token tied
    x[2, 7] = x[2, 3] = x[2].max() + 1   # a tie for the best
    x[3, ::2] = -np.inf                  # masked entries
    x[4, 10:10 + k] = x[4].max() + 2     # ties across the k-th place
    targets = rng.integers(0, V, 9)
    targets[3] = 0                       # a masked target: -inf
    chosen, tops = _score_rows(x, targets, k)
    assert (tops is None) == (k == 0)
    for r, row in enumerate(x):
        want = log_softmax(row)
        assert chosen[r] == want[targets[r]]                     # the same bits
        if k:
            assert tops[r] == top_logprobs(want, k)


def test_a_row_without_a_finite_largest_logit_is_an_error():
    x = np.zeros((3, 4), dtype=np.float32)
    x[1] = np.nan
    with pytest.raises(ColibriError, match="largest logit"):
        _score_rows(x, np.zeros(3, dtype=np.int64), 1)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_top_ids_are_the_sorted_order_with_ties_to_the_lower_id(k):
    """A stable sort by value, best first: ties go to lower ids also where they straddle the
    k-th place (argpartition alone picks any of them)."""
    rng = np.random.default_rng(k)
    for row in (np.full(4099, 0.25), rng.integers(0, 3, 4099).astype(np.float64),
                np.where(rng.random(300) < 0.5, -np.inf, rng.standard_normal(300))):
        want = sorted(range(row.size), key=lambda i: (-row[i], i))[:k]
        assert top_ids(row, k) == want
        assert [i for i, _ in top_logprobs(row, k)] == want
