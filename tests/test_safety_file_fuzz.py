"""The CI face of scripts/fuzz_format.py: every saved regression input replayed, a bounded
hypothesis-driven byte mutation of valid files through the same oracle (opens, or a
ColibriError; nothing else), and hypothesis round-trips of the writer and reader."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from colibri.format import ColibriFile, save

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fuzz_format", ROOT / "scripts" / "fuzz_format.py")
fuzz_format = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz_format)

SEEDS = fuzz_format.seeds()
REGRESSIONS = sorted((ROOT / "tests" / "fuzz_regressions").glob("*"))


@pytest.mark.parametrize("path", REGRESSIONS or [None], ids=lambda p: p.name if p else "none")
def test_saved_fuzz_inputs_stay_fixed(path, tmp_path):
    if path is None:
        pytest.skip("no saved fuzz inputs (the campaigns found no crash)")
    fuzz_format.probe(path.read_bytes(), tmp_path / "r.colibri")


def test_the_seeds_are_valid_files(tmp_path):
    for k, s in enumerate(SEEDS[:-1]):        # the last one is a prefix of the shipped model
        p = tmp_path / f"s{k}.colibri"
        p.write_bytes(s)
        ColibriFile(p).close()


mutation = st.tuples(
    st.integers(0, len(SEEDS) - 1),
    st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=8),
    st.one_of(st.none(), st.integers(0, 1 << 16)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(mutation)
def test_mutated_files_open_or_fail_cleanly(tmp_path, m):
    which, edits, cut = m
    data = bytearray(SEEDS[which])
    for at, value in edits:
        data[at % len(data)] = value
    if cut is not None:
        data = data[:cut]
    fuzz_format.probe(bytes(data), tmp_path / "m.colibri")


DTYPES = ("f32", "f16", "bf16", "q8", "q4", "i32")
tensor = st.tuples(st.sampled_from(DTYPES), st.integers(1, 3), st.sampled_from([32, 64]),
                   st.integers(0, 2**31 - 1))
meta_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
json_value = st.recursive(st.none() | st.booleans() | st.integers(-2**53, 2**53) | meta_text,
                          lambda c: st.lists(c, max_size=3)
                          | st.dictionaries(meta_text, c, max_size=3), max_leaves=10)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.from_regex(r"[a-z][a-z0-9_.]{0,20}", fullmatch=True), tensor,
                       min_size=1, max_size=5),
       st.dictionaries(meta_text, meta_text, max_size=4), json_value)
def test_writer_reader_round_trip(tmp_path, tensors, user, extra):
    arrays = {}
    for name, (dtype, rows, cols, seed) in tensors.items():
        if name.startswith("layers."):
            continue                          # layer names need their layer count
        rng = np.random.default_rng(seed)
        a = (rng.integers(-9, 9, (rows, cols)).astype(np.int32) if dtype == "i32"
             else rng.standard_normal((rows, cols)).astype(np.float32))
        arrays[name] = (a, dtype)
    if not arrays:
        return
    meta = {"user": user, "extra": extra}
    path = tmp_path / "rt.colibri"
    save(path, arrays, meta, group_size=32, overwrite=True)
    with ColibriFile(path) as cf:
        assert cf.validate() == []
        assert cf.metadata == meta
        for name, (a, dtype) in arrays.items():
            got = cf.to_float32(name)
            tol = {"f32": 0, "i32": 0, "f16": 1e-3, "bf16": 1e-2, "q8": 0.05, "q4": 0.5}[dtype]
            np.testing.assert_allclose(got, a.astype(np.float32),
                                       atol=tol * max(1.0, float(np.abs(a).max())))
