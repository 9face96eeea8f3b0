"""group_by_expert: the (token, k) slots grouped by expert."""
from __future__ import annotations

import numpy as np
import pytest

from colibri import kernels as K
from colibri.kernels import _reference as R
from kernel_helpers import parallel_everything  # noqa: F401 (fixtures)


def test_group_by_expert():
    rng = np.random.default_rng(3)
    for T, Kk, E in [(1, 1, 1), (1, 2, 8), (50, 2, 8), (33, 3, 40), (10, 2, 3)]:
        ids = rng.integers(0, E, size=(T, Kk)).astype(np.int32)
        off, slots = K.group_by_expert(ids, E)
        roff, rslots = R.group_by_expert_ref(ids, E)
        assert off.dtype == np.int64 and slots.dtype == np.int32
        assert np.array_equal(off, roff) and np.array_equal(slots, rslots)
        for e in range(E):
            s = slots[off[e]:off[e + 1]]
            assert (ids.reshape(-1)[s] == e).all() and (np.diff(s) > 0).all()
    with pytest.raises(ValueError, match="0..3"):
        K.group_by_expert(np.array([[0, 4]]), 4)
    with pytest.raises(ValueError):
        K.group_by_expert(np.array([[-1, 0]]), 4)
