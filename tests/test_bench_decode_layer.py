"""scripts/bench_decode_layer.py, the A/B of the compiled decode step against the Python
layers: on the shipped model and on a tiny DeepSeek-V2 (MLA) file, the two paths' logits
bit-identical, the ratio read from the printed times, the load printed before and after; a
difference between the paths is reported and fails the run."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from colibri.api import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_decode_layer  # noqa: E402

RUN = ["--threads", "1", "--steps", "3", "--rounds", "1", "--prompt", "5", "--budget", "30"]
LINE = re.compile(r"(?P<name>\S+) threads=1 activations=\S+: compiled (?P<c>[\d.]+) ms/token, "
                  r"python (?P<p>[\d.]+) ms/token \(medians of 3 steps each\), ratio "
                  r"compiled / python (?P<ratio>[\d.]+), .*; (?P<verdict>.*)$")


def _result(out: str) -> re.Match:
    lines = out.splitlines()
    assert lines[0].startswith("load before: ") and lines[-1].startswith("load after: ")
    found = [m for m in map(LINE.match, lines) if m]
    assert len(found) == 1, out
    m = found[0]
    c, p, ratio = float(m["c"]), float(m["p"]), float(m["ratio"])
    assert c > 0 and p > 0
    # the times are rounded to 1 us, the ratio to 0.001
    assert (c - 5e-4) / (p + 5e-4) - 5e-4 <= ratio <= (c + 5e-4) / (p - 5e-4) + 5e-4
    return m


@pytest.fixture(scope="module")
def mla_file(hf_checkpoint, tmp_path_factory):
    from colibri.convert import convert
    dst = tmp_path_factory.mktemp("ab-mla") / "deepseek_v2.colibri"
    return convert(hf_checkpoint("deepseek_v2", initializer_range=0.15), dst, dtype="f32",
                   progress=False)


@pytest.mark.parametrize("which", ["shipped", "mla"])
def test_paths_bit_identical(which, request, capsys):
    path = default_model_path() if which == "shipped" else request.getfixturevalue("mla_file")
    assert bench_decode_layer.main([str(path), *RUN]) == 0
    m = _result(capsys.readouterr().out)
    assert m["name"] == Path(path).name
    assert m["verdict"] == "logits bit-identical on every step"


def test_a_difference_fails_the_run(monkeypatch, capsys):
    """The Python path made to give other logits (by a ulp-sized amount): reported, exit 1."""
    import numpy as np
    forward = bench_decode_layer.colibri.forward

    def python_path_off(model, ids, **kw):
        out = forward(model, ids, **kw)
        return np.nextafter(out, np.inf) if model.compiled_step is None else out

    monkeypatch.setattr(bench_decode_layer.colibri, "forward", python_path_off)
    assert bench_decode_layer.main([str(default_model_path()), *RUN]) == 1
    assert _result(capsys.readouterr().out)["verdict"].startswith("LOGITS DIFFER by up to ")
