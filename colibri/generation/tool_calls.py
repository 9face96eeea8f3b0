"""Tool calls in the model's own format: which format a chat template uses, the grammar that
makes the model write a call (tool_choice required / a named function), and the parser that
reads calls back out of its text, whole or streamed.

    fmt = detect_format(tokenizer.hf.chat_template)          # ToolFormat
    spec = call_constraint(tools, fmt, tokenizer, only="get_weather", parallel=False)
    content, calls = parse_tool_calls(text, fmt, names)       # calls: [ToolCall]
    p = ToolStreamParser(fmt, names); p.feed(piece) -> [str | ToolCall]; p.finish()

Formats (the model writes what its chat template shows it in the tool-call examples):
  hermes      <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>  (Qwen 2/2.5/3,
              Hermes 2/3, and any template that mentions <tool_call>); one block per call
  mistral     [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]  (Mistral v3 and later;
              also [TOOL_CALLS]name[ARGS]{...}, the v11 spelling)
  llama3_json {"name": ..., "parameters": {...}}, optionally after <|python_tag|> (Llama 3.1+)
  json        the generic fallback: the output is {"name": ..., "arguments": {...}} (or a list
              of them); text that is not such a call naming one of the tools is content
A marker that is one special token of the vocabulary is written in the grammar as that token
(llguidance's <[id]>), otherwise as text. The parsers see the text with special tokens kept.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Iterable

from .constraints import JSON_OPTIONS, ConstraintSpec, compile_spec

__all__ = ["ToolFormat", "ToolCall", "CallStart", "ArgsPiece", "FORMATS", "detect_format", "call_constraint",
           "parse_tool_calls", "ToolStreamParser"]


@dataclass(frozen=True)
class ToolFormat:
    """name; open/close: the text around a call (None: none); args_key: "arguments" or
    "parameters"; array: the calls after `open` are one JSON array (mistral)."""
    name: str
    open: str | None
    close: str | None
    args_key: str
    array: bool = False


FORMATS = {f.name: f for f in (
    ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments"),
    ToolFormat("mistral", "[TOOL_CALLS]", None, "arguments", array=True),
    ToolFormat("llama3_json", None, None, "parameters"),
    ToolFormat("json", None, None, "arguments"),
)}
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (the API's shape).
    streamed: its name and arguments went out before (CallStart, ArgsPiece)."""
    name: str
    arguments: str
    streamed: bool = field(default=False, compare=False)


@dataclass(frozen=True)
class CallStart:
    """A call's name is known; its arguments follow as ArgsPieces, then its ToolCall."""
    name: str


@dataclass(frozen=True)
class ArgsPiece:
    """The next piece of the arguments text of the call last started."""
    text: str


def detect_format(chat_template: str | None) -> ToolFormat:
    """The tool-call format a chat template teaches its model (json when none is recognised)."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in t:
        return FORMATS["mistral"]
    if _PYTHON_TAG in t or ('"parameters"' in t and "tools" in t):
        return FORMATS["llama3_json"]
    return FORMATS["json"]


# ---------------------------------------------------------------------------------------------
# the grammar of a call (tool_choice required / named)
# ---------------------------------------------------------------------------------------------

def _call_schema(tool: dict, args_key: str) -> dict:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


def _marker(text: str, tokenizer) -> str:
    """The Lark terminal of a marker: its special token when the vocabulary has one."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None and text in (getattr(hf, "all_special_tokens", None) or []):
        tid = hf.convert_tokens_to_ids(text)
        if isinstance(tid, int) and tid >= 0:
            return f"<[{tid}]>"
    return json.dumps(text)


