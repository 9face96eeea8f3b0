"""colibri.evaluate.ColibriLM through lm-eval's own evaluator (lm_eval.simple_evaluate) on the
tasks shipped in tests/data/lm_eval_tasks (nothing downloaded): every loglikelihood,
rolling and generate_until answer against the model run directly (one cache-free
Model.forward per sequence, colibri.generate), tokens encoded by the test from the
tokenizer as lm-eval's hf model encodes them. tests/test_eval_agreement.py checks the same
numbers against lm-eval's hf model and through the server."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import colibri
from colibri.api import default_model_path
from colibri.errors import ColibriError
from colibri.extras import MissingExtra
from colibri.generation.sampling import log_softmax

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

from colibri.evaluate import ColibriLM  # noqa: E402

TASKS = Path(__file__).parent / "data" / "lm_eval_tasks"
TOL = 1e-4          # ragged batches vs one sequence alone: the projections' summation order
RTOL = 1e-5         # and relative to the sum: a continuation's log p sums f32 rows of ~30-40
                    # nats (one Intel Xeon: 1.4e-4 apart at -43.05, 3.3e-6 relative)


@pytest.fixture(scope="module")
def model():
    m = colibri.load(default_model_path(), threads=1, kv_dtype="f32")
    yield m
    m.close()


@pytest.fixture(scope="module")
def tasks():
    return TaskManager(include_path=str(TASKS))


def evaluate(lm, tasks, names, **kwargs) -> dict:
    return lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=tasks, log_samples=True,
                                   **kwargs)


def reference(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """(sum of log p(cont[i] | ctx + cont[:i]), greedy) from one Model.forward."""
    ids = np.array(ctx + cont)
    rows = model.forward(ids)[len(ctx) - 1:len(ids) - 1]
    lp = sum(float(log_softmax(r)[t]) for r, t in zip(rows, cont))
    return lp, all(int(np.argmax(r)) == t for r, t in zip(rows, cont))


def hf_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's hf encoding of a pair, written out: the context's trailing spaces go to the
    continuation, the whole text is encoded with the tokenizer's own special tokens, the
    context's ids are split off."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


@pytest.mark.parametrize("batch_size", [1, 16])
def test_multiple_choice_scores_are_the_models_own(model, tasks, batch_size):
    lm = ColibriLM(model, batch_size=batch_size)
    out = evaluate(lm, tasks, ["colibri_mc"])
    samples = out["samples"]["colibri_mc"]
    assert len(samples) == 6
    tok = model.tokenizer.hf
    correct = 0
    for s in samples:
        got = [tuple(r[0]) for r in s["resps"]]
        assert len(got) == 4
        want = []
        for context, continuation in s["arguments"]:
            ctx, cont = hf_pair(tok, context, continuation)
            assert ctx[0] == model.tokenizer.bos_token_id        # this tokenizer adds BOS
            want.append(reference(model, ctx, cont))
        np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], atol=TOL,
                                   rtol=RTOL)
        assert [bool(g[1]) for g in got] == [w[1] for w in want]
        correct += int(np.argmax([w[0] for w in want]) == s["target"])
    assert out["results"]["colibri_mc"]["acc,none"] == pytest.approx(correct / 6)


def test_rolling_windows_sum_to_the_texts_log_likelihood(model, tasks):
    """max_length 16 cuts each text into several of lm-eval's rolling windows; each window
    is scored from an empty cache, as the hf model does."""
    from lm_eval import utils
    lm = ColibriLM(model, max_length=16)
    out = evaluate(lm, tasks, ["colibri_ppl"])
    for s in out["samples"]["colibri_ppl"]:
        ids = model.tokenizer.encode(s["doc"]["text"], max_chars=None, verbose=False)
        windows = list(map(utils.make_disjoint_window, utils.get_rolling_token_windows(
            ids, prefix_token=model.tokenizer.bos_token_id, max_seq_len=16, context_len=1)))
        assert len(windows) > 2
        want = sum(reference(model, list(c), list(t))[0] for c, t in windows)
        assert s["resps"][0][0] == pytest.approx(want, abs=TOL * len(windows))
    # the texts fit: one window, every token (the BOS this tokenizer adds too, as lm-eval's
    # hf model scores it) after the prefix token
    whole = ColibriLM(model)
    doc = out["samples"]["colibri_ppl"][0]["doc"]["text"]
    ids = model.tokenizer.encode(doc, max_chars=None)
    [got] = whole.loglikelihood_rolling([_Instance((doc,))], disable_tqdm=True)
    want = reference(model, [model.tokenizer.bos_token_id], ids)[0]
    assert got == pytest.approx(want, abs=TOL)


class _Instance:
    def __init__(self, args):
        self.args = args


def test_generate_until_is_greedy_generation_cut_at_the_stops(model, tasks):
    lm = ColibriLM(model, batch_size=4)
    out = evaluate(lm, tasks, ["colibri_gen"])
    samples = out["samples"]["colibri_gen"]
    assert len(samples) == 6
    for s in samples:
        [[text]] = s["resps"]
        [(prompt, gen_kwargs)] = s["arguments"]
        assert gen_kwargs["until"] == ["\n"] and gen_kwargs["max_gen_toks"] == 8
        ids = model.tokenizer.encode(prompt)
        alone = model.generate(ids, max_new_tokens=8)
        want = model.tokenizer.decode(alone.tolist()).split("\n")[0]
        assert text == want


def test_model_by_path_and_by_lm_evals_registry_name(tasks, tmp_path):
    out = evaluate("colibri", tasks, ["colibri_mc"], limit=2,
                   model_args=f"pretrained={default_model_path()},threads=1,batch_size=2")
    assert len(out["samples"]["colibri_mc"]) == 2
    lm = ColibriLM(str(default_model_path()), threads=1)
    try:
        assert lm.max_length == lm.model.max_context
        assert lm.get_model_info()["model_family"] == lm.model.config.family
    finally:
        lm.close()


def test_add_bos_token_forces_the_tokenizers_setting(model):
    text = "The capital of France is"
    assert ColibriLM(model).tok_encode(text)[0] == model.tokenizer.bos_token_id
    assert ColibriLM(model, add_bos_token="false").tok_encode(text) == \
        model.tokenizer.encode(text, add_special_tokens=False)
    bos = model.tokenizer.decode([model.tokenizer.bos_token_id])
    assert ColibriLM(model).tok_encode(bos + text).count(model.tokenizer.bos_token_id) == 1


@pytest.mark.parametrize("kwargs, what", [
    ({"batch_size": 0}, "batch_size"), ({"batch_size": "many"}, "batch_size"),
    ({"max_length": 1}, "max_length"), ({"batch_tokens": 0}, "batch_tokens"),
    ({"add_bos_token": "maybe"}, "add_bos_token"),
])
def test_bad_arguments_name_themselves(model, kwargs, what):
    with pytest.raises(ValueError, match=what):
        ColibriLM(model, **kwargs)


def test_no_model_and_no_tokenizer_are_clear_errors(hf_checkpoint, tmp_path):
    from colibri.convert import convert
    with pytest.raises(ValueError, match="needs a model"):
        ColibriLM()
    with pytest.warns(UserWarning, match="no tokenizer"):
        path = convert(hf_checkpoint("mixtral", tokenizer=False), tmp_path / "m.colibri",
                       dtype="f32", progress=False)
    with pytest.raises(ColibriError, match="no tokenizer"):
        ColibriLM(str(path), threads=1)


def test_without_lm_eval_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.delitem(sys.modules, "colibri.evaluate")
    with pytest.raises(MissingExtra, match=r"pip install 'colibri\[eval\]'"):
        import colibri.evaluate  # noqa: F401
