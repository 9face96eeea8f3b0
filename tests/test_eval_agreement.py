"""One model scored three ways gives the same per-sample numbers: `lm_eval --model hf` on a
random tiny Mixtral checkpoint made here with transformers, `colibri eval` on its f32
conversion, and lm-eval's `local-completions` (tokenizer_backend=remote: nothing but the
URL) against a real `colibri serve` on loopback. The shipped tasks cover loglikelihood
(multiple choice: four continuations of each context), loglikelihood_rolling (several
windows at max_length 64) and greedy generate_until.

Tolerance: f32 weights, f32 activations and an f32 KV cache on both sides, so the only
difference is the summation order of f32 arithmetic (torch's GEMMs vs colibri's kernels):
a sum of token log-probabilities within 1e-4 + 1e-5 x |value| (docs/evaluation.md).
The hf_factory tokenizer adds no BOS (lm-eval's remote tokenizer never asks for one;
tests/test_evaluate.py covers a BOS-adding tokenizer in process)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import run
from server_helpers import ServerProcess

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("torch")
pytest.importorskip("tenacity")        # lm-eval's API models (local-completions)
from lm_eval.tasks import TaskManager  # noqa: E402

TASKS = Path(__file__).parent / "data" / "lm_eval_tasks"
NAMES = ["colibri_mc", "colibri_ppl", "colibri_gen"]
MAX_LENGTH = 64
ATOL, RTOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def models(hf_checkpoint, tmp_path_factory):
    """(Hugging Face folder, its f32 .colibri conversion)."""
    from colibri.convert import convert
    hf = hf_checkpoint("mixtral", seed=3)
    return hf, convert(hf, tmp_path_factory.mktemp("agree") / "m.colibri", dtype="f32",
                       progress=False)


def answers(samples: dict) -> dict:
    """task -> [per document: its responses as plain lists], in document order."""
    out = {}
    for task, rows in samples.items():
        rows = sorted(rows, key=lambda r: r["doc_id"])
        out[task] = [[r[0] if isinstance(r[0], (list, tuple)) else [r[0]]
                      for r in row["resps"]] for row in rows]
    return out


@pytest.fixture(scope="module")
def by_hf(models):
    from tokenizers import Tokenizer
    hf, _ = models
    texts = [json.loads(line)["text"] for line in
             (TASKS / "colibri_text.jsonl").read_text().splitlines()]
    lengths = [len(Tokenizer.from_file(str(hf / "tokenizer.json")).encode(t).ids) for t in texts]
    assert max(lengths) > 2 * MAX_LENGTH            # rolling: several windows, truly
    res = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={hf},dtype=float32,device=cpu,"
                               f"max_length={MAX_LENGTH}",
        tasks=NAMES, batch_size=4, log_samples=True,
        task_manager=TaskManager(include_path=str(TASKS)))
    return answers(res["samples"])


def _flag(value) -> bool:
    """is_greedy as lm-eval keeps it: a bool in memory, "True"/"False" in samples files."""
    assert value in (True, False, "True", "False"), value
    return value in (True, "True")


def check_same(got: dict, want: dict, who: str) -> None:
    assert set(got) == set(want) == set(NAMES)
    for task in NAMES:
        assert len(got[task]) == len(want[task]) > 0, (who, task)
        for doc, (g, w) in enumerate(zip(got[task], want[task])):
            if task == "colibri_gen":
                assert g == w, (who, task, doc)
                continue
            np.testing.assert_allclose([float(x[0]) for x in g], [float(x[0]) for x in w],
                                       atol=ATOL, rtol=RTOL, err_msg=f"{who} {task} {doc}")
            if task == "colibri_mc":                      # is_greedy, choice by choice
                assert [_flag(x[1]) for x in g] == [_flag(x[1]) for x in w], (who, doc)


def test_colibri_eval_on_the_conversion_equals_lm_evals_hf_model(models, by_hf, capsys,
                                                                 tmp_path):
    _, path = models
    code, _, err = run(capsys, "eval", path, "--tasks", ",".join(NAMES), "--include-path",
                       TASKS, "--max-length", MAX_LENGTH, "--batch-size", 4, "-a", "f32",
                       "--kv-dtype", "f32", "-t", 1, "--output-path", tmp_path,
                       "--log-samples")
    assert code == 0, err
    samples = {}
    for task in NAMES:
        [f] = tmp_path.glob(f"*/samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in f.read_text().splitlines()]
    check_same(answers(samples), by_hf, "colibri eval")


def test_local_completions_against_colibri_serve_equals_lm_evals_hf_model(models, by_hf):
    """lm-eval 0.4.13's API models keep one token of max_length for the token they
    generate and rolling windows one shorter again: max_length 66 gives hf's windows of 64
    (and its truncation to 65 tokens). Its remote tokenizer takes a BOS of id 0 for none
    (`bos_token_id or eos_token_id`): custom_prefix_token_id says it (docs/evaluation.md)."""
    hf, path = models
    bos = json.loads((hf / "tokenizer.json").read_text())["added_tokens"][0]
    assert bos["content"] == "<|endoftext|>" and bos["id"] == 0     # the case lm-eval misreads
    bos = bos["id"]
    server = ServerProcess(str(path), "--activations", "f32", "--kv-dtype", "f32",
                           "--model-name", "tiny", "--parallel", "4")
    try:
        res = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"model=tiny,base_url={server.url}/v1/completions,"
                       f"tokenizer_backend=remote,max_length={MAX_LENGTH + 2},num_concurrent=2,"
                       f"max_retries=1,timeout=60,custom_prefix_token_id={bos}",
            tasks=NAMES, batch_size=4, log_samples=True,
            task_manager=TaskManager(include_path=str(TASKS)))
    finally:
        assert server.stop() == 0, server.log()
    check_same(answers(res["samples"]), by_hf, "local-completions")
