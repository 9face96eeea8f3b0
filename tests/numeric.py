"""Shared numeric checks of the tests."""
from __future__ import annotations

import numpy as np


def assert_close(a, b, tol: float) -> None:
    """max |a - b| relative to max(1, max |b|) is at most tol (float32 comparison)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = max(1.0, float(np.abs(b).max()))
    err = float(np.abs(a - b).max()) / scale
    assert err <= tol, f"max relative error {err:.3g} > {tol}"
