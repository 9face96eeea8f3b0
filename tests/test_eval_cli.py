"""`colibri eval`: lm-eval's evaluator on a .colibri file from the command line, writing
lm-eval's own results and samples files; the same numbers as ColibriLM in process; clear
one-line errors for what a user can get wrong."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from colibri.api import default_model_path

from cli_helpers import one_line_error, run

lm_eval = pytest.importorskip("lm_eval")

TASKS = Path(__file__).parent / "data" / "lm_eval_tasks"


def test_eval_writes_lm_evals_files_with_the_in_process_numbers(capsys, tmp_path):
    code, out, err = run(capsys, "eval", "--tasks", "colibri_mc,colibri_ppl", "--include-path",
                         TASKS, "--limit", 3, "--output-path", tmp_path / "out", "--log-samples",
                         "--seed", 7, "-t", 1, "--batch_size", 2)   # lm_eval's spelling too
    assert code == 0, err
    assert "colibri_mc" in out and "acc" in out and "bits_per_byte" in out   # lm-eval's table
    [folder] = (tmp_path / "out").iterdir()
    [results] = folder.glob("results_*.json")
    doc = json.loads(results.read_text())
    assert set(doc["results"]) == {"colibri_mc", "colibri_ppl"}
    assert f"pretrained={default_model_path()}" in doc["config"]["model_args"]
    assert doc["config"]["random_seed"] == 7 and doc["config"]["fewshot_seed"] == 7
    assert doc["n-samples"]["colibri_mc"] == {"original": 6, "effective": 3}
    samples = {}
    for task in ("colibri_mc", "colibri_ppl"):
        [f] = folder.glob(f"samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in f.read_text().splitlines()]
    assert len(samples["colibri_mc"]) == 3 and len(samples["colibri_ppl"]) == 2

    import colibri
    from colibri.evaluate import ColibriLM
    # the command's defaults (int16 activations, an f16 cache), the same batches
    with colibri.load(default_model_path(), threads=1) as model:
        ref = lm_eval.simple_evaluate(model=ColibriLM(model, batch_size=2),
                                      tasks=["colibri_mc", "colibri_ppl"],
                                      limit=3, log_samples=True,
                                      task_manager=lm_eval.tasks.TaskManager(
                                          include_path=str(TASKS)))
    for task, rows in samples.items():
        for got, want in zip(rows, ref["samples"][task]):
            assert got["doc_id"] == want["doc_id"]
            assert [float(r[0][0] if task == "colibri_mc" else r[0]) for r in got["resps"]] == \
                pytest.approx([float(r[0][0] if task == "colibri_mc" else r[0])
                               for r in want["resps"]], abs=1e-9)
    assert doc["results"]["colibri_mc"]["acc,none"] == ref["results"]["colibri_mc"]["acc,none"]


def test_apply_chat_template_renders_prompts_with_the_models_template(capsys, tmp_path,
                                                                      hf_checkpoint):
    from colibri.convert import convert
    path = convert(hf_checkpoint("mixtral"), tmp_path / "m.colibri", dtype="f32",
                   progress=False)
    code, _, err = run(capsys, "eval", path, "--tasks", "colibri_gen", "--include-path", TASKS,
                       "--limit", 2, "--apply-chat-template", "--system-instruction", "Be brief.",
                       "--output-path", tmp_path / "out", "--log-samples", "-t", 1)
    assert code == 0, err
    [f] = (tmp_path / "out").glob("*/samples_colibri_gen_*.jsonl")
    rows = [json.loads(line) for line in f.read_text().splitlines()]
    prompt = rows[0]["arguments"]["gen_args_0"]["arg_0"] if isinstance(
        rows[0]["arguments"], dict) else rows[0]["arguments"][0][0]
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("argv, what", [
    (["--tasks", "no_such_task"], "unknown task 'no_such_task'"),
    (["--tasks", "colibri_mc", "--include-path", "missing-folder"], "not a folder"),
    (["--tasks", "colibri_mc", "--fewshot-as-multiturn"], "needs --apply-chat-template"),
    (["--tasks", "colibri_mc", "--limit", "0"], "--limit"),
    (["--tasks", "colibri_mc", "--num-fewshot", "-1"], "--num-fewshot"),
])
def test_bad_arguments_are_one_line_errors(capsys, argv, what):
    if "--include-path" not in argv:
        argv = argv + ["--include-path", str(TASKS)]
    code, _, err = run(capsys, "eval", *argv, "-t", 1)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("colibri eval: error: ")]
    assert len(lines) == 1 and what in lines[0], err


@pytest.mark.parametrize("argv", [["--tasks", "x", "--batch-size", "0"],
                                  ["--tasks", "x", "--seed", "1,2"], []])
def test_usage_errors(capsys, argv):
    code, _, err = run(capsys, "eval", *argv)
    assert code == 2 and "colibri eval: error:" in err


def test_without_lm_eval_the_error_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    code, _, err = run(capsys, "eval", "--tasks", "colibri_mc")
    assert code == 2
    assert "pip install 'colibri[eval]'" in one_line_error(err, "eval")


def test_apply_chat_template_on_a_model_without_one_is_a_one_line_error(capsys, hf_checkpoint,
                                                                         tmp_path):
    import colibri
    from hf_factory import copy_checkpoint
    src = copy_checkpoint(hf_checkpoint("mixtral"), tmp_path / "hf")
    (src / "chat_template.jinja").unlink()
    plain = colibri.convert(src, tmp_path / "plain.colibri", progress=False)
    code, _, err = run(capsys, "eval", str(plain), "--tasks", "colibri_gen",
                       "--apply-chat-template", "--include-path", str(TASKS), "-t", 1)
    errors = [ln for ln in err.splitlines() if ln.startswith("colibri eval: error:")]
    assert code == 2 and "Traceback" not in err          # (stderr also holds lm-eval's bars)
    assert len(errors) == 1 and "no chat template" in errors[0]
