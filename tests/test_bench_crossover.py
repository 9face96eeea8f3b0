"""scripts/bench_crossover.py on the shipped model: one row per token count with every
setting's time, and the igemm_min_tokens knob given back to its default afterwards."""
from __future__ import annotations

import sys
from pathlib import Path

from colibri.kernels import runtime
from colibri.api import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_crossover  # noqa: E402


def test_rows_and_the_knob_restored(capsys):
    before = runtime.igemm_min_tokens()
    assert bench_crossover.main([str(default_model_path()), "--tokens", "2,5",
                                 "--crossovers", "4,off", "--reps", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    assert [r[0].strip() for r in rows[1:]] == ["2", "5"]     # header, then T = 2 and 5
    assert rows[0][1:4] == [" default ms ", " 4 ms ", " off ms "]
    for r in rows[1:]:
        times = [float(c) for c in r[1:4]]
        ratios = [float(c) for c in r[4:]]
        assert all(t > 0 for t in times) and len(ratios) == 2
        lo = (times[0] - 0.05) / (times[1] + 0.05) - 0.005    # the times are rounded to
        hi = (times[0] + 0.05) / (times[1] - 0.05) + 0.005    # 0.1 ms, the ratio to 0.01
        assert lo <= ratios[0] <= hi
    assert runtime.igemm_min_tokens() == before
    assert "default crossover" in out
