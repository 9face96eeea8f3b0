"""colibri bench: bytes per decoded token against a hand count, the rows' fields and their
arithmetic, the markdown and JSON outputs, argument errors. Timings are never asserted."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("transformers")

from colibri.kernels import runtime  # noqa: E402
from colibri.tools.bench import (COLUMNS, bytes_per_token, format_machine_notes,  # noqa: E402
                           format_markdown, json_ready, run_bench)
from colibri.cli import main  # noqa: E402
from colibri.convert import convert  # noqa: E402
from colibri.format import ColibriFile  # noqa: E402
from cli_helpers import one_line_error  # noqa: E402
from hf_factory import TINY_CONFIGS  # noqa: E402


def q4_row(cols: int) -> int:          # 4-bit codes + one f16 scale per 32 columns
    return cols // 2 + cols // 32 * 2


def q8_row(cols: int) -> int:
    return cols + cols // 32 * 2


@pytest.fixture(scope="module")
def qwen2_q4(hf_checkpoint, tmp_path_factory):
    """qwen2_moe (layer 0 MoE with a shared expert, layer 1 dense), f32, experts and shared
    expert q4 with group 32."""
    return convert(hf_checkpoint("qwen2_moe"), tmp_path_factory.mktemp("bench") / "q.colibri",
                   dtype="f32", quant="q4", group_size=32, progress=False)


@pytest.fixture(scope="module")
def rows(qwen2_q4):
    return run_bench(qwen2_q4, n_prompt=[4, 6], n_gen=3, threads=[1, 2], reps=2,
                     warmup=False, bandwidth_bytes=1 << 20)


# --------------------------------------------------------------------------------------------
# bytes per token, counted by hand from the config
# --------------------------------------------------------------------------------------------

def test_bytes_per_token_qwen2_by_hand(qwen2_q4):
    c = TINY_CONFIGS["qwen2_moe"][1]
    D, V = c["hidden_size"], c["vocab_size"]
    H, Hkv = c["num_attention_heads"], c["num_key_value_heads"]
    Dh, K, I, Is, Id = D // H, c["num_experts_per_tok"], c["moe_intermediate_size"], \
        c["shared_expert_intermediate_size"], c["intermediate_size"]
    f32 = 4
    attention = 2 * f32 * ((H * Dh + 2 * Hkv * Dh) * D + D * H * Dh    # wq wk wv wo, 2 layers
                           + H * Dh + 2 * Hkv * Dh)                     # q/k/v biases
    router = f32 * c["num_experts"] * D                                 # layer 0 only
    experts = K * (2 * I * q4_row(D) + D * q4_row(I))                   # top-k of layer 0
    shared = 2 * Is * q4_row(D) + D * q4_row(Is) + f32 * D              # + its (1, D) gate
    dense = f32 * 3 * Id * D                                            # layer 1's mlp
    norms = f32 * D * (2 * 2 + 1)
    head = f32 * V * D
    embedding = f32 * D
    with ColibriFile(qwen2_q4) as cf:
        got = bytes_per_token(cf)
    want = dict(attention=attention, router=router, experts=experts, shared=shared,
                dense=dense, norms=norms, head=head, embedding=embedding)
    assert {k: got[k] for k in want} == want
    assert got["total"] == sum(want.values())


def test_bytes_per_token_tied_q8_by_hand(hf_checkpoint, tmp_path):
    """Tied embeddings: the head reads the whole (bf16) embedding matrix; q8 attention."""
    src = hf_checkpoint("qwen3_moe", tie_word_embeddings=True)
    out = convert(src, tmp_path / "t.colibri", dtype="bf16", quant="q8", group_size=32,
                  quantize="experts,attn", progress=False)
    c = TINY_CONFIGS["qwen3_moe"][1]
    D, V, H, Hkv, Dh = c["hidden_size"], c["vocab_size"], c["num_attention_heads"], \
        c["num_key_value_heads"], c["head_dim"]
    L, K, I = c["num_hidden_layers"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    attention = L * ((H * Dh + 2 * Hkv * Dh) * q8_row(D) + D * q8_row(H * Dh)
                     + 4 * 2 * Dh)                                       # q_norm, k_norm (Dh,) f32
    with ColibriFile(out) as cf:
        assert "lm_head" not in cf.tensors
        got = bytes_per_token(cf)
    assert got["attention"] == attention
    assert got["router"] == L * 4 * c["num_experts"] * D
    assert got["experts"] == L * K * (2 * I * q8_row(D) + D * q8_row(I))
    assert got["head"] == 2 * V * D and got["embedding"] == 2 * D
    assert got["shared"] == got["dense"] == 0
    assert got["norms"] == 4 * D * (2 * L + 1)


# --------------------------------------------------------------------------------------------
# rows
# --------------------------------------------------------------------------------------------

def test_rows_shape_and_arithmetic(rows, qwen2_q4):
    assert [(r["n_threads"], r["test"]) for r in rows] == [
        (t, name) for t in (1, 2) for name in ("pp4", "pp6", "tg3")]
    with ColibriFile(qwen2_q4) as cf:
        per_token, size = bytes_per_token(cf), cf.file_size
    for r in rows:
        assert r["model"] == "q" and r["family"] == "qwen2_moe" and r["size_bytes"] == size
        assert r["format"] == "f32+q4" and r["isa"] in runtime.available_isas()
        assert 0 < r["n_params_active"] < r["n_params"]
        n = r["n_prompt"] or r["n_gen"]
        assert (r["n_prompt"] == 0) != (r["n_gen"] == 0) and r["n_depth"] == 0
        assert len(r["samples_s"]) == len(r["samples_ts"]) == r["reps"] == 2
        np.testing.assert_allclose(r["samples_ts"], [n / s for s in r["samples_s"]])
        assert r["avg_ts"] == pytest.approx(np.mean(r["samples_ts"]))
        assert r["stddev_ts"] == pytest.approx(np.std(r["samples_ts"], ddof=1))
        assert r["open_ms"] > 0 and r["peak_rss_bytes"] > 2**20
        share = r["time_share"]
        assert set(share) == {"router", "experts", "attention", "head", "other"}
        assert all(v >= 0 for v in share.values())
        assert sum(share.values()) == pytest.approx(1, abs=1e-6)
        assert share["experts"] * sum(r["samples_s"]) == pytest.approx(
            sum(r["stage_seconds"][k] for k in ("experts", "shared", "dense")))
        assert r["bytes_per_token_detail"] == per_token
        assert r["bytes_per_token"] == per_token["total"]
        assert r["read_bandwidth_gbs"] > 0
        assert r["ceiling_ts"] == pytest.approx(r["read_bandwidth_gbs"] * 1e9 / per_token["total"])
        if r["n_gen"]:
            assert r["ceiling_fraction"] == pytest.approx(r["avg_ts"] / r["ceiling_ts"])
        else:
            assert r["ceiling_fraction"] is None


def test_depth_no_warmup_and_no_bandwidth(qwen2_q4):
    rows = run_bench(qwen2_q4, n_prompt=3, n_gen=0, threads=1, reps=1, depth=5, warmup=False,
                     bandwidth_bytes=0)
    (r,) = rows
    assert r["test"] == "pp3 @ d5" and r["n_depth"] == 5 and r["warmup"] is False
    assert r["stddev_ts"] == 0.0
    assert r["read_bandwidth_gbs"] is None and r["ceiling_ts"] is None
    text = format_markdown(rows)
    assert "pp3 @ d5" in text and "roofline" not in text      # no tg row, no roofline line


def test_activations_rows(qwen2_q4):
    rows = run_bench(qwen2_q4, n_prompt=3, n_gen=2, threads=1, reps=1, bandwidth_bytes=0,
                     activations=["f32", "int8"])
    assert [(r["activations"], r["test"]) for r in rows] == [
        ("f32", "pp3"), ("f32", "tg2"), ("int8", "pp3"), ("int8", "tg2")]
    assert all(r["load_average"] is None or r["load_average"] >= 0 for r in rows)
    lines = format_markdown(rows).splitlines()
    at = COLUMNS.index("acts")
    table = [[c.strip() for c in l.strip("|").split("|")] for l in lines[2:] if l.startswith("|")]
    assert [cells[at] for cells in table] == ["f32", "f32", "int8", "int8"]
    assert any(l.startswith("load average (1 min) when the tests started") for l in lines)


def _bw_rows(bw1, bw2, backoffs=0):
    return [{"n_threads": t, "read_bandwidth_gbs": bw, "load_average": 1.5, "spin_us": 500,
             "pool_backoffs": backoffs if t == 2 else 0, "test": "tg4"}
            for t, bw in ((1, bw1), (2, bw2))]


def test_machine_notes_warn_when_workers_were_preempted():
    notes = format_machine_notes(_bw_rows(20.0, 35.0, backoffs=3))
    assert len(notes) == 2 and notes[1].startswith(
        "warning: worker threads were preempted while waiting for work (tg4 at 2 threads)")


def test_machine_notes_warn_when_threads_do_not_scale():
    busy = format_machine_notes(_bw_rows(20.0, 19.0))
    assert busy[0].startswith("load average (1 min) when the tests started: 1.50")
    assert "worker spin 500 us" in busy[0]
    assert len(busy) == 2 and busy[1].startswith("warning: read bandwidth with 2 threads "
                                                 "(19.0 GB/s) is not above 1 thread (20.0 GB/s)")
    assert len(format_machine_notes(_bw_rows(20.0, 35.0))) == 1          # scaled: no warning


@pytest.mark.parametrize("kwargs, match", [
    (dict(reps=0), "reps"),
    (dict(activations="int4"), "activations must be among f32, int8"),
    (dict(activations=[]), "activations must be among"),
    (dict(threads=[1, 0]), "threads"),
    (dict(n_prompt=0, n_gen=0), "nothing to run"),
    (dict(n_prompt=-1), "n_prompt"),
    (dict(depth=-2), "depth"),
    (dict(kv_dtype="q8"), "kv_dtype must be one of f32, f16, bf16"),
])
def test_run_bench_rejects_bad_arguments(qwen2_q4, kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_bench(qwen2_q4, **{"reps": 1, "bandwidth_bytes": 0, "threads": 1, **kwargs})


def test_run_bench_past_the_context_warns_and_runs(qwen2_q4):
    """As llama-bench, a test past the model's context runs (its speed is still measured)
    with a warning that the model's output may degrade there."""
    with pytest.warns(UserWarning, match="past this model's max_position_embeddings 256"):
        rows = run_bench(qwen2_q4, n_prompt=0, n_gen=2, depth=[0, 260], reps=1, warmup=False,
                         bandwidth_bytes=0, threads=1)
    assert [r["test"] for r in rows] == ["tg2", "tg2 @ d260"]


