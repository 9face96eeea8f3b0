"""The asv suite imports against this tree: a benchmark module that names a function the
package no longer has fails here, not at the next `asv continuous` (the gen-loop change
removed generate.decode_one, which asv_bench/benchmarks/model.py imported)."""
import importlib
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "asv_bench"
MODULES = sorted(p.stem for p in (BENCH / "benchmarks").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_module_imports(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    module = importlib.import_module(f"benchmarks.{name}")
    classes = [v for v in vars(module).values()
               if isinstance(v, type) and v.__module__ == module.__name__
               and any(a.startswith(("time_", "track_", "peakmem_", "mem_")) for a in vars(v))]
    assert classes or name == "common", f"{name}: no benchmark class"
    sys.modules.pop(f"benchmarks.{name}", None)
