"""Model-supplied tokenizer code under bounds (issue 15): the chat template in a sandbox with
step / time / size limits, a Rust panic of the tokenizer as a clear error naming the file,
texts too long to tokenize refused with the numbers, and check_tokenizer (what
`inspect --validate` calls) failing on each of those."""
from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("transformers")

from colibri.format import chat_template  # noqa: E402
from colibri.errors import ColibriError  # noqa: E402
from colibri.format.tokenizer import (MAX_TEXT_CHARS, Tokenizer, TokenizerError,  # noqa: E402
                                          check_tokenizer)
from test_tokenizer import CHAT_TEMPLATE, make_files  # noqa: E402

NESTED = ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
          "{{ messages[0].content }}")
DOUBLING = "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}"
REPEAT = "{{ 'x' * 10**9 }}"
OUTPUT = "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}"
BACKTRACKING = {"type": "Split", "pattern": {"Regex": "(a+)+b"}, "behavior": "Isolated",
                "invert": False}


def tok_with(template: str | None = None, pre_tokenizer: dict | None = None) -> Tokenizer:
    files = make_files(**({"chat_template.jinja": template} if template else {}))
    if pre_tokenizer is not None:
        tj = json.loads(files["tokenizer.json"])
        tj["pre_tokenizer"] = pre_tokenizer
        files["tokenizer.json"] = json.dumps(tj)
    return Tokenizer.from_files(files, source="hostile.colibri")


def test_an_ordinary_template_renders_as_transformers_does():
    tok = tok_with(CHAT_TEMPLATE)
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    want = tok.hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
    assert tok.apply_chat_template(msgs) == [int(i) for i in want]


@pytest.mark.parametrize("template, words", [(NESTED, "steps"), (DOUBLING, "concatenation"),
                                             (REPEAT, "repetition"), (OUTPUT, "output")])
def test_hostile_templates_end_with_a_clear_error(template, words):
    tok = tok_with(template)
    t0 = time.perf_counter()
    with pytest.raises(TokenizerError, match=words) as e:
        tok.apply_chat_template("hi")
    assert time.perf_counter() - t0 < chat_template.MAX_SECONDS + 5
    assert "hostile.colibri" in str(e.value)


def test_the_time_limit_stops_a_slow_template(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.2)
    monkeypatch.setattr(chat_template, "MAX_STEPS", 10**12)
    t0 = time.perf_counter()
    with pytest.raises(TokenizerError, match="took more than 0.2 s"):
        tok_with(NESTED).apply_chat_template("hi")
    assert time.perf_counter() - t0 < 3


def test_the_sandbox_refuses_python_internals():
    tok = tok_with("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")
    with pytest.raises(TokenizerError, match="template"):
        tok.apply_chat_template("hi")


def test_a_template_that_raises_names_its_message():
    tok = tok_with("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TokenizerError, match="roles must alternate"):
        tok.apply_chat_template("hi")


def test_a_tracer_in_place_is_restored():
    import sys
    seen = []

    def tracer(frame, event, arg):
        seen.append(event)
    sys.settrace(tracer)
    try:
        tok_with(CHAT_TEMPLATE).render_chat([{"role": "user", "content": "x"}])
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


def test_a_rust_panic_becomes_an_error_naming_the_file():
    tok = tok_with(pre_tokenizer=BACKTRACKING)
    with pytest.raises(TokenizerError, match="hostile.colibri.*panicked") as e:
        tok.encode("a" * 5000 + "c")
    assert isinstance(e.value, ColibriError)


def test_a_text_too_long_is_refused_with_the_numbers():
    tok = tok_with()
    n = MAX_TEXT_CHARS + 1
    t0 = time.perf_counter()
    with pytest.raises(TokenizerError, match=f"{n} characters, more than the {MAX_TEXT_CHARS}"):
        tok.encode("x" * n)
    assert time.perf_counter() - t0 < 1
    assert len(tok.encode("ab " * 1000, max_chars=None)) > 0


@pytest.mark.parametrize("bad, error", [(b"\xff".decode("utf-8", "surrogateescape"),
                                         TokenizerError), (42, TypeError), (None, TypeError)])
def test_bad_texts_are_named(bad, error):
    with pytest.raises(error, match="text"):
        tok_with().encode(bad)


def test_check_tokenizer_passes_a_good_one_and_names_each_fault():
    check_tokenizer(make_files(**{"chat_template.jinja": CHAT_TEMPLATE}), "good.colibri")
    with pytest.raises(TokenizerError, match="bad.colibri.*steps"):
        check_tokenizer(make_files(**{"chat_template.jinja": NESTED}), "bad.colibri")
    with pytest.raises(TokenizerError, match="bad.colibri.*vocabulary"):
        check_tokenizer(make_files(), "bad.colibri", vocab_size=3)
    files = make_files()
    files["tokenizer.json"] = files["tokenizer.json"][:-40]
    with pytest.raises(TokenizerError, match="bad.colibri"):
        check_tokenizer(files, "bad.colibri")
    files = make_files(**{"chat_template.jinja": "{% for %}"})
    with pytest.raises(TokenizerError, match="does not compile"):
        check_tokenizer(files, "bad.colibri")
