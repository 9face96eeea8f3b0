"""One set of rules for the sampling settings: colibri.generate's Sampler, the scheduler's
SamplingParams, the server's request schema, `colibri serve`'s defaults and `colibri generate`'s
flags accept and refuse the same values (colibri.generation.sampling.REAL_BOUNDS)."""
import math
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from colibri.commands.generate import _check
from colibri.errors import ColibriError
from colibri.generation.sampling import REAL_BOUNDS, Sampler, SamplingParams, SettingTypeError
from colibri.server.schemas import ChatCompletionRequest, CompletionRequest
from colibri.server.settings import Settings

CLI_FLAG = {"temperature": "temp", "top_p": "top_p", "min_p": "min_p",
            "repetition_penalty": "repeat_penalty"}


def edges(name):
    """(values every face accepts, values every face refuses) for REAL_BOUNDS[name]."""
    lo, hi, lo_open = REAL_BOUNDS[name]
    inside = [hi, (lo + hi) / 2] + ([] if lo_open else [lo])
    outside = [math.nextafter(hi, math.inf), math.nextafter(lo, -math.inf), math.inf,
               -math.inf, math.nan] + ([lo] if lo_open else [])
    return inside, outside


def faces(name, value):
    """Whether each face accepts `value` for setting `name`: {face: bool}."""
    out = {}

    def accepts(face, fn):
        try:
            fn()
            out[face] = True
        except (ValueError, ValidationError, ColibriError):
            out[face] = False

    accepts("Sampler", lambda: Sampler(**{name: value}))
    accepts("SamplingParams", lambda: SamplingParams(**{name: value}).check())
    if math.isfinite(value):      # JSON has no NaN / inf (their refusal: test_server_errors)
        accepts("completions", lambda: CompletionRequest(prompt="x", **{name: value}))
        accepts("chat", lambda: ChatCompletionRequest(
            messages=[{"role": "user", "content": "x"}], **{name: value}))
    if name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        accepts("serve --defaults", lambda: Settings(defaults={name: value}).check())
        args = SimpleNamespace(prompt="hi", embeddings=None, chat=False, max_new_tokens=4,
                               temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                               threads=None, ctx=None)
        setattr(args, CLI_FLAG[name], value)
        accepts("generate flags", lambda: _check(args))
    return out


@pytest.mark.parametrize("name", sorted(REAL_BOUNDS))
def test_every_face_accepts_and_refuses_the_same_values(name):
    inside, outside = edges(name)
    for v in inside:
        got = faces(name, v)
        assert all(got.values()), (name, v, got)
    for v in outside:
        got = faces(name, v)
        assert not any(got.values()), (name, v, got)


def test_the_refusal_names_the_setting_the_value_and_the_range():
    with pytest.raises(ValueError, match=r"presence_penalty must be a finite number in "
                                         r"\[-2, 2\], got 2\.5"):
        Sampler(presence_penalty=2.5)
    with pytest.raises(ValueError, match=r"top_p must be a finite number in \(0, 1\], got 0"):
        SamplingParams(top_p=0).check()


def test_a_wrong_type_is_a_type_error_and_a_value_error():
    with pytest.raises(SettingTypeError, match="temperature must be a number, got '0.5'"):
        Sampler(temperature="0.5")
    for err in (TypeError, ValueError):           # Python's convention, and a request's 400
        with pytest.raises(err):
            SamplingParams(top_k=2.5).check()
