"""`colibri routes` (colibri/commands/routes.py): output against the library, --json, --plot,
and bad arguments as one clear line with exit status 2."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

from colibri import api  # noqa: E402
from colibri.cli import COMMANDS  # noqa: E402
from colibri.convert import convert  # noqa: E402

from cli_helpers import one_line_error  # noqa: E402
from cli_helpers import run as run_cli  # noqa: E402
from colibri.tools.trace import trace  # noqa: E402

PROMPT = "def fibonacci(n): return n"


@pytest.fixture(scope="module")
def paths(hf_checkpoint, tmp_path_factory):
    """{family: .colibri path} for mixtral (MoE layers 0, 1) and qwen2_moe (0 MoE, 1 dense)."""
    out = {}
    d = tmp_path_factory.mktemp("routes")
    for fam in ("mixtral", "qwen2_moe"):
        out[fam] = str(convert(hf_checkpoint(fam, initializer_range=0.15), d / f"{fam}.colibri",
                               dtype="f32", progress=False))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    p = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    p.write_text("The hummingbird is small, fast and frugal.\n" * 6 + PROMPT + "\n")
    return p


def run(capsys, *argv) -> tuple[int, str, str]:
    argv = [str(a) for a in argv]
    if argv[0] == "routes" and "--threads" not in argv:
        argv += ["--threads", "1"]       # 2 threads on a busy shared machine only wait
    return run_cli(capsys, *argv)


def test_registered():
    assert "routes" in COMMANDS


def test_routes_prompt_table_and_stats(paths, capsys):
    code, out, err = run(capsys, "routes", paths["mixtral"], "-p", PROMPT, "--threads", "1")
    assert code == 0 and err == ""
    with api.load(paths["mixtral"], threads=1) as m:
        tr = trace(m, PROMPT)
        want = tr.format_table()
        stats = tr.stats().format_summary()
    assert out.startswith(want + "\n\n")
    assert out.rstrip("\n").endswith(stats)
    first = out.splitlines()[0]
    e, w = tr.experts[0, 0], tr.weights[0, 0]
    assert first.startswith("token 0 ")
    assert f"→ L0 [{e[0]} {w[0]:.2f}, {e[1]} {w[1]:.2f}]" in first
    assert "aux loss" in out and "persist" in out and "LRU2" in out


def test_routes_one_layer_and_json(paths, capsys):
    code, out, _ = run(capsys, "routes", paths["mixtral"], "-p", PROMPT, "--layer", "1",
                       "--json", "--max-tokens", "4")
    assert code == 0
    d = json.loads(out)
    assert d["prompt"] == PROMPT and d["stats"]["layers"] == [1] and d["stats"]["tokens"] == 4
    with api.load(paths["mixtral"], threads=1) as m:
        tr = trace(m, PROMPT, max_tokens=4)
    assert [t["id"] for t in d["trace"]["tokens"]] == tr.token_ids.tolist()
    for t, row in enumerate(d["trace"]["tokens"]):
        (route,) = row["routes"]
        assert route["layer"] == 1 and route["experts"] == tr.experts[t, 1].tolist()
        np.testing.assert_allclose(route["weights"], tr.weights[t, 1], atol=1e-6)
    code, out, _ = run(capsys, "routes", paths["mixtral"], "-p", PROMPT, "--layer", "0")
    assert code == 0 and " L1 [" not in out and "L0 [" in out


def test_routes_file_streams_statistics(paths, corpus, capsys):
    code, out, _ = run(capsys, "routes", paths["mixtral"], "-f", corpus, "--batch", "8",
                       "--json")
    assert code == 0
    d = json.loads(out)
    assert "trace" not in d                                     # statistics only
    with api.load(paths["mixtral"], threads=1) as m:
        st = trace(m, corpus).stats()
    assert d["stats"]["tokens"] == st.tokens
    assert d["stats"]["per_layer"][0]["token_share"] == [round(x, 4) for x in st.token_share[0]]
    code, out, _ = run(capsys, "routes", paths["mixtral"], "-f", corpus, "--table",
                       "--batch", "8", "--max-tokens", "20")
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("token ")]
    assert len(rows) == 20 and rows[-1].startswith("token 19 ")
    assert "20 tokens, 2 MoE layers" in out


def test_routes_plots(paths, corpus, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    for args, kind in ((["-p", PROMPT], "tokens"), (["-f", corpus], "heatmap"),
                       (["-p", PROMPT, "--plot-kind", "coactivation", "--layer", "1"],
                        "coactivation")):
        png = tmp_path / f"{kind}.png"
        code, _, err = run(capsys, "routes", paths["mixtral"], *args, "--plot", png)
        assert code == 0 and f"({kind})" in err
        assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, match", [
    (["--layer", "1"], "layer 1 is not a MoE layer of .* \\(MoE layers: 0\\)"),
    (["--layer", "-3"], "layer -3 is not a MoE layer"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1, found 0"),
    (["--ctx", "100000"], "--ctx 100000 exceeds the model's context length 256"),
    (["--table"], "--table is for -f FILE"),
])
def test_routes_bad_arguments(paths, capsys, args, match):
    code, out, err = run(capsys, "routes", paths["qwen2_moe"], "-p", PROMPT, *args)
    assert code == 2 and out == ""
    import re
    assert re.search(match, one_line_error(err, "routes"))


def test_routes_bad_sources(paths, tmp_path, capsys):
    code, _, err = run(capsys, "routes", paths["qwen2_moe"], "-f", tmp_path / "missing.txt")
    assert code == 2 and "missing.txt: no such file" in one_line_error(err, "routes")
    code, _, err = run(capsys, "routes", paths["qwen2_moe"])
    assert code == 2 and "one of the arguments -p/--prompt -f/--file is required" in err
    code, _, err = run(capsys, "routes", paths["qwen2_moe"], "-p", "x", "-f", "y")
    assert code == 2 and "not allowed with argument" in err
    code, _, err = run(capsys, "routes", tmp_path / "nope.colibri", "-p", "x")
    assert code == 2 and "nope.colibri" in one_line_error(err, "routes")
    (tmp_path / "empty.txt").write_text("")
    code, _, err = run(capsys, "routes", paths["qwen2_moe"], "-f", tmp_path / "empty.txt")
    assert code == 2 and "no tokens" in one_line_error(err, "routes")


def test_routes_default_model(capsys):
    code, out, _ = run(capsys, "routes", "-p", "def f(x):", "--threads", "1")
    assert code == 0 and out.startswith("token 0 ") and "aux loss" in out
