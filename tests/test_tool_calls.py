"""colibri.generation.tool_calls: format detection, parsing of each format (whole and streamed in
every split), and the call grammar: llguidance accepts the calls it should and refuses others."""
from __future__ import annotations

import json

import pytest

from colibri.generation.batching import TokenEvent
from colibri.generation.tool_calls import (FORMATS, ArgsPiece, CallStart, ToolCall,
                                           ToolStreamParser, call_grammar, detect_format,
                                           parse_tool_calls)

HERMES, MISTRAL, LLAMA, JSONF = (FORMATS[k] for k in ("hermes", "mistral", "llama3_json", "json"))
NAMES = ["get_weather", "get_time"]
W = ToolCall("get_weather", '{"city": "Paris"}')
T = ToolCall("get_time", '{"zone": "UTC"}')

CASES = [  # (format, text, content, calls)
    (HERMES, 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
             '\n</tool_call>', "Let me look.", [W]),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
             '\n<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}\n'
             '</tool_call>', "", [W, T]),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [W]),
    (HERMES, "no calls here, <tool_ even", "no calls here, <tool_ even", []),
    (HERMES, "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "get_time", "arguments": {"zone": "UTC"}}]', "", [W, T]),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [W]),
    (MISTRAL, "Sure. It is sunny.", "Sure. It is sunny.", []),
    (LLAMA, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}', "", [T]),
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "parameters": {"zone": "UTC"}}', "", [W, T]),
    (JSONF, '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', "", [W]),
    (JSONF, '{"name": "unknown_tool", "arguments": {}}',
            '{"name": "unknown_tool", "arguments": {}}', []),
    (JSONF, '{"answer": 42}', '{"answer": 42}', []),
    (JSONF, "Plain words.", "Plain words.", []),
]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_parse_whole(fmt, text, content, calls):
    assert parse_tool_calls(text, fmt, NAMES) == (content, calls)


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_in_pieces_gives_the_same(fmt, text, content, calls, step):
    p = ToolStreamParser(fmt, NAMES)
    items = []
    for i in range(0, len(text), step):
        items += p.feed(text[i:i + step])
    items += p.finish()
    got_calls = [x for x in items if isinstance(x, ToolCall)]
    got_text = "".join(x for x in items if isinstance(x, str))
    assert got_calls == calls
    # a streamed call's pieces make its arguments, after a CallStart naming it
    for k, item in enumerate(items):
        if isinstance(item, ToolCall) and item.streamed:
            back = items[:k][::-1]
            start = next(i for i, x in enumerate(back) if isinstance(x, CallStart))
            assert back[start].name == item.name
            assert all(isinstance(x, ArgsPiece) for x in back[:start])
            assert "".join(x.text for x in back[:start][::-1]) == item.arguments
    assert got_text.strip() == content.strip() or (not calls and got_text == text)


def test_streamed_content_is_not_held_back_needlessly():
    p = ToolStreamParser(HERMES, NAMES)
    assert p.feed("Hello <to") == ["Hello "]          # "<to" may start <tool_call>
    assert p.feed("day") == ["<today"]


def test_detect_format():
    assert detect_format("{{ '<tool_call>' }}") is HERMES
    assert detect_format("[TOOL_CALLS] {{ x }}") is MISTRAL
    assert detect_format("<|python_tag|>") is LLAMA
    assert detect_format("{% for m in messages %}{% endfor %}") is JSONF
    assert detect_format(None) is JSONF


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time"}}]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """llguidance's view of the tests' byte-level BPE tokenizer (any text encodes)."""
    pytest.importorskip("llguidance")
    from llguidance.hf import from_tokenizer
    from transformers import PreTrainedTokenizerFast
    from hf_factory import make_tokenizer
    where = tmp_path_factory.mktemp("tok")
    make_tokenizer(where)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(where / "tokenizer.json"),
                                 eos_token="<|im_end|>")
    return hf, from_tokenizer(hf)


def _accepts(table, grammar: str, text: str) -> bool:
    import llguidance as ll
    hf, t = table
    m = ll.LLMatcher(t, ll.LLMatcher.grammar_from_lark(grammar), log_level=0)
    ids = hf.encode(text, add_special_tokens=False)
    return all(m.consume_token(i) for i in ids) and m.is_accepting()


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, LLAMA, JSONF])
def test_call_grammar_takes_calls_and_refuses_the_rest(fmt, table):
    key = fmt.args_key
    good = json.dumps({"name": "get_weather", key: {"city": "Oslo"}})
    bad_arg = json.dumps({"name": "get_weather", key: {"city": "Rome"}})
    other = json.dumps({"name": "get_time", key: {}})

    def wrap(*calls):
        if fmt is MISTRAL:
            return "[TOOL_CALLS] [" + ", ".join(calls) + "]"
        if fmt is HERMES:
            return "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)
        return "\n".join(calls)
    g = call_grammar(TOOLS, fmt)
    assert _accepts(table, g, wrap(good)) and _accepts(table, g, wrap(other))
    assert _accepts(table, g, wrap(good, other))                      # parallel by default
    assert not _accepts(table, g, wrap(bad_arg))
    assert not _accepts(table, g, "It is sunny.")
    named = call_grammar(TOOLS, fmt, only="get_weather", parallel=False)
    assert _accepts(table, named, wrap(good))
    assert not _accepts(table, named, wrap(other)) and not _accepts(table, named, wrap(good, good))
    content, calls = parse_tool_calls(wrap(good, other), fmt, ["get_weather", "get_time"])
    assert [c.name for c in calls] == ["get_weather", "get_time"]


def test_tool_choice_state_streams_calls_as_openai_does():
    from colibri.server.structured import ToolChoiceState

    class Plan:
        format, names, markers = HERMES, NAMES, {}
    s = ToolChoiceState(0, str, None, False, False, Plan())
    text = 'Hi.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    deltas = []
    for i, ch in enumerate(text):
        s.add(TokenEvent(i, ch))
        deltas += s.chat_deltas(TokenEvent(i, ch))
    s.add(TokenEvent(-1, "", finish_reason="stop"))
    assert "".join(d.get("content", "") for d in deltas) == "Hi."
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    head, pieces = calls[0], calls[1:]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert len(pieces) > 5                          # the arguments stream as they come
    assert all(p["index"] == 0 and set(p) == {"index", "function"} for p in pieces)
    assert "".join(p["function"]["arguments"] for p in pieces) == '{"city": "Paris"}'
    assert s.chat_finish() == "tool_calls"
    msg = s.chat_message()
    assert msg["content"] == "Hi." and msg["tool_calls"][0]["id"] == head["id"]
