"""colibri.server through the official openai client against a real uvicorn on loopback:
completions, chat, streaming, logprobs, n, stop, the routing extension, /v1/models,
/health, /metrics; greedy output checked against colibri.generate on the same model."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

import colibri
from colibri.server import VERSION_HEADER, Settings

from hf_factory import copy_checkpoint
from server_helpers import client, open_stream, request, running_server, sse_events

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def shipped():
    """(url, app) serving the shipped model: 2 slots of 256 tokens."""
    with running_server(Settings(parallel=2, ctx=256, threads=1)) as served:
        yield served


@pytest.fixture(scope="module")
def chat_model(hf_checkpoint, tmp_path_factory):
    """A tiny mixtral .colibri file with a tokenizer and a chat template."""
    dst = tmp_path_factory.mktemp("chat") / "chat.colibri"
    return colibri.convert(hf_checkpoint("mixtral"), dst, progress=False)


@pytest.fixture(scope="module")
def chat_server(chat_model):
    with running_server(Settings(model=str(chat_model), parallel=2, ctx=128,
                                 threads=1)) as served:
        yield served


@pytest.fixture(scope="module")
def model():
    return colibri.load(threads=1)


# -- completions --------------------------------------------------------------------------------

def test_completion_greedy_matches_the_library(shipped, model):
    url, app = shipped
    r = client(url).completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=8,
                                       temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == model.generate(PROMPT, max_new_tokens=8)
    assert r.choices[0].finish_reason == "length"
    n_prompt = len(model.tokenizer.encode(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (n_prompt, 8, n_prompt + 8)
    assert r.system_fingerprint == f"colibri-{app.state.holder.current.version}"


def test_completion_token_id_prompts_and_several_prompts(shipped, model):
    url, _ = shipped
    ids = model.tokenizer.encode(PROMPT)
    r = client(url).completions.create(model="tiny-moe", prompt=[ids, ids[:3]], max_tokens=4,
                                       temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == model.generate(PROMPT, max_new_tokens=4)
    want = model.tokenizer.decode(model.generate(np.array(ids[:3]), max_new_tokens=4))
    assert r.choices[1].text == want
    assert r.usage.prompt_tokens == len(ids) + 3


def test_completion_stream_equals_the_whole_answer(shipped):
    url, _ = shipped
    c = client(url)
    whole = c.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(c.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=10,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_stream_is_sse_ending_with_done(shipped):
    url, _ = shipped
    with open_stream(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3,
                                              "stream": True}) as resp:
        assert resp.status == 200
        assert resp.getheader("content-type").startswith("text/event-stream")
        assert resp.getheader(VERSION_HEADER)
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" for e in events[:-1])


def test_completion_logprobs(shipped):
    url, _ = shipped
    r = client(url).completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=6,
                                       temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3
        assert chosen <= 0 and chosen == pytest.approx(max(top.values()))   # greedy: the best


def test_completion_stream_logprobs_and_routing(shipped, model):
    url, _ = shipped
    events = []
    with open_stream(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stream": True,
                                              "temperature": 0, "logprobs": 2,
                                              "colibri": {"routing": True,
                                                          "token_ids": True}}) as resp:
        events = sse_events(resp)[:-1]
    tokens = [e["choices"][0] for e in events if e["choices"][0]["colibri"]["token_ids"]]
    assert len(tokens) == 4
    ids = [c["colibri"]["token_ids"][0] for c in tokens]
    # the routing of each generated token is what forward(return_routing=True) records for it
    prompt_ids = model.tokenizer.encode(PROMPT)
    _, trace = colibri.forward(model, np.array(prompt_ids + ids), return_routing=True)
    for j, c in enumerate(tokens):
        routing = np.array(c["colibri"]["routing"][0])           # (M, K)
        assert routing.shape == (len(model.moe_layers), model.config.num_experts_per_tok)
        want = np.stack([t[len(prompt_ids) + j] for t in trace.ids])
        assert np.array_equal(np.sort(routing, axis=1), np.sort(want, axis=1))
        assert len(c["logprobs"]["top_logprobs"][0]) == 2
    assert events[0]["colibri"]["moe_layers"] == list(model.moe_layers)


def test_n_choices_seeded(shipped):
    url, _ = shipped
    c = client(url)
    kw = dict(model="tiny-moe", prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=7)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]   # same seed
    assert len({ch.text for ch in a.choices}) > 1            # each choice its own draw
    assert 3 <= a.usage.completion_tokens <= 3 * 8


def test_stop_string_across_tokens(shipped, model):
    url, _ = shipped
    greedy = model.generate(PROMPT, max_new_tokens=12)
    stop = greedy[3:9]                    # spans several tokens of the greedy continuation
    r = client(url).completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=12,
                                       temperature=0, stop=[stop, "never-seen-zzz"])
    assert r.choices[0].text == greedy[:greedy.index(stop)]
    assert r.choices[0].finish_reason == "stop"


# -- chat ---------------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello world!"}]


def test_chat_uses_the_files_template(chat_server, chat_model):
    url, _ = chat_server
    m = colibri.load(chat_model, threads=1)
    r = client(url).chat.completions.create(model="chat", messages=MESSAGES, max_tokens=6,
                                            temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == m.generate(MESSAGES, max_new_tokens=6)
    assert r.usage.prompt_tokens == len(m.tokenizer.apply_chat_template(MESSAGES))


def test_chat_stream_and_logprobs(chat_server):
    url, _ = chat_server
    c = client(url)
    whole = c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=5,
                                      temperature=0, logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in content)
    chunks = list(c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=5,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    two = list(c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=3, n=2,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert {ch.choices[0].index for ch in two if ch.choices} == {0, 1}
    assert two[-1].choices == [] and two[-1].usage.completion_tokens <= 6


def test_chat_without_template_is_a_400(hf_checkpoint, tmp_path):
    src = copy_checkpoint(hf_checkpoint("mixtral"), tmp_path / "hf")
    (src / "chat_template.jinja").unlink()
    plain = colibri.convert(src, tmp_path / "plain.colibri", progress=False)
    with running_server(Settings(model=str(plain), parallel=1, ctx=64, threads=1)) as (url, _):
        with pytest.raises(openai.BadRequestError) as e:
            client(url).chat.completions.create(model="plain", messages=MESSAGES)
    assert e.value.body["code"] == "no_chat_template"


def test_chat_on_the_shipped_model_matches_the_library(shipped, model):
    """The shipped model has a chat template: the README's openai chat example works."""
    url, _ = shipped
    r = client(url).chat.completions.create(model="tiny-moe", messages=MESSAGES, max_tokens=12,
                                            temperature=0)
    assert r.choices[0].message.content == model.generate(MESSAGES, chat=True,
                                                          max_new_tokens=12, temperature=0)
    assert r.usage.prompt_tokens == len(model.tokenizer.apply_chat_template(MESSAGES))


