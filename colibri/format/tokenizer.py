"""The model's tokenizer, rebuilt from the files embedded in the .colibri metadata.

The files (tokenizer.json, tokenizer_config.json, special_tokens_map.json,
generation_config.json, chat_template.jinja) are the Hugging Face ones, kept as text. The
tokenizer is built in memory with `tokenizers.Tokenizer.from_str` wrapped in transformers'
`PreTrainedTokenizerFast` (which brings special tokens and `apply_chat_template`); only if
that fails is the folder written to a temporary directory for `AutoTokenizer`. No BPE is
implemented here. tokenizers and transformers are imported when a tokenizer is first built,
not at `import colibri`: transformers alone takes longer to import (~0.6 s) than the whole
package, and a model used with token ids never needs it.

Model-supplied code is bounded: the chat template renders in colibri.format.chat_template's
sandbox (steps, seconds and characters capped); a text longer than MAX_TEXT_CHARS is refused before
it is tokenized (2M characters take ~4 s to tokenize on one core, measured in
docs/safety-api.md); a Rust panic of the tokenizers library (pyo3's PanicException, a
BaseException: e.g. a backtracking pre-tokenizer regex hitting Oniguruma's retry limit)
becomes a TokenizerError naming the model file. `check_tokenizer` builds and exercises a
tokenizer once, for `colibri inspect --validate`.

`IncrementalDecoder` turns a growing list of ids into text pieces for streaming: a piece is
emitted only once it decodes to complete characters, so a multi-byte character split over
several byte-level tokens never shows up as U+FFFD.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from ..errors import ColibriError
from ..resources import TOKENIZER_ADDRESS_SPACE, check_allocation
from .chat_template import render_chat_template

__all__ = ["Tokenizer", "IncrementalDecoder", "NoTokenizerError", "TokenizerError",
           "tokenizer_from_files", "check_tokenizer", "MAX_TEXT_CHARS"]

# Longest text encode() takes unless told otherwise: ~2 s of tokenizing on one core (1M
# characters of English ~ 0.45M tokens, more than any context colibri runs)
MAX_TEXT_CHARS = 1_000_000
# address space an encode may take (offsets, pre-token strings, ids on the Rust side)
_ENCODE_BYTES, _ENCODE_BYTES_PER_CHAR = 16 << 20, 256

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                 "mask_token")
# tokenizer_config.json keys that name files or Python classes: meaningless for an in-memory
# tokenizer and, for some, harmful (they would make transformers look for files)
_DROP_KEYS = {"tokenizer_class", "auto_map", "added_tokens_decoder", "name_or_path",
              "tokenizer_file", "vocab_file", "merges_file", "special_tokens_map_file",
              "processor_class", "backend"}


class NoTokenizerError(ColibriError, ValueError):
    """Text was given to a model whose file carries no tokenizer."""


class TokenizerError(ColibriError, ValueError):
    """The model's tokenizer failed (a panic in its Rust code, a broken template, a text it
    refuses); the message names the model file."""


def _is_panic(exc: BaseException) -> bool:
    """pyo3's PanicException (module pyo3_runtime, not importable by name beforehand)."""
    return type(exc).__name__ == "PanicException"


def _guarded(source: str, what: str, call, *args, **kwargs):
    """call(*args, **kwargs), a Rust panic or an error of the tokenizer turned into a
    TokenizerError naming `source` (the model file) and `what` was being done."""
    try:
        return call(*args, **kwargs)
    except ColibriError:
        raise
    except BaseException as e:                      # noqa: BLE001 - PanicException is one
        if not (_is_panic(e) or isinstance(e, Exception)):
            raise                                   # KeyboardInterrupt, SystemExit
        kind = "panicked" if _is_panic(e) else f"failed ({type(e).__name__})"
        raise TokenizerError(f"{source}: the model's tokenizer {kind} while {what}: "
                             f"{' '.join(str(e).split())[:300]}") from None


def _check_text(text, name: str, max_chars: int | None) -> None:
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
    if max_chars is not None and len(text) > max_chars:
        raise TokenizerError(f"{name} has {len(text)} characters, more than the {max_chars} "
                             f"colibri tokenizes at once (tokenizer.MAX_TEXT_CHARS)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizerError(f"{name} is not valid Unicode text: a lone surrogate "
                             f"{text[e.start]!r} at index {e.start} (undecodable bytes?)") from None


def _import_transformers_quietly() -> None:
    """Import transformers without its "PyTorch was not found" notice: colibri uses only its
    tokenizer classes, which need no torch, so the notice would only mislead."""
    if "transformers" in sys.modules:
        return
    key = "TRANSFORMERS_NO_ADVISORY_WARNINGS"      # transformers' own switch for such notices
    saved = os.environ.get(key)
    os.environ[key] = "1"
    try:
        import transformers  # noqa: F401
    finally:
        if saved is None:
            del os.environ[key]
        else:
            os.environ[key] = saved


