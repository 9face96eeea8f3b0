"""Structured output (colibri.generation.constraints over llguidance): the spec checks, the token
mask against the vocabulary's own text, and generate / the batched Scheduler producing output that
parses, on the shipped model and on random tiny models, greedy and sampled."""
from __future__ import annotations

import json
import re
import sys

import jsonschema
import numpy as np
import pytest

import colibri.api as api
from colibri.generation import constraints as C
from colibri.generation.batching import SamplingParams, Scheduler
from colibri.convert import convert

# bounded, so that even a random model reaches the end inside the token budget
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", None]},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
          "required": ["name", "age", "pet", "tags"], "additionalProperties": False}
REGEX = r"(red|green|blue)-[0-9]{2,4}"
LARK = 'start: "answer: " ANSWER\nANSWER: "yes" | "no" | "maybe"'


@pytest.fixture(scope="module")
def shipped():
    m = api.load(None, threads=1)
    yield m
    m.close()


@pytest.fixture(scope="module", params=["qwen2_moe", "mixtral"])
def random_model(request, hf_checkpoint, tmp_path_factory):
    src = hf_checkpoint(request.param, initializer_range=0.3)
    out = convert(src, tmp_path_factory.mktemp("cons") / "m.colibri", dtype="f32",
                  progress=False)
    m = api.load(out, threads=1)
    yield m
    m.close()


def check_output(kind: str, text: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert re.fullmatch(r"answer: (yes|no|maybe)", text), text


KINDS = {"json_schema": dict(json_schema=PERSON), "regex": dict(regex=REGEX),
         "lark": dict(grammar=LARK)}


# ---------------------------------------------------------------------------------------------
# specs
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    (dict(json_schema={"type": "nope"}), "json_schema.*nope"),
    (dict(json_schema="{not json"), "json_schema is not valid JSON"),
    (dict(json_schema=[1, 2]), "JSON object"),
    (dict(regex="a(b"), "regex.*unclosed group"),
    (dict(grammar="start: undefined_rule"), "grammar.*undefined_rule"),
])
def test_a_spec_llguidance_rejects_names_the_problem(kwargs, words):
    with pytest.raises(C.ConstraintError, match=words):
        C.compile_spec(**kwargs)


def test_one_constraint_at_a_time_and_none_is_none():
    assert C.compile_spec() is None
    with pytest.raises(ValueError, match="json_schema and regex"):
        C.compile_spec(json_schema=PERSON, regex="a")


def test_missing_llguidance_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)      # import llguidance fails
    with pytest.raises(C.MissingExtraError, match=r"colibri\[structured\]"):
        C.compile_spec(regex="a")


# ---------------------------------------------------------------------------------------------
# the mask against the vocabulary's own text
# ---------------------------------------------------------------------------------------------

def test_mask_allows_exactly_the_tokens_that_continue_the_grammar(shipped):
    """At the start of 'start: "yes" | "no"' a token is allowed iff its text is a non-empty
    prefix of "yes" or "no" (no special tokens), checked on every id of the vocabulary."""
    tok = shipped.tokenizer
    c = C.compile_spec(grammar='start: "yes" | "no"').start(shipped)
    texts = [tok.decode([i]) for i in range(shipped.vocab_size)]
    expect = np.array([bool(t) and i not in tok.eos_token_ids
                       and ("yes".startswith(t) or "no".startswith(t))
                       for i, t in enumerate(texts)])
    allowed = c.allowed().copy()
    assert expect.sum() >= 2
    assert np.array_equal(allowed, expect), np.flatnonzero(allowed != expect)
    logits = np.random.default_rng(0).standard_normal(shipped.vocab_size).astype(np.float32)
    x = c.mask(logits)
    assert np.array_equal(x[allowed], logits[allowed])
    assert np.all(np.isneginf(x[~allowed]))


