"""The OpenAI response bodies and stream chunks, built from TokenEvents.

One `ChoiceState` per choice accumulates what its events carried (text, finish reason,
logprobs, routing, token ids); `completion_body` / `chat_body` make the whole response of a
request, `completion_chunk` / `chat_chunk` one SSE chunk from one event. Logprobs come in
the two shapes of the API:
  completions: {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}],
                "text_offset": [int]}
  chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
                "logprob", "bytes"}]}]}
The extension (request "colibri": {"routing": true, "token_ids": true}) adds to each choice
(or chunk choice) "colibri": {"routing": [per token: [per MoE layer: [K expert ids]]],
"token_ids": [int]}; the response's top level "colibri": {"model_version", "moe_layers"}.
"""
from __future__ import annotations

import json
import time
import uuid

from ..generation.batching import TokenEvent

__all__ = ["ChoiceState", "Envelope", "completion_body", "chat_body", "completion_chunk",
           "chat_chunk", "chat_chunks", "usage_body", "sse", "SSE_DONE"]

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class Envelope:
    """The fields every body and chunk of one response share."""

    def __init__(self, kind: str, model: str, fingerprint: str, version: str,
                 moe_layers: list[int], extension: bool):
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model, self.fingerprint, self.version = model, fingerprint, version
        self.moe_layers, self.extension = moe_layers, extension

    def head(self, obj: str) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "system_fingerprint": self.fingerprint}
        if self.extension:
            out["colibri"] = {"model_version": self.version, "moe_layers": self.moe_layers}
        return out


class ChoiceState:
    """What one choice has produced so far. token_text: id -> its text (for logprobs)."""

    def __init__(self, index: int, token_text, logprobs: int | None, routing: bool,
                 token_ids: bool):
        self.index = index
        self.token_text = token_text
        self.logprobs, self.routing, self.token_ids = logprobs, routing, token_ids
        self.text: list[str] = []
        self.chars = 0
        self.finish_reason: str | None = None
        self.events: list[TokenEvent] = []       # events that carried a token
        self.offsets: list[int] = []             # text_offset of each such token
        self.stop: TokenEvent | None = None      # the final event, when a stop token ended it

    def add(self, ev: TokenEvent) -> None:
        if ev.token >= 0:
            self.events.append(ev)
            self.offsets.append(self.chars)
        elif ev.stop_token >= 0:
            self.stop = ev
        self.text.append(ev.text)
        self.chars += len(ev.text)
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason

    # -- the chat message (a ToolChoiceState, colibri/server/structured.py, adds tool calls) --
    def chat_message(self) -> dict:
        return {"role": "assistant", "content": "".join(self.text)}

    def chat_finish(self) -> str | None:
        return _finish(self.finish_reason)

    def chat_deltas(self, ev: TokenEvent) -> list[dict]:
        """The deltas of the event just added, one chunk each (none: nothing to send)."""
        return [{"content": ev.text} if ev.text or ev.finish_reason is None else {}]

    # -- logprobs, in the two shapes ----------------------------------------------------------
    def completion_logprobs(self, events: list[TokenEvent], offsets: list[int]) -> dict | None:
        if self.logprobs is None:
            return None
        return {"tokens": [self.token_text(e.token) for e in events],
                "token_logprobs": [e.logprob for e in events],
                "top_logprobs": [({self.token_text(t): lp for t, lp in e.top_logprobs}
                                  if e.top_logprobs is not None else None) for e in events],
                "text_offset": list(offsets)}

    def _entry(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat_logprobs(self, events: list[TokenEvent]) -> dict | None:
        if self.logprobs is None:
            return None
        return {"content": [dict(self._entry(e.token, e.logprob),
                                 top_logprobs=[self._entry(t, lp) for t, lp in
                                               (e.top_logprobs or [])]) for e in events]}

    def extension(self, events: list[TokenEvent]) -> dict | None:
        out = {}
        if self.routing:
            out["routing"] = [e.routing.tolist() if e.routing is not None else None
                              for e in events]
        if self.token_ids:
            out["token_ids"] = [e.token for e in events]
        return out or None


def _finish(reason: str | None) -> str | None:
    # "cancelled" never reaches a client (it left); "error" is answered as an error
    return reason if reason in ("stop", "length") else None


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _with_ext(choice: dict, ext: dict | None) -> dict:
    if ext is not None:
        choice["colibri"] = ext
    return choice


def completion_body(env: Envelope, choices: list[ChoiceState], usage: dict) -> dict:
    body = env.head("text_completion")
    body["choices"] = [_with_ext({"index": c.index, "text": "".join(c.text),
                                  "logprobs": c.completion_logprobs(c.events, c.offsets),
                                  "finish_reason": _finish(c.finish_reason)},
                                 c.extension(c.events)) for c in choices]
    body["usage"] = usage
    return body


def chat_body(env: Envelope, choices: list[ChoiceState], usage: dict) -> dict:
    body = env.head("chat.completion")
    body["choices"] = [_with_ext({"index": c.index,
                                  "message": c.chat_message(),
                                  "logprobs": c.chat_logprobs(c.events),
                                  "finish_reason": c.chat_finish()},
                                 c.extension(c.events)) for c in choices]
    body["usage"] = usage
    return body


def completion_chunk(env: Envelope, c: ChoiceState, ev: TokenEvent, offset: int,
                     with_usage: bool) -> dict:
    """The chunk of one event of choice c (already added to c; offset: its text_offset)."""
    events = [ev] if ev.token >= 0 else []
    body = env.head("text_completion")
    body["choices"] = [_with_ext({"index": c.index, "text": ev.text,
                                  "logprobs": c.completion_logprobs(events, [offset] * len(events)),
                                  "finish_reason": _finish(ev.finish_reason)},
                                 c.extension(events))]
    if with_usage:
        body["usage"] = None
    return body


def chat_chunk(env: Envelope, c: ChoiceState, ev: TokenEvent | None,
               with_usage: bool) -> dict:
    """The opening chunk of choice c (the role; ev None), or the first of chat_chunks(ev)."""
    if ev is None:
        body = env.head("chat.completion.chunk")
        body["choices"] = [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}]
        if with_usage:
            body["usage"] = None
        return body
    return chat_chunks(env, c, ev, with_usage)[0]


def chat_chunks(env: Envelope, c: ChoiceState, ev: TokenEvent, with_usage: bool) -> list[dict]:
    """The chunks of one event of choice c (already added to c): usually one; none when a
    tool-call parser holds its text back, several when it completes a tool call. The
    event's logprobs and extension go on the first, its finish reason on the last."""
    deltas = c.chat_deltas(ev)
    if not deltas and ev.finish_reason is not None:
        deltas = [{}]
    events = [ev] if ev.token >= 0 else []
    out = []
    for k, delta in enumerate(deltas):
        body = env.head("chat.completion.chunk")
        first, last = k == 0, k == len(deltas) - 1
        body["choices"] = [_with_ext(
            {"index": c.index, "delta": delta,
             "logprobs": c.chat_logprobs(events) if events and first else None,
             "finish_reason": c.chat_finish() if last and ev.finish_reason is not None
             else None}, c.extension(events) if first else None)]
        if with_usage:
            body["usage"] = None
        out.append(body)
    return out


def usage_chunk(env: Envelope, obj: str, usage: dict) -> dict:
    body = env.head(obj)
    body["choices"] = []
    body["usage"] = usage
    return body