def _content(tok: Any) -> Any:
    """AddedToken-style dicts ({"content": ...}) -> their string; other values unchanged."""
    if isinstance(tok, dict) and "content" in tok:
        return tok["content"]
    if isinstance(tok, list):
        return [_content(t) for t in tok]
    return tok


def _init_kwargs(files: dict[str, str]) -> dict:
    kwargs: dict[str, Any] = {}
    if "special_tokens_map.json" in files:
        for k, v in json.loads(files["special_tokens_map.json"]).items():
            kwargs[k] = _content(v)
    if "tokenizer_config.json" in files:
        for k, v in json.loads(files["tokenizer_config.json"]).items():
            if k in _DROP_KEYS or v is None:
                continue
            kwargs[k] = _content(v) if (k in _SPECIAL_KEYS or "special_tokens" in k) else v
    if "chat_template.jinja" in files:
        kwargs["chat_template"] = files["chat_template.jinja"]
    return kwargs


def _build_hf(files: dict[str, str], source: str = "the model file"):
    """A transformers fast tokenizer from the files (in memory; a temp dir only as a fallback)."""
    from tokenizers import Tokenizer as RustTokenizer
    _import_transformers_quietly()
    from transformers import PreTrainedTokenizerFast

    try:
        backend = RustTokenizer.from_str(files["tokenizer.json"])
        return PreTrainedTokenizerFast(tokenizer_object=backend, **_init_kwargs(files))
    except Exception as first:                      # noqa: BLE001 - fall back, then report both
        try:
            from transformers import AutoTokenizer
            with tempfile.TemporaryDirectory(prefix="colibri-tok-") as tmp:
                for name, text in files.items():
                    if os.path.basename(name) != name:
                        raise ColibriError(f"tokenizer file name {name!r} is not a plain "
                                           f"file name")
                    with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                        f.write(text)
                # never remote code (an auto_map in a hostile file would otherwise ask on stdin)
                return AutoTokenizer.from_pretrained(tmp, local_files_only=True,
                                                     trust_remote_code=False)
        except Exception as second:                 # noqa: BLE001
            raise TokenizerError(f"{source}: cannot build the tokenizer from the embedded files "
                               f"{sorted(files)}: {first!r}; fallback: {second!r}") from second


class Tokenizer:
    """Encode/decode and chat templates for one model; wraps a transformers fast tokenizer."""

    def __init__(self, hf_tokenizer, generation_config: dict | None = None,
                 source: str = "the model file"):
        self.hf = hf_tokenizer
        # transformers' decode with clean_up_tokenization_spaces=False is its Rust tokenizer's
        # decode behind ~5 us of argument conversion per call, and an IncrementalDecoder makes
        # two calls a token: decode calls the Rust one itself where there is one
        self._rust = getattr(hf_tokenizer, "backend_tokenizer", None)
        self.generation_config = generation_config or {}
        self.source = source            # what errors name: the .colibri file's path

    @classmethod
    def from_files(cls, files: dict[str, str], source: str = "the model file") -> "Tokenizer":
        if "tokenizer.json" not in files:
            raise TokenizerError(f"{source}: the embedded tokenizer has no tokenizer.json "
                                 f"(files: {sorted(files)})")
        try:
            gen = (json.loads(files["generation_config.json"])
                   if "generation_config.json" in files else None)
        except ValueError as e:
            raise TokenizerError(f"{source}: generation_config.json is not JSON: {e}") from None
        if gen is not None and not isinstance(gen, dict):
            raise TokenizerError(f"{source}: generation_config.json must hold an object, "
                                 f"found {type(gen).__name__}")
        # the Rust side aborts the process when an allocation fails: size it first
        check_allocation(TOKENIZER_ADDRESS_SPACE, f"{source}: building the tokenizer",
                         resident=False)
        return cls(_guarded(source, "being built", _build_hf, files, source), gen, source)

    # -- ids <-> text ------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True,
               verbose: bool = True, max_chars: int | None = MAX_TEXT_CHARS) -> list[int]:
        """Token ids of `text`. verbose=False: no warning that the text is longer than the
        model's context (for callers that cut it into windows). max_chars: longer texts are
        a TokenizerError before any work (None: no limit, for a corpus the caller chose)."""
        _check_text(text, "the text", max_chars)
        check_allocation(_ENCODE_BYTES + _ENCODE_BYTES_PER_CHAR * len(text),
                         f"tokenizing a text of {len(text)} characters", resident=False)
        return list(_guarded(self.source, "encoding a text", self.hf.encode, text,
                             add_special_tokens=add_special_tokens, verbose=verbose))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if self._rust is not None:
            return _guarded(self.source, "decoding ids", self._rust.decode, ids,
                            skip_special_tokens=skip_special_tokens)
        return _guarded(self.source, "decoding ids", self.hf.decode, ids,
                        skip_special_tokens=skip_special_tokens,
                        clean_up_tokenization_spaces=False)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for traces), special tokens included."""
        return self.decode([token_id])

    # -- chat -----------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: str | list[dict],
                            add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template.

        A plain string is taken as one user message. tools: OpenAI / transformers tool dicts
        ({"type": "function", "function": {"name", "description", "parameters"}}) the
        template shows the model, as transformers' `tools=`.
        """
        if not self.has_chat_template:
            raise ColibriError("this model's tokenizer has no chat template; generate without "
                               "chat mode")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self.encode(self.render_chat(messages, add_generation_prompt, tools),
                           add_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The text of a conversation rendered with the chat template
        (colibri.format.chat_template: sandboxed and bounded), as transformers renders it: the
        special tokens visible."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TypeError(f"messages must be a list of dicts ({{'role', 'content'}}), got "
                            f"{type(messages).__name__}")
        for i, m in enumerate(messages):
            for key, value in m.items():
                if isinstance(value, str):
                    _check_text(value, f"message {i} {key!r}", MAX_TEXT_CHARS)
        special = {k: v for k, v in self.hf.special_tokens_map.items() if isinstance(v, str)}
        if tools is not None:
            special["tools"] = tools
        try:
            return render_chat_template(self.hf.chat_template, messages,
                                        add_generation_prompt, **special)
        except ColibriError as e:
            raise TokenizerError(f"{self.source}: {e}") from None

    # -- special ids ---------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends a generation: generation_config's eos ids and the tokenizer's eos."""
        ids: list[int] = []
        gen = self.generation_config.get("eos_token_id")
        if gen is not None:
            ids.extend(gen if isinstance(gen, list) else [gen])
        if self.hf.eos_token_id is not None:
            ids.append(self.hf.eos_token_id)
        return sorted(set(int(i) for i in ids))

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def adds_bos(self) -> bool:
        """True when encode() puts the BOS token first (a vocabulary that uses one, as
        llama.cpp's add_bos says it)."""
        bos = self.bos_token_id
        return bos is not None and self.encode("a", verbose=False)[:1] == [bos]

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab={self.vocab_size}, eos={self.eos_token_ids}, "
                f"chat_template={'yes' if self.has_chat_template else 'no'})")


