"""Structured output and tool calls through the official openai client against a real server
on loopback: response_format json_object / json_schema (whole and streamed, n > 1, on both
routes), a schema llguidance rejects (400 naming it), tools with tool_choice required / a
named function / none / auto, streamed tool calls reassembled by the client, and tool
results sent back. The model is a tiny random mixtral whose chat template is Qwen's tool
template (the hermes <tool_call> format), made in the test."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

import colibri
from colibri.server import Settings

from hf_factory import copy_checkpoint
from server_helpers import client, running_server

pytest.importorskip("llguidance")

# Qwen 2.5's tool-calling template, trimmed to what it does with tools and messages
TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call one or more functions. Function signatures within <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each function call, return a json object within <tool_call></tool_call>:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{%- for tc in m.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

SCHEMA = {"type": "object",
          "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                         "sunny": {"type": "boolean"}},
          "required": ["city", "days", "sunny"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast of a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 5}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(hf_checkpoint, tmp_path_factory):
    where = tmp_path_factory.mktemp("tools")
    src = copy_checkpoint(hf_checkpoint("mixtral", max_position_embeddings=1024), where / "hf")
    (src / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    path = colibri.convert(src, where / "tools.colibri", progress=False)
    with running_server(Settings(model=str(path), parallel=4, ctx=1024, threads=1)) as (url, _):
        yield client(url), path


def test_json_schema_output_parses_and_validates(served):
    c, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA,
                                                  "strict": True}}
    r = c.chat.completions.create(model="tools", messages=ASK, response_format=fmt, n=3,
                                  temperature=1.0, seed=3, max_tokens=100)
    assert len(r.choices) == 3
    for ch in r.choices:
        assert ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)
    # streamed, greedy: the same text as the whole answer
    whole = c.chat.completions.create(model="tools", messages=ASK, response_format=fmt,
                                      temperature=0, max_tokens=100).choices[0].message.content
    parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tools", messages=ASK, response_format=fmt, temperature=0, max_tokens=100,
        stream=True) if ch.choices]
    assert "".join(parts) == whole
    jsonschema.validate(json.loads(whole), SCHEMA)


def test_json_object_on_both_routes(served):
    c, _ = served
    r = c.chat.completions.create(model="tools", messages=ASK, max_tokens=60, temperature=0,
                                  response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:                               # out of tokens inside the object: still its prefix
        assert r.choices[0].message.content.startswith("{")
    r = c.completions.create(model="tools", prompt="The forecast:", max_tokens=100, n=2, seed=1,
                             temperature=0.7, extra_body={"response_format": {
                                 "type": "json_schema",
                                 "json_schema": {"name": "f", "schema": SCHEMA}}})
    for ch in r.choices:
        jsonschema.validate(json.loads(ch.text), SCHEMA)


def test_bad_schema_is_a_400_naming_it(served):
    c, _ = served
    bad = {"type": "object", "properties": {"a": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tools", messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
    assert e.value.body["param"] == "response_format"
    assert "strin" in e.value.body["message"]
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": bad}}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tools", messages=ASK, tools=[bad_tool],
                                  tool_choice="required")
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.UnprocessableEntityError):    # a tool_choice naming no tool
        c.chat.completions.create(model="tools", messages=ASK, tools=[WEATHER],
                                  tool_choice={"type": "function",
                                               "function": {"name": "nope"}})


def _check_weather(call):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER["function"]["parameters"])


def test_named_tool_call_whole_and_streamed(served):
    c, _ = served
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model="tools", messages=ASK, tools=[WEATHER, TIME],
                                  tool_choice=choice, temperature=0, max_tokens=120)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert len(ch.message.tool_calls) == 1
    _check_weather(ch.message.tool_calls[0])
    # the stream, reassembled by the client's own helper
    with c.beta.chat.completions.stream(model="tools", messages=ASK, tools=[WEATHER, TIME],
                                        tool_choice=choice, temperature=0,
                                        max_tokens=120) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    got = final.choices[0]
    assert got.finish_reason == "tool_calls"
    assert [t.function.arguments for t in got.message.tool_calls] == \
        [ch.message.tool_calls[0].function.arguments]
    _check_weather(got.message.tool_calls[0])


def test_required_tool_calls_sampled_parse(served):
    c, _ = served
    r = c.chat.completions.create(model="tools", messages=ASK, tools=[WEATHER, TIME],
                                  tool_choice="required", parallel_tool_calls=False,
                                  temperature=1.0, seed=5, n=4, max_tokens=120)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])


def test_tool_choice_none_gives_text_and_results_go_back(served):
    c, _ = served
    r = c.chat.completions.create(model="tools", messages=ASK, tools=[WEATHER], tool_choice="none",
                                  temperature=0, max_tokens=8)
    plain = c.chat.completions.create(model="tools", messages=ASK, temperature=0, max_tokens=8)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens      # tools left out
    # an assistant turn with its tool call and the tool's answer are taken back
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = c.chat.completions.create(model="tools", messages=turn, tools=[WEATHER], temperature=0,
                                  max_tokens=4)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert r.usage.prompt_tokens > 40          # the template rendered the tools and the turns
