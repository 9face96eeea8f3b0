"""colibri.prompt_logprobs' block helpers: each row the same as sampling.log_softmax and
sampling.top_logprobs on that row alone (ties lower id first, -inf entries, a bad row)."""
from __future__ import annotations

import numpy as np
import pytest

from colibri.errors import ColibriError
from colibri.prompt_logprobs import _log_softmax_rows, _top_rows
from colibri.sampling import log_softmax, top_logprobs


@pytest.mark.parametrize("k", [1, 2, 5])
def test_rows_match_the_one_row_functions(k):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 50)).astype(np.float32)
    x[1, :] = 0.25                       # every token tied
    x[2, 7] = x[2, 3] = x[2].max() + 1   # a tie for the best
    x[3, ::2] = -np.inf                  # masked entries
    lp = _log_softmax_rows(x)
    for row, got, top in zip(x, lp, _top_rows(lp, k)):
        want = log_softmax(row)
        np.testing.assert_array_equal(got, want)
        assert top == top_logprobs(want, k)


def test_a_row_without_a_finite_largest_logit_is_an_error():
    x = np.zeros((3, 4), dtype=np.float32)
    x[1] = np.nan
    with pytest.raises(ColibriError, match="largest logit"):
        _log_softmax_rows(x)