def tokenizer_from_files(files: dict[str, str] | None,
                         source: str = "the model file") -> Tokenizer | None:
    """Tokenizer for the embedded files, or None when the file carries none; source: the
    file the errors name."""
    if not files or "tokenizer.json" not in files:
        return None
    return Tokenizer.from_files(files, source)


# a text that walks the usual paths of a tokenizer: ASCII, digits, spaces, punctuation,
# multi-byte characters, an emoji, a newline and a tab
_PROBE = "Hello, world! 123  spaces\n\ttab é → 世界 🙂 don't"


def check_tokenizer(files: dict[str, str], source: str = "the model file",
                    vocab_size: int | None = None) -> None:
    """Build the tokenizer of `files` and exercise it once, as generation would: encode and
    decode a probe text, the special and end-of-sequence ids inside the vocabulary, and the
    chat template (if any) rendered for a short conversation and encoded.

    Raises TokenizerError (a ColibriError) naming `source` and what failed; None when fine.
    """
    tok = Tokenizer.from_files(files, source)
    ids = tok.encode(_PROBE, verbose=False)
    if not ids:
        raise TokenizerError(f"{source}: the tokenizer encodes a non-empty text to no tokens")
    tok.decode(ids)
    n = vocab_size if vocab_size is not None else tok.vocab_size
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise TokenizerError(f"{source}: the tokenizer gives ids outside the model's "
                             f"vocabulary [0, {n}): {bad[:5]}")
    for what, i in [("eos", e) for e in tok.eos_token_ids] + [("bos", tok.bos_token_id)]:
        if i is not None and not 0 <= int(i) < n:
            raise TokenizerError(f"{source}: the {what} token id {i} is outside the model's "
                                 f"vocabulary [0, {n})")
    if tok.has_chat_template:
        chat = [{"role": "user", "content": _PROBE},     # no system turn: some refuse one
                {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "Again?"}]
        if not tok.apply_chat_template(chat):
            raise TokenizerError(f"{source}: the chat template renders a conversation to "
                                 f"no tokens")


class IncrementalDecoder:
    """Text pieces for ids appended one by one, each piece made of whole characters.

    `context` (the prompt ids) is used only so that the first generated token decodes with the
    spacing it has in context (SentencePiece drops a leading space at the start of a text).
    The pieces joined equal decode(context + generated) minus decode(context) when the latter is
    a prefix of the former (always, except around special tokens the tokenizer cleans up).
    """

    # how many tokens before the new ones are decoded along with them, for context
    _CONTEXT_TOKENS = 6

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = (),
                 skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = [int(i) for i in context][-self._CONTEXT_TOKENS:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        """Add one id; return the new complete text ('' while a character is unfinished)."""
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            # the window slides: decoding cost stays constant per token
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever text is still pending at the end (an unfinished character shows as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]
