"""The memory read kernel (read_sum, read_bandwidth)."""
from __future__ import annotations

import numpy as np

from colibri import _kernels, kernels as K
from kernel_helpers import isa, parallel_everything  # noqa: F401 (fixtures)


def test_read_sum_and_bandwidth(isa):
    rng = np.random.default_rng(9)
    for n in (1, 7, 4096 + 13, 3 * 65536 + 5):
        buf = rng.integers(0, 256, n, dtype=np.uint8)
        words = n // 8 * 8
        expect = int(buf[:words].view("<u8").sum(dtype=np.uint64)) + int(buf[words:].sum())
        expect %= 1 << 64
        for threads in (1, 2):
            assert _kernels.read_sum(buf, threads) == expect, (n, threads)
    assert K.read_bandwidth(1 << 20, 2, repeats=2) > 0
