"""Chat templates rendered as untrusted code: sandboxed, and bounded in time, steps and size.

A chat template is Jinja source that comes with the model file, so it is code from whoever
made the file. It is rendered in jinja2's ImmutableSandboxedEnvironment (no attribute access
to Python internals, no mutation of the values passed in) with the globals and filters
transformers gives templates (raise_exception, strftime_now, tojson), plus three bounds a
sandbox alone does not give:

  - steps: every line the compiled template executes is counted (a trace function on the
    template's own frames only), at most MAX_STEPS per render: nested loops end;
  - time: the same trace function looks at the clock every few hundred steps, at most
    MAX_SECONDS per render;
  - size: the output is streamed (Template.generate) and refused past MAX_CHARS characters,
    and `*`, `**` and `+` refuse results past the same size before they are computed, so a
    string or list doubled in a loop cannot take the memory first.

Breaking a bound raises TemplateLimitError (a ColibriError) naming the bound, the limit and
how far the render got. Concatenation with `~` and filters are bounded by the step and time
limits only (docs/safety-api.md).
"""
from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from typing import Any

from ..errors import ColibriError

__all__ = ["render_chat_template", "TemplateLimitError", "MAX_STEPS", "MAX_SECONDS",
           "MAX_CHARS"]

MAX_STEPS = 2_000_000        # template lines executed per render (a 1,000-message chat: ~20k)
MAX_SECONDS = 5.0            # wall-clock seconds per render
MAX_CHARS = 4_000_000        # characters of output, and of any one string or list built
_CLOCK_EVERY = 256           # steps between two looks at the clock


class TemplateLimitError(ColibriError, ValueError):
    """A chat template broke one of the render bounds (steps, seconds, characters)."""


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: no HTML escaping, json.dumps's options
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _size(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, list, tuple, bytes)) else None


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox with `*`, `**` and `+` sized before they run."""
        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if _size(seq) is not None and isinstance(n, int) and n > 0 \
                            and _size(seq) * n > MAX_CHARS:
                        raise TemplateLimitError(
                            f"chat template: a repetition would make {_size(seq) * n} items "
                            f"(limit {MAX_CHARS})")
            elif operator == "**":
                if isinstance(left, int) and isinstance(right, int) and right > 64 \
                        and abs(left) > 1:
                    raise TemplateLimitError(f"chat template: {left} ** {right} is too large "
                                             f"(exponents up to 64)")
            elif operator == "+":
                a, b = _size(left), _size(right)
                if a is not None and b is not None and a + b > MAX_CHARS:
                    raise TemplateLimitError(f"chat template: a concatenation would make "
                                             f"{a + b} items (limit {MAX_CHARS})")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                             extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = None
_COMPILED: dict[str, Any] = {}      # template source -> compiled Template (few per process)


def _compile(source: str):
    global _ENV
    import jinja2
    if _ENV is None:
        _ENV = _environment()
    t = _COMPILED.get(source)
    if t is None:
        try:
            t = _ENV.from_string(source)
        except jinja2.TemplateError as e:
            raise ColibriError(f"the chat template does not compile: {e}") from None
        if len(_COMPILED) > 16:
            _COMPILED.clear()
        t = _COMPILED[source] = t
    return t


class _Bounds:
    """The trace function that counts a render's steps and watches its clock."""

    def __init__(self, code_names: set[str]):
        self.code_names = code_names
        self.steps = 0
        self.deadline = time.monotonic() + MAX_SECONDS

    def global_trace(self, frame, event, arg):
        # only the compiled template's frames are traced line by line
        if frame.f_code.co_filename in self.code_names:
            return self.local_trace
        return None

    def local_trace(self, frame, event, arg):
        if event == "line":
            self.steps += 1
            if self.steps > MAX_STEPS:
                raise TemplateLimitError(f"chat template: more than {MAX_STEPS} steps "
                                         f"(nested or very long loops); rendering stopped")
            if self.steps % _CLOCK_EVERY == 0 and time.monotonic() > self.deadline:
                raise TemplateLimitError(f"chat template: rendering took more than "
                                         f"{MAX_SECONDS:g} s ({self.steps} steps); stopped")
        return self.local_trace


def render_chat_template(source: str, messages: list[dict], add_generation_prompt: bool = True,
                         **context: Any) -> str:
    """The text of `messages` rendered with the template `source`, within the bounds above.

    context: what else the template sees (bos_token, eos_token, ... as transformers passes
    them). Raises TemplateLimitError past a bound, ColibriError for a template that does not
    compile or fails (raise_exception, an undefined operation), naming what it said.
    """
    import jinja2
    template = _compile(source)
    bounds = _Bounds({"<template>", template.filename or "<template>"})
    previous = sys.gettrace()
    pieces: list[str] = []
    total = 0
    sys.settrace(bounds.global_trace)
    try:
        for piece in template.generate(messages=messages,
                                       add_generation_prompt=add_generation_prompt, **context):
            total += len(piece)
            if total > MAX_CHARS:
                raise TemplateLimitError(f"chat template: the output passed {MAX_CHARS} "
                                         f"characters; rendering stopped")
            pieces.append(piece)
    except TemplateLimitError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, AttributeError, KeyError,
            IndexError, ZeroDivisionError, OverflowError, RecursionError, MemoryError) as e:
        raise ColibriError(f"the chat template failed: {type(e).__name__}: {e}") from None
    finally:
        sys.settrace(previous)
    return "".join(pieces)
