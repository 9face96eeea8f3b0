"""Shared fixtures. Tiny Hugging Face checkpoints come from tests/hf_factory.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))   # tests/ helpers importable as modules

from hf_factory import FAMILY_NAMES, make_hf_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Cached `make_hf_checkpoint`: hf_checkpoint(family, dtype="float32", sharded=False,
    seed=0, tokenizer=True, **overrides) -> Path, built once per session per argument set.

    The folder is shared between tests: do not modify it (use hf_factory.copy_checkpoint).
    """
    cache: dict[tuple, Path] = {}

    def get(family: str, dtype: str = "float32", sharded: bool = False, seed: int = 0, *,
            tokenizer: bool = True, **overrides) -> Path:
        key = (family, dtype, sharded, seed, tokenizer, repr(sorted(overrides.items())))
        if key not in cache:
            where = tmp_path_factory.mktemp(f"hf-{family}-{dtype}")
            cache[key] = make_hf_checkpoint(where / "model", family, dtype, sharded, seed,
                                            tokenizer=tokenizer, **overrides)
        return cache[key]

    return get


@pytest.fixture(params=FAMILY_NAMES)
def family_name(request) -> str:
    """Each supported family in turn."""
    return request.param


@pytest.fixture(autouse=True)
def _run_away_from_the_checkout(tmp_path, monkeypatch):
    """Each test runs in its own temporary folder, so a subprocess `python -c "import colibri"`
    imports the installed package (with its compiled kernels), not the source folder of the
    checkout, which `python -c` would put first on sys.path."""
    monkeypatch.chdir(tmp_path)
