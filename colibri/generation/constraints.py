"""Structured output: a grammar decides which tokens may come next (llguidance).

    spec = constraints.compile_spec(json_schema={"type": "object", ...})   # or regex= / grammar=
    c = spec.start(model)                   # one per sequence: its own parser state
    x = c.mask(logits)                      # (V,) -> (V,), forbidden tokens -inf
    tok = sampler.choose(x); c.accept(tok)  # advance; c.done once the grammar is complete

The grammar engine is llguidance (used by vLLM, SGLang and llama.cpp): JSON schema, "any JSON
object", regular expressions and Lark grammars, compiled lazily against the model's vocabulary
(a bitmask of int32 words over the V tokens per step). It is an optional extra
(`pip install colibri[structured]`); without it a constraint is a MissingExtraError naming it.

The mask goes on after the penalties and before temperature / top-k / top-p / the draw, so
greedy and sampled output both stay inside the grammar; log-probabilities are those of the
masked logits (the distribution the token was drawn from). When the grammar is complete the
matcher allows only the end-of-sequence token(s): sampling one ends the sequence as a stop,
and a grammar with nothing more to add (`done`) ends it after its last token, so a sequence
whose stop ids do not include EOS still stops at the grammar's end.
"""
from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..errors import ColibriError

__all__ = ["ConstraintSpec", "Constraint", "ConstraintError", "MissingExtraError",
           "compile_spec", "JSON_OBJECT_SCHEMA"]

EXTRA = "structured"
# "any JSON object": the json_object response format of the OpenAI API
JSON_OBJECT_SCHEMA = {"type": "object"}
_MAX_SPEC_CHARS = 1 << 20           # a schema / grammar / regex longer than this is refused
# JSON as json.dumps writes it: free whitespace would let a weak model pad forever without
# ever breaking the grammar; a schema's own "x-guidance" options override these
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ColibriError, ValueError):
    """A JSON schema, regex or grammar the grammar library rejects (the message says why)."""


class MissingExtraError(ColibriError, ImportError):
    """Structured output was asked for but llguidance is not installed."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise MissingExtraError(
            f"structured output (json_schema / regex / grammar) needs the llguidance "
            f"package: pip install 'colibri[{EXTRA}]'") from None
    return llguidance


# ---------------------------------------------------------------------------------------------
# what the user asked for
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConstraintSpec:
    """A validated grammar in llguidance's serialised form; `kind` says what it came from
    ("json_schema" | "json_object" | "regex" | "lark"). Immutable: one spec serves any number
    of sequences, each through its own `start(model)`."""
    kind: str
    grammar: str

    def start(self, model_or_tokenizer, vocab_size: int | None = None) -> "Constraint":
        """A fresh Constraint (parser at the start) over the model's vocabulary."""
        tokenizer = getattr(model_or_tokenizer, "tokenizer", model_or_tokenizer)
        if vocab_size is None:
            vocab_size = getattr(model_or_tokenizer, "vocab_size", None)
        if tokenizer is None:
            raise ColibriError("structured output needs the model's tokenizer; this model file "
                               "carries none")
        return Constraint(_token_table(tokenizer, vocab_size), self)


def compile_spec(json_schema=None, regex: str | None = None, grammar: str | None = None,
                 json_object: bool = False) -> ConstraintSpec | None:
    """The ConstraintSpec of exactly one of: json_schema (a dict or its JSON text), regex (a
    Python/Rust-style regular expression the whole output must match), grammar (a Lark
    grammar, llguidance's dialect: `start: ...`, may embed %json{...}), json_object=True (any
    JSON object). None when none is given; ValueError when several are; ConstraintError
    naming the problem when llguidance rejects it."""
    given = [k for k, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar),
                            ("json_object", json_object or None)) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"give one constraint, not {' and '.join(given)}")
    # the same schema again (a server's clients send the same few): compiled once
    try:
        key = (given[0], json.dumps(json_schema, sort_keys=True)
               if isinstance(json_schema, (dict, bool)) else (json_schema or regex or grammar))
        hash(key)
    except (TypeError, ValueError):
        key = None
    with _specs_lock:
        spec = _specs.get(key) if key is not None else None
        if spec is not None:
            _specs.move_to_end(key)
            return spec
    spec = _compile(json_schema, regex, grammar, json_object)
    if key is not None:
        with _specs_lock:
            _specs[key] = spec
            while len(_specs) > _MAX_SPECS:
                _specs.popitem(last=False)
    return spec


_specs: "OrderedDict[tuple, ConstraintSpec]" = OrderedDict()     # LRU of compiled specs
_specs_lock = threading.Lock()
_MAX_SPECS = 64


def _compile(json_schema, regex, grammar, json_object) -> ConstraintSpec:
    ll = _llguidance()
    M = ll.LLMatcher
    if json_object:
        kind, text = "json_object", M.grammar_from_json_schema(JSON_OBJECT_SCHEMA, JSON_OPTIONS)
    elif json_schema is not None:
        kind = "json_schema"
        if isinstance(json_schema, (bytes, str)):
            _check_length("json_schema", json_schema)
            try:
                json_schema = json.loads(json_schema)
            except ValueError as e:
                raise ConstraintError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(json_schema, (dict, bool)):
            raise ConstraintError(f"json_schema must be a JSON object (a dict), got "
                                  f"{type(json_schema).__name__}")
        try:
            text = M.grammar_from_json_schema(json.dumps(json_schema), JSON_OPTIONS)
        except Exception as e:                      # noqa: BLE001 - whatever the library says
            raise ConstraintError(f"json_schema: {e}") from None
    elif regex is not None:
        kind = "regex"
        if not isinstance(regex, str):
            raise ConstraintError(f"regex must be a string, got {type(regex).__name__}")
        _check_length("regex", regex)
        text = _convert(M.grammar_from_regex, regex, "regex")
    else:
        kind = "lark"
        if not isinstance(grammar, str):
            raise ConstraintError(f"grammar must be a string (Lark), got "
                                  f"{type(grammar).__name__}")
        _check_length("grammar", grammar)
        text = _convert(M.grammar_from_lark, grammar, "grammar")
    is_error, messages = M.validate_grammar_with_warnings(text)
    if is_error:
        what = {"json_object": "json_object", "lark": "the grammar"}.get(kind, f"the {kind}")
        raise ConstraintError(f"{what} is not accepted by llguidance: "
                              f"{' '.join(messages[0].split())[:500]}")
    return ConstraintSpec(kind, text)


