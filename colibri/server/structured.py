"""What response_format and tools mean to a request: the constraint each choice follows and,
with tools, the choice state that turns the model's tool-call text into `tool_calls`.

    spec = response_constraint(body)              # ConstraintSpec | None; APIError 400
    plan = tool_plan(body, tokenizer)             # ToolPlan | None (tools given, not "none")
    plan.constraint                               # required / named: the call grammar
    plan.template_tools                           # what the chat template gets as tools=
    states = [plan.state(i, ...) for i in range(n)]

response_format json_object is any JSON object, json_schema its schema (enforced whether
`strict` is true or not, as vLLM does); both apply to every choice (n > 1: each its own
matcher). tool_choice "auto" leaves the output free and parses calls out of it in the
model's own format (colibri/generation/tool_calls.py); "required" and a named function constrain it
to that format's call syntax with the functions' parameter schemas (one call for a named
function, one or more for required unless parallel_tool_calls is false); "none" leaves the
tools out of the prompt and the output is text. A choice that made calls has finish_reason
"tool_calls", its message `tool_calls` [{id, type: "function", function: {name,
arguments}}] and the content before them (null when empty); streamed, as OpenAI sends them:
{index, id, type: "function", function: {name, arguments: ""}} once the name is read, then
{index, function: {arguments}} pieces as the model writes them (hermes), or in one piece
when the call is complete (the other formats).
"""
from __future__ import annotations

import uuid

from ..errors import ColibriError
from ..generation.batching import TokenEvent
from ..generation.constraints import (ConstraintError, ConstraintSpec, MissingExtraError,
                                      compile_spec)
from ..generation.tool_calls import (_PYTHON_TAG, ArgsPiece, CallStart, ToolCall, ToolFormat,
                                     ToolStreamParser, call_constraint, detect_format)
from .errors import APIError
from .responses import ChoiceState

__all__ = ["response_constraint", "prepare", "tool_plan", "ToolPlan", "ToolChoiceState"]


def _refused(e: Exception, param: str) -> APIError:
    if isinstance(e, ConstraintError):
        return APIError(400, str(e), code="invalid_schema", param=param)
    # no llguidance, or a tokenizer it cannot take
    return APIError(400, str(e), code="structured_output_unavailable", param=param)


def response_constraint(body) -> ConstraintSpec | None:
    """The ConstraintSpec of body.response_format (None for text or none)."""
    rf = getattr(body, "response_format", None)
    if rf is None or rf.type == "text":
        return None
    try:
        if rf.type == "json_object":
            return compile_spec(json_object=True)
        schema = rf.json_schema.schema_
        return compile_spec(json_schema=schema if schema is not None else {"type": "object"})
    except (ConstraintError, MissingExtraError) as e:
        raise _refused(e, "response_format") from None


async def prepare(spec: ConstraintSpec | None, engine) -> None:
    """Start one matcher of spec off the event loop: the first one of a tokenizer builds
    llguidance's view of the vocabulary (seconds on a large one, cached after), which the
    scheduler's submit would otherwise do on the loop; a grammar the vocabulary cannot
    take is a 400 here."""
    if spec is None or engine.tokenizer is None:
        return
    import asyncio
    try:
        await asyncio.to_thread(spec.start, engine.tokenizer, engine.model.vocab_size)
    except ColibriError as e:
        raise _refused(e, "response_format") from None


class ToolPlan:
    """The tools of one chat request: their format, names, the constraint (or None)."""

    def __init__(self, body, tokenizer):
        self.template_tools = [t.model_dump(exclude_none=True) for t in body.tools]
        self.names = [t["function"]["name"] for t in self.template_tools]
        self.format: ToolFormat = detect_format(getattr(tokenizer.hf, "chat_template", None))
        self.tokenizer = tokenizer
        self.markers = _special_markers(self.format, tokenizer)
        choice = body.tool_choice
        self.constraint: ConstraintSpec | None = None
        if choice == "required" or (choice is not None and not isinstance(choice, str)):
            only = None if choice == "required" else choice.function.name
            parallel = only is None and body.parallel_tool_calls is not False
            try:
                self.constraint = call_constraint(self.template_tools, self.format, tokenizer,
                                                  only=only, parallel=parallel)
            except (ConstraintError, MissingExtraError) as e:
                raise _refused(e, "tools") from None

    def state(self, index: int, token_text, logprobs, routing: bool,
              token_ids: bool) -> "ToolChoiceState":
        return ToolChoiceState(index, token_text, logprobs, routing, token_ids, self)


def tool_plan(body, tokenizer) -> ToolPlan | None:
    return ToolPlan(body, tokenizer) if body.tools_active else None


def _special_markers(fmt: ToolFormat, tokenizer) -> dict[int, str]:
    """id -> text of the format's markers that are special tokens (the streamed text skips
    special tokens; the parser must see them)."""
    hf = getattr(tokenizer, "hf", None)
    specials = set(getattr(hf, "all_special_tokens", None) or [])
    out = {}
    for text in (fmt.open, fmt.close, _PYTHON_TAG):
        if text and text in specials:
            tid = hf.convert_tokens_to_ids(text)
            if isinstance(tid, int) and tid >= 0:
                out[tid] = text
    return out


class ToolChoiceState(ChoiceState):
    """A chat choice whose text is parsed for tool calls as it comes."""

    def __init__(self, index, token_text, logprobs, routing, token_ids, plan: ToolPlan):
        super().__init__(index, token_text, logprobs, routing, token_ids)
        self.plan = plan
        self.parser = ToolStreamParser(plan.format, plan.names)
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.call_ids: list[str] = []
        self.deltas: list[dict] = []    # what the last event brought, as stream deltas

    def _start(self, name: str) -> dict:
        self.call_ids.append(f"call_{uuid.uuid4().hex[:24]}")
        k = len(self.call_ids) - 1
        return {"tool_calls": [{"index": k, "id": self.call_ids[k], "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def _args(self, text: str) -> dict:
        return {"tool_calls": [{"index": len(self.call_ids) - 1,
                                "function": {"arguments": text}}]}

    def add(self, ev: TokenEvent) -> None:
        super().add(ev)
        text = ev.text + self.plan.markers.get(ev.token, "")
        items = self.parser.feed(text) if text else []
        if ev.finish_reason is not None:
            items += self.parser.finish()
        self.deltas = []
        for item in items:
            if isinstance(item, str):
                if item:
                    self.content.append(item)
                    self.deltas.append({"content": item})
            elif isinstance(item, CallStart):
                self.deltas.append(self._start(item.name))
            elif isinstance(item, ArgsPiece):
                self.deltas.append(self._args(item.text))
            else:
                self.calls.append(item)
                if not item.streamed:
                    self.deltas += [self._start(item.name), self._args(item.arguments)]

    def chat_message(self) -> dict:
        content = "".join(self.content)
        if not self.calls:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content.strip() or None,
                "tool_calls": [{"id": i, "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}}
                               for i, c in zip(self.call_ids, self.calls)]}

    def chat_finish(self) -> str | None:
        reason = super().chat_finish()
        return "tool_calls" if reason == "stop" and self.calls else reason

    def chat_deltas(self, ev: TokenEvent) -> list[dict]:
        return self.deltas