# -- the other routes ---------------------------------------------------------------------------

def test_models_health_metrics(shipped):
    url, app = shipped
    models = client(url).models.list()
    assert [m.id for m in models.data] == ["tiny-moe"]
    status, _, health = request(url, "GET", "/health")
    assert status == 200 and health["status"] == "ok"
    assert health["version"] == app.state.holder.current.version
    assert health["slots_total"] == 2
    client(url).completions.create(model="tiny-moe", prompt="x", max_tokens=2)
    status, headers, text = request(url, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in ("colibri_requests_total", "colibri_prompt_tokens_total",
                 "colibri_completion_tokens_total", "colibri_tokens_per_second",
                 "colibri_queue_depth", "colibri_slots_busy", "colibri_kv_bytes_in_use",
                 "colibri_rss_bytes", "colibri_model_info"):
        assert name in text, name
    line = [ln for ln in text.splitlines()
            if ln.startswith('colibri_requests_total{route="/v1/completions",status="200"}')]
    assert line and float(line[0].split()[-1]) >= 1


def test_openapi_document_lists_the_routes(shipped):
    url, _ = shipped
    status, _, doc = request(url, "GET", "/openapi.json")
    assert status == 200
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health"):
        assert path in doc["paths"]
    assert json.dumps(doc)                 # a plain JSON document


def test_concurrent_streams_share_the_batch_and_match_alone(shipped, model):
    """Four streams at once through two slots: each equals its request served alone."""
    url, _ = shipped
    prompts = ["def fibonacci(n):", "import os\n", "class Foo:", "for i in range("]
    alone = [model.generate(p, max_new_tokens=12) for p in prompts]

    def one(p):
        chunks = client(url).completions.create(model="tiny-moe", prompt=p, max_tokens=12,
                                                temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks)
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, prompts)) == alone


def test_extension_through_the_openai_client(shipped, model):
    """The docs/server.md example: extra_body in, model_extra out."""
    url, _ = shipped
    r = client(url).completions.create(model="tiny-moe", prompt="import os", max_tokens=4,
                                       temperature=0,
                                       extra_body={"colibri": {"routing": True,
                                                               "token_ids": True}})
    ext = r.choices[0].model_extra["colibri"]
    assert len(ext["token_ids"]) == len(ext["routing"]) == r.usage.completion_tokens
    assert model.tokenizer.decode(ext["token_ids"]) == r.choices[0].text
    assert r.model_extra["colibri"]["moe_layers"] == list(model.moe_layers)