def _convert(how, source: str, name: str) -> str:
    try:
        return how(source)
    except Exception as e:                          # noqa: BLE001 - whatever the library says
        raise ConstraintError(f"{name}: {e}") from None


def _check_length(name: str, text) -> None:
    if len(text) > _MAX_SPEC_CHARS:
        raise ConstraintError(f"{name} has {len(text)} characters, more than the "
                              f"{_MAX_SPEC_CHARS} accepted")


# ---------------------------------------------------------------------------------------------
# the vocabulary as llguidance sees it (built once per tokenizer: ~0.1-1 s)
# ---------------------------------------------------------------------------------------------

_tables: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


def _token_table(tokenizer, vocab_size: int | None):
    """llguidance's LLTokenizer for a colibri Tokenizer (its fast HF tokenizer), sized to the
    model's vocabulary (embedding rows past the tokenizer's ids are never allowed)."""
    _llguidance()
    key = int(vocab_size) if vocab_size is not None else None
    with _tables_lock:
        per_size = _tables.setdefault(tokenizer, {})
        table = per_size.get(key)
        if table is None:
            from llguidance.hf import from_tokenizer
            hf = getattr(tokenizer, "hf", tokenizer)
            eos = list(getattr(tokenizer, "eos_token_ids", []) or []) or None
            try:
                table = from_tokenizer(hf, n_vocab=key, eos_token=eos)
            except Exception as e:              # noqa: BLE001 - e.g. a slow tokenizer
                raise ColibriError(f"structured output cannot use this model's tokenizer: "
                                   f"{type(e).__name__}: {e}") from None
            per_size[key] = table
        return table


# ---------------------------------------------------------------------------------------------
# one sequence's state
# ---------------------------------------------------------------------------------------------

class Constraint:
    """The grammar state of one sequence: mask(logits) before each draw, accept(token) after.

    eos_ids: the tokens the grammar allows once it is complete (the tokenizer's EOS ids);
    done: the grammar can add nothing more (the sequence ends after its last token).
    """

    def __init__(self, table, spec: ConstraintSpec):
        ll = _llguidance()
        self.spec = spec
        self.vocab_size = int(table.vocab_size)
        self.eos_ids = frozenset(int(t) for t in table.eos_tokens)
        self._matcher = ll.LLMatcher(table, spec.grammar, log_level=0)
        self._raise_if_error("starting")
        self._words = np.full((self.vocab_size + 31) // 32, -1, dtype=np.int32)

    def _raise_if_error(self, doing: str) -> None:
        if self._matcher.is_error():
            raise ConstraintError(f"the {self.spec.kind} constraint failed while {doing}: "
                                  f"{' '.join(self._matcher.get_error().split())[:500]}")

    @property
    def done(self) -> bool:
        """True when the grammar is complete and can take no further token."""
        return self._matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """bool (V,): the tokens the grammar allows next (computed here, on the calling
        thread: a worker thread overlapping the forward pass measured slower on 2 busy
        cores, the hand-off costing more than the mask; docs/structured-output.md)."""
        w = self._words
        self._matcher.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)
        self._raise_if_error("computing the token mask")
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little",
                             count=self.vocab_size)
        return bits.view(bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """logits (V,) with every token the grammar forbids set to -inf (a new float32 array;
        the input is not changed)."""
        x = np.asarray(logits)
        V = x.shape[-1]
        allowed = self.allowed()
        out = np.full(V, -np.inf, dtype=np.float32)
        n = min(V, self.vocab_size)
        np.copyto(out[:n], x[:n], where=allowed[:n])
        return out

    def accept(self, token: int) -> bool:
        """Advance over `token`; True when it ended the grammar (an EOS the grammar allowed
        at its end), which the caller treats as a stop."""
        token = int(token)
        end = token in self.eos_ids and self._matcher.is_accepting()
        if not self._matcher.consume_token(token):
            self._raise_if_error(f"taking token {token}")
            raise ConstraintError(f"the {self.spec.kind} constraint refused token {token}")
        return end

    def __repr__(self) -> str:
        return f"Constraint({self.spec.kind}, done={self.done})"


def constrained_choice(sampler, x: np.ndarray, constraint: Constraint | None
                       ) -> tuple[int, np.ndarray, bool]:
    """(token, the logits it was drawn from, ended): sampler.choose over x (V,) penalised
    logits, masked first when there is a constraint, which then takes the token; ended is True
    when the token closed the grammar (an EOS at its end: a stop, not part of the output).
    The one hook the decode loop (batching.Scheduler) calls."""
    if constraint is None:
        return sampler.choose(x), x, False
    x = constraint.mask(x)
    tok = sampler.choose(x)
    return tok, x, constraint.accept(tok)