# --------------------------------------------------------------------------------------------
# text and JSON
# --------------------------------------------------------------------------------------------

def test_markdown_table_shape(rows):
    text = format_markdown(rows)
    lines = text.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == list(COLUMNS)
    assert set(lines[1].replace("|", "").split()) <= {"-" * n for n in range(1, 40)} | {
        "-" * n + ":" for n in range(1, 40)}
    table = [l for l in lines[2:] if l.startswith("|")]
    assert len(table) == len(rows)
    for line, r in zip(table, rows):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(COLUMNS)
        assert cells[COLUMNS.index("test")] == r["test"]
        assert cells[COLUMNS.index("threads")] == str(r["n_threads"])
        assert cells[COLUMNS.index("t/s")] == f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}"
    roof = [l for l in lines if l.startswith("roofline")]
    assert len(roof) == 2 and all("of the ceiling" in l and "tg3" in l for l in roof)
    assert any(l.startswith("open: ") for l in lines)


def test_cli_json_schema(qwen2_q4, capsys):
    assert main(["bench", str(qwen2_q4), "-p", "3", "-n", "2", "-t", "1", "-r", "1",
                 "--bw-mib", "1", "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out, list) and [r["test"] for r in out] == ["pp3", "tg2"]
    types = {"model": str, "model_path": str, "family": str, "size_bytes": int, "n_params": int,
             "n_params_active": int, "format": str, "test": str, "n_prompt": int, "n_gen": int,
             "n_depth": int, "n_threads": int, "isa": str, "reps": int, "samples_s": list,
             "samples_ts": list, "avg_ts": float, "stddev_ts": float, "open_ms": float,
             "peak_rss_bytes": int, "time_share": dict, "stage_seconds": dict,
             "bytes_per_token": int, "bytes_per_token_detail": dict,
             "read_bandwidth_gbs": float, "ceiling_ts": float, "colibri_version": str}
    for r in out:
        for key, kind in types.items():
            assert isinstance(r[key], kind), (key, r[key])
    assert out[0]["ceiling_fraction"] is None and isinstance(out[1]["ceiling_fraction"], float)
    assert json_ready({"x": [math.nan, 1.0]}) == {"x": [None, 1.0]}


def test_cli_markdown(qwen2_q4, capsys):
    assert main(["bench", str(qwen2_q4), "-p", "2", "-n", "2", "-t", "1", "-r", "1",
                 "--bw-mib", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| model ") and "| pp2 " in out and "| tg2 " in out
    assert "bandwidth not measured" in out


def _one_line(err: str) -> str:
    return one_line_error(err, "bench")


@pytest.mark.parametrize("argv, match", [
    (["-t", "0"], "values must be >= 1"),
    (["-t", "1,x"], "not an integer"),
    (["-p", "-4"], "values must be >= 0"),
    (["-r", "0"], "-r 0 is out of range"),
    (["-d", "-1"], "'-1': values must be >= 0"),
    (["-p", "0", "-n", "0"], "nothing to run"),
    (["-o", "csv"], "invalid choice: 'csv'"),
    (["--kv-dtype", "q8"], "--kv-dtype must be one of f32, f16, bf16"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["-a", "f32,f16"], "activations must be among f32, int8"),
])
def test_cli_argument_errors(qwen2_q4, capsys, argv, match):
    try:
        code = main(["bench", str(qwen2_q4), "--bw-mib", "0", "-r", "1", *argv])
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert match in _one_line(capsys.readouterr().err)


def test_cli_missing_model(tmp_path, capsys):
    assert main(["bench", str(tmp_path / "none.colibri")]) == 2
    assert "No such file" in _one_line(capsys.readouterr().err)


def test_cli_default_model(capsys):
    code = main(["bench", "-p", "2", "-n", "2", "-t", "1", "-r", "1", "--bw-mib", "0"])
    out, err = capsys.readouterr()
    assert code == 0 and "tiny-moe" in out