def call_grammar(tools: list[dict], fmt: ToolFormat, tokenizer=None, only: str | None = None,
                 parallel: bool = True) -> str:
    """The Lark grammar (llguidance's dialect) of one call, or of one or more when parallel,
    to one of `tools` (OpenAI tool dicts; only: just the function of that name), written in
    `fmt`. The arguments follow each function's parameters schema."""
    chosen = [t for t in tools if only is None or t["function"]["name"] == only]
    if not chosen:
        raise ValueError(f"no tool named {only!r}")
    one = {"anyOf": [_call_schema(t, fmt.args_key) for t in chosen]} if len(chosen) > 1 \
        else _call_schema(chosen[0], fmt.args_key)
    one = dict(one, **{"x-guidance": JSON_OPTIONS})
    if fmt.array:
        array = {"type": "array", "items": one, "minItems": 1,
                 **({} if parallel else {"maxItems": 1}), "x-guidance": JSON_OPTIONS}
        return f"start: {_marker(fmt.open, tokenizer)} \" \" %json{json.dumps(array)}\n"
    if fmt.open is not None:
        call = (f"{_marker(fmt.open, tokenizer)} \"\\n\" %json{json.dumps(one)} \"\\n\" "
                f"{_marker(fmt.close, tokenizer)}")
        sep = '"\\n"'
    else:
        call, sep = f"%json{json.dumps(one)}", '"\\n"'
    more = f" ({sep} call)*" if parallel else ""
    return f"start: call{more}\ncall: {call}\n"


def call_constraint(tools: list[dict], fmt: ToolFormat, tokenizer=None, only: str | None = None,
                    parallel: bool = True) -> ConstraintSpec:
    """call_grammar compiled (ConstraintError naming a parameters schema llguidance rejects)."""
    return compile_spec(grammar=call_grammar(tools, fmt, tokenizer, only, parallel))


# ---------------------------------------------------------------------------------------------
# reading calls back
# ---------------------------------------------------------------------------------------------

_DECODER = json.JSONDecoder()
# the head of a call whose arguments are an object: they stream from here
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_V11 = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")


def _as_call(obj, names: Iterable[str] | None) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):                 # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _values(text: str) -> list | None:
    """The JSON values of text written one after another (separated by blanks, commas or
    semicolons); None when any part is not JSON."""
    out, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n,;":
            i += 1
        if i >= n:
            return out
        try:
            value, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return None
        out.extend(value if isinstance(value, list) else [value])


def _calls_of(text: str, names) -> list[ToolCall] | None:
    values = _values(text)
    if not values:
        return None
    calls = [_as_call(v, names) for v in values]
    return None if any(c is None for c in calls) else calls


def _strip_fence(text: str) -> str:
    t = text.strip()
    if t.startswith(_PYTHON_TAG):
        t = t[len(_PYTHON_TAG):].strip()
    if t.startswith("```"):
        t = t.split("\n", 1)[1] if "\n" in t else ""
        t = t.rstrip().removesuffix("```")
    return t