def test_the_grammar_end_allows_only_eos_and_is_a_stop(shipped):
    tok = shipped.tokenizer
    c = C.compile_spec(regex="ab").start(shipped)
    for t in tok.encode("ab", add_special_tokens=False):
        assert not c.accept(t)
    allowed = np.flatnonzero(c.allowed())
    assert set(allowed.tolist()) == set(tok.eos_token_ids)
    assert c.accept(tok.eos_token_ids[0]) is True


# ---------------------------------------------------------------------------------------------
# generate: always parses
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(KINDS))
def test_shipped_model_output_parses_greedy_and_sampled(shipped, kind):
    for temperature, seed in ((0.0, None), (1.0, 0), (1.0, 1), (1.3, 2)):
        text = api.generate(shipped, "Once upon a time", max_new_tokens=200,
                            temperature=temperature, seed=seed, **KINDS[kind])
        assert shipped.last_stats.finish_reason == "stop"
        check_output(kind, text)


def test_random_models_output_parses_single_and_batched(random_model):
    """Random weights put their mass anywhere: the mask alone keeps the output valid. The
    batched path gives each sequence its own constraint (three kinds in one batch)."""
    m = random_model
    for kind in sorted(KINDS):
        for temperature, seed in ((0.0, None), (1.0, 3)):
            text = api.generate(m, "hello", max_new_tokens=150, temperature=temperature,
                                seed=seed, **KINDS[kind])
            check_output(kind, text)
    sched = Scheduler(m, parallel=3, ctx=256)
    kinds = sorted(KINDS) * 2
    handles = [sched.submit(m.tokenizer.encode(f"prompt {i}"),
                            SamplingParams(max_tokens=150, temperature=1.0, seed=i,
                                           constraint=C.compile_spec(**KINDS[k])))
               for i, k in enumerate(kinds)]
    sched.stop(drain=True)
    for k, h in zip(kinds, handles):
        events = list(h)
        assert events[-1].finish_reason == "stop"
        check_output(k, "".join(ev.text for ev in events))


def test_batched_greedy_equals_one_at_a_time(shipped):
    prompts = ["Once upon a time", "The code", "def f(x):"]
    alone = [api.generate(shipped, p, max_new_tokens=120, json_schema=PERSON) for p in prompts]
    together = api.generate(shipped, prompts, max_new_tokens=120, json_schema=PERSON)
    assert together == alone
    for text in together:
        check_output("json_schema", text)


def test_stops_at_the_grammar_end_without_an_eos_stop(shipped):
    """stop=[] (no stop ids): the grammar's completion ends the sequence all the same."""
    for temperature in (0.0, 1.0):
        text = api.generate(shipped, "Once upon a time", max_new_tokens=50, stop=[],
                            temperature=temperature, seed=0, grammar='start: "yes" | "no"')
        assert text in ("yes", "no")
        assert shipped.last_stats.finish_reason == "stop"
        assert shipped.last_stats.generated_tokens <= 3


def test_logprobs_are_those_of_the_masked_distribution(shipped):
    sched = Scheduler(shipped, parallel=1, ctx=128)
    h = sched.submit(shipped.tokenizer.encode("Once"),
                     SamplingParams(max_tokens=8, logprobs=5,
                                    constraint=C.compile_spec(regex="(cat|dog)")))
    sched.stop(drain=True)
    events = [ev for ev in h if ev.token >= 0]
    assert "".join(ev.text for ev in events) in ("cat", "dog")
    first = events[0]
    tok = shipped.tokenizer
    for tid, lp in first.top_logprobs:
        if np.isfinite(lp):
            assert "cat".startswith(tok.decode([tid])) or "dog".startswith(tok.decode([tid]))
    assert np.exp([lp for _, lp in first.top_logprobs]).sum() <= 1 + 1e-6


def test_max_tokens_cut_a_constrained_output_short_as_length(shipped):
    text = api.generate(shipped, "Once", max_new_tokens=3, json_schema=PERSON)
    assert shipped.last_stats.finish_reason == "length"
    assert '{"name": "'.startswith(text) or text.startswith('{"')
