"""Request bodies of the OpenAI routes as pydantic models: every range checked here.

Field names and meanings are the OpenAI API's (completions, chat completions); colibri adds
top_k, min_p and repetition_penalty (as vLLM and llama-server do) and the extension object
`colibri` ({"routing": true}: the experts each generated token was routed to, per MoE
layer; {"token_ids": true}: the generated ids). Unknown fields are refused (422 naming them) rather than silently ignored, and
fields of the API colibri does not implement (logit_bias, suffix) are refused with a
message that says so. response_format (json_object, json_schema) and tools / tool_choice are
checked here for shape; what they mean is colibri/server/structured.py's. /v1/completions takes `echo` (the prompt
echoed, and with `logprobs` its tokens scored: colibri/server/echo.py) and `best_of`.

Bounds (the sampling ones are colibri.generation.sampling's REAL_BOUNDS, the rules every caller
shares): temperature [0, 2], top_p (0, 1], min_p [0, 1], presence/frequency penalties
[-2, 2], repetition_penalty (0, 10], top_k [0, 2^31), seed >= 0 (taken modulo 2^63), n and best_of [1, 16],
logprobs / top_logprobs [0, 20], max_tokens [1, 2^31) ([0, 2^31) on /v1/completions: 0
scores or echoes the prompt without generating), at most 16 stop strings of 1..256
characters, at most MAX_PROMPTS prompts per request, a text prompt of 1..MAX_TEXT_CHARS
characters; echo and stream not together. NaN and infinities are refused everywhere. The
bounds that depend on the served model (token ids below the vocabulary size, prompts and
max_tokens within the context) are written into the OpenAPI document the server serves
(colibri/server/openapi.py); the app checks them (400), and that prompt + max_tokens fit
the context.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..generation.sampling import MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOPS, MAX_TOP_K, REAL_BOUNDS

__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage", "ColibriOptions",
           "StreamOptions", "ErrorBody", "MAX_N", "MAX_TOP_LOGPROBS", "MAX_PROMPTS"]

MAX_N = 16
MAX_PROMPTS = 64             # prompts in one /v1/completions request (lm-eval's batches)
MAX_TEXT_CHARS = 1_000_000   # tokenizer.MAX_TEXT_CHARS: what one text prompt may hold
MAX_TOP_LOGPROBS = MAX_LOGPROBS
MAX_STOP = MAX_STOPS
_INT31 = 2**31 - 1

Finite = Annotated[float, Field(allow_inf_nan=False)]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=_INT31)]


class _Strict(BaseModel):
    # strict: a field is of its JSON type (no "true" or 0 for a boolean, no 2.0 for an integer)
    model_config = ConfigDict(extra="forbid", strict=True)


class ColibriOptions(_Strict):
    """The extension object: "colibri": {"routing": true, "token_ids": true}: per generated
    token, the experts of every MoE layer it was routed to, and its id."""
    routing: bool = False
    token_ids: bool = False


class StreamOptions(_Strict):
    include_usage: bool = False


class TextFormat(_Strict):
    type: Literal["text"]


class JSONObjectFormat(_Strict):
    type: Literal["json_object"]


class JSONSchemaSpec(_Strict):
    """The json_schema of a response_format; strict or not, colibri enforces the schema."""
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class JSONSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat,
                           Field(discriminator="type")]


class FunctionSpec(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None       # a JSON schema (None: no arguments)
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Strict):
    name: str


def _bounded(name: str, default: float):
    """A Field over colibri.generation.sampling.REAL_BOUNDS[name]: the range the engine checks."""
    lo, hi, lo_open = REAL_BOUNDS[name]
    return Field(default, gt=lo, le=hi) if lo_open else Field(default, ge=lo, le=hi)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class _Sampling(_Strict):
    """The fields both routes share."""
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=_INT31)
    # the ranges are colibri.generation.sampling's, the one set of rules every caller checks
    temperature: Finite = _bounded("temperature", 1.0)     # OpenAI's default, not greedy
    top_p: Finite = _bounded("top_p", 1.0)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)
    min_p: Finite = _bounded("min_p", 0.0)
    repetition_penalty: Finite = _bounded("repetition_penalty", 1.0)
    presence_penalty: Finite = _bounded("presence_penalty", 0.0)
    frequency_penalty: Finite = _bounded("frequency_penalty", 0.0)
    seed: int | None = Field(None, ge=0)    # any size (taken modulo 2^63): a bound near
    # 2^63 would not survive the JSON double a client may round the schema's number to
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    logit_bias: dict[str, Any] | None = None
    colibri: ColibriOptions | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by colibri")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def routing(self) -> bool:
        return bool(self.colibri and self.colibri.routing)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """POST /v1/completions. prompt: text, texts, token ids, or lists of token ids (each
    prompt gives n choices, indexed prompt * n + j)."""
    prompt: (Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS)]
             | Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: int | None = Field(None, ge=0, le=_INT31)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    response_format: ResponseFormat | None = None

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        # echo with stream is refused (below); saying it here keeps the document truthful
        "not": {"required": ["echo", "stream"],
                "properties": {"echo": {"const": True}, "stream": {"const": True}}}})

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, p: Any) -> Any:
        """A clear message for a prompt of the wrong shape (the union's would name its first
        branch); values pass on unchanged to the union."""
        if isinstance(p, str):
            return p
        if not isinstance(p, list) or not p:
            raise ValueError("must be a text, a list of texts, a list of token ids or a "
                             "list of lists of token ids, and not empty")
        rows = p if isinstance(p[0], list) else [p]
        if all(isinstance(x, str) for x in p):
            return p
        for row in rows:
            if not isinstance(row, list) or not row:
                raise ValueError("each list of token ids must be a non-empty list")
            for t in row:
                if isinstance(t, bool) or not isinstance(t, int):
                    raise ValueError(f"token ids must be integers, got {t!r}")
                if t < 0:
                    raise ValueError(f"token ids must be >= 0, got {t}")
        return p

    @model_validator(mode="after")
    def _completion_only(self):
        if self.echo and self.stream:
            raise ValueError("echo cannot be combined with stream: the echoed prompt and its "
                             "log-probabilities come in one answer (send stream: false)")
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported by colibri")
        return self

    @property
    def candidates(self) -> int:
        """Completions generated per prompt: best_of (at least n); the n best are answered."""
        return max(self.n, self.best_of or 1)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str                  # JSON text, as the API sends it


class MessageToolCall(BaseModel):
    """A tool call of an earlier assistant message (sent back with the tool's answer)."""
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    """One message; content is text or a list of text parts (joined). An assistant message
    may carry the tool_calls it made, a "tool" message the tool_call_id it answers."""
    model_config = ConfigDict(extra="ignore", strict=True)   # refusals, audio: unused
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions, rendered with the model file's chat template."""
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1, le=_INT31)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _chat_only(self):
        names = [t.function.name for t in self.tools or []]
        if self.tool_choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice required or a named function needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) \
                and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names the function "
                             f"{self.tool_choice.function.name!r}, which is not among the "
                             f"tools ({', '.join(names)})")
        if len(set(names)) != len(names):
            raise ValueError("two tools have the same function name")
        if self.tools_active and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("response_format json_object / json_schema cannot be combined "
                             "with tools (send tool_choice: none to get structured text)")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.max_completion_tokens is not None and self.max_tokens is not None \
                and self.max_completion_tokens != self.max_tokens:
            raise ValueError("give max_tokens or max_completion_tokens, not two different values")
        return self

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def tools_active(self) -> bool:
        """Tools the model may call: given, and tool_choice is not "none"."""
        return bool(self.tools) and self.tool_choice != "none"

    def message_dicts(self) -> list[dict]:
        """The messages as chat templates take them (transformers' shape: a tool call's
        arguments a dict when they are a JSON object, as templates apply tojson to them)."""
        out = []
        for m in self.messages:
            d = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name,
                                                 "arguments": _arguments(c.function.arguments)}}
                                   for c in m.tool_calls]
            out.append(d)
        return out


def _arguments(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error answer: {"error": {"message", "type", "param", "code"}} (errors.py)."""
    error: ErrorDetail