def parse_tool_calls(text: str, fmt: ToolFormat, names: Iterable[str] | None = None
                     ) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output. content is the text before the first call (all of
    it when there is none, or when what follows the marker is not a call). names: the tools'
    names; the markerless formats take only a call naming one of them."""
    names = None if names is None else set(names)
    if fmt.open is None:
        calls = _calls_of(_strip_fence(text), names)
        return ("", calls) if calls else (text, [])
    at = text.find(fmt.open)
    if at < 0:
        return text, []
    content, rest = text[:at], text[at:]
    calls: list[ToolCall] = []
    if fmt.array:
        body = rest[len(fmt.open):]
        m = _V11.match(body)
        if m:                                         # name[ARGS]{...}, repeated
            for part in body.split(fmt.open):
                m = _V11.match(part)
                args = _values(part[m.end():]) if m else None
                if not args or len(args) != 1 or not isinstance(args[0], dict):
                    return text, []
                calls.append(ToolCall(m.group(1), json.dumps(args[0], ensure_ascii=False)))
        else:
            calls = _calls_of(body, None) or []
    else:
        for block in rest.split(fmt.open)[1:]:
            inner = block.split(fmt.close, 1)[0] if fmt.close else block
            got = _calls_of(inner, None)
            if not got:
                return text, []
            calls.extend(got)
    return (content, calls) if calls else (text, [])


class ToolStreamParser:
    """Streamed text in, content pieces (str) and calls out, in order. Text that may be the
    start of a marker is held back until it is known not to be one. In a format with both
    markers (hermes) a call written {"name": ..., "arguments": {...}} streams: CallStart once
    the name is read, ArgsPieces as the arguments come (the model's own text, holding back
    the last character that may be the call object's closing brace), then its ToolCall
    (streamed=True, the arguments the pieces make). Other calls come whole, as ToolCalls; a
    markerless format holds everything back when the output starts like JSON and decides at
    the end."""

    def __init__(self, fmt: ToolFormat, names: Iterable[str] | None = None):
        self.fmt, self.names = fmt, None if names is None else set(names)
        self.pending = ""               # text not yet given out
        self.in_calls = False           # a marker (or a JSON start) was seen
        self.current: list | None = None  # the streaming call: [name, args start, sent]
        self.calls: list[ToolCall] = []

    def feed(self, piece: str) -> list:
        self.pending += piece
        fmt = self.fmt
        if fmt.open is None:
            if not self.in_calls:
                head = self.pending.lstrip()
                if not head:
                    return []
                if head[0] in "{[`" or _PYTHON_TAG.startswith(head[:len(_PYTHON_TAG)]):
                    self.in_calls = True
                    return []
                out, self.pending = [self.pending], ""
                self.in_calls = None            # plain text: never a call
                return out
            if self.in_calls is None:
                out, self.pending = [self.pending], ""
                return out
            return []
        out: list = []
        if not self.in_calls:
            at = self.pending.find(fmt.open)
            if at < 0:
                keep = _partial_suffix(self.pending, fmt.open)
                text, self.pending = self.pending[:len(self.pending) - keep], \
                    self.pending[len(self.pending) - keep:]
                return [text] if text else []
            if at:
                out.append(self.pending[:at])
            self.pending = self.pending[at:]
            self.in_calls = True
        if fmt.close is not None:                    # hermes: each closed block is a call
            while True:
                end = self.pending.find(fmt.close)
                if end < 0:
                    break
                block = self.pending[:end + len(fmt.close)]
                if self.current is not None:
                    out.extend(self._end_streamed(self.pending[:end]))
                else:
                    content, calls = parse_tool_calls(block, fmt)
                    out.extend(([content] if content else []) + calls if calls else [block])
                    self.calls.extend(calls)
                self.pending = self.pending[end + len(fmt.close):].lstrip()
            if self.pending.startswith(fmt.open):
                out.extend(self._stream_args())
        return out

    def _stream_args(self) -> list:
        out: list = []
        if self.current is None:
            m = _HEAD.match(self.pending, len(self.fmt.open))
            if not m:
                return out
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                return out
            self.current = [name, m.end(), 0]
            out.append(CallStart(name))
        _, start, sent = self.current
        raw = self.pending[start:]
        raw = raw[:len(raw) - _partial_suffix(raw, self.fmt.close)].rstrip()[:-1].rstrip()
        if len(raw) > sent:
            out.append(ArgsPiece(raw[sent:]))
            self.current[2] = len(raw)
        return out

    def _end_streamed(self, block: str) -> list:
        """The rest of the streaming call's arguments and its ToolCall; block: the call's
        text up to its closing marker (or the end)."""
        name, start, sent = self.current
        self.current = None
        raw = block[start:].rstrip()
        raw = (raw[:-1] if raw.endswith("}") else raw).rstrip()
        call = ToolCall(name, raw, streamed=True)
        self.calls.append(call)
        return ([ArgsPiece(raw[sent:])] if len(raw) > sent else []) + [call]

    def finish(self) -> list:
        """What is left at the end: the last calls, or the held-back text as content."""
        if self.current is not None:                 # cut short inside a streaming call
            out = self._end_streamed(self.pending)
            self.pending = ""
            return out
        text, self.pending = self.pending, ""
        if not text:
            return []
        if not self.in_calls:
            return [text]
        content, calls = parse_tool_calls(text, self.fmt, self.names)
        self.calls.extend(calls)
        return ([content] if content else []) + calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
