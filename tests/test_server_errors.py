"""Bad input never reaches the model: the OpenAI error bodies of 400/401/404/413/422/429,
admission (a full queue), and a client that leaves mid-stream freeing its slot at once."""
from __future__ import annotations

import http.client
import json
import time

import openai
import pytest

from colibri.server import Settings

from server_helpers import KEY, client, open_stream, request, running_server, wait_for

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def small():
    """One slot of 64 tokens, a queue of one, a 4 KiB body limit, an api key."""
    with running_server(Settings(parallel=1, ctx=64, max_queue=1, max_body=4096,
                                 api_key=KEY, threads=1)) as served:
        yield served


@pytest.fixture
def slow(small, monkeypatch):
    """The served model's steps made to take 20 ms each (the shipped model makes ~4000
    tokens/s, too fast to watch a request run), and a stats() reader of its scheduler."""
    engine = small[1].state.holder.current
    for name in ("forward_ragged", "forward"):         # a step of one request runs forward
        fast = getattr(engine.model, name)

        def slowed(*args, fast=fast, **kwargs):
            time.sleep(0.02)
            return fast(*args, **kwargs)
        monkeypatch.setattr(engine.model, name, slowed)
    return engine.scheduler.stats


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def error_of(payload) -> dict:
    """The OpenAI error object, after checking the body has exactly its shape."""
    assert set(payload) == {"error"}, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


def test_context_overflow_is_one_stable_400_with_both_numbers(small):
    url, _ = small
    with pytest.raises(openai.BadRequestError) as e:
        client(url, KEY).completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=60)
    err = error_of(e.value.response.json())
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert err["type"] == "invalid_request_error"
    n_prompt = len(small[1].state.holder.current.tokenizer.encode(PROMPT))
    assert (f"context is 64 tokens" in err["message"] and f"{n_prompt} in the prompt" in
            err["message"] and "60 for max_tokens" in err["message"])
    # the same numbers give the same message, token ids or text
    status, _, body = request(url, "POST", "/v1/completions",
                              {"prompt": list(range(1, n_prompt + 1)), "max_tokens": 60},
                              auth())
    assert status == 400 and error_of(body)["message"] == err["message"]


@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("temperature", 2.5), ("top_p", 0), ("top_p", 1.5), ("top_k", -1),
    ("top_k", 10**30), ("min_p", 2), ("max_tokens", -1), ("max_tokens", -5),
    ("max_tokens", 10**40), ("presence_penalty", 3), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0), ("seed", -1), ("n", 0), ("n", 1000), ("logprobs", 21),
    ("stop", ""), ("stop", ["x"] * 17), ("temperature", "hot"), ("stream", "maybe"),
    ("logit_bias", {"1": 5}), ("echo", "yes"), ("best_of", 0), ("best_of", 17),
    ("no_such_field", 1)])
def test_out_of_range_fields_are_422_naming_the_field(small, field, value):
    url, _ = small
    status, _, body = request(url, "POST", "/v1/completions",
                              {"prompt": PROMPT, "max_tokens": 4, field: value}, auth())
    err = error_of(body)
    assert status == 422, body
    assert field in err["message"] or (err["param"] and field in err["param"]), err


@pytest.mark.parametrize("raw", [b'{"prompt": "x", "temperature": NaN}',
                                 b'{"prompt": "x", "top_p": Infinity}',
                                 b'{"prompt": "x", "min_p": -Infinity}'])
def test_nan_and_infinity_are_refused(small, raw):
    url, _ = small
    status, _, body = request(url, "POST", "/v1/completions", raw, auth())
    assert status == 422 and "finite" in error_of(body)["message"]


@pytest.mark.parametrize("body, code", [
    ({"prompt": [5, 99999]}, "invalid_token_id"),
    ({"prompt": [-1]}, None), ({"prompt": []}, None), ({"prompt": [True]}, None),
    ({"prompt": [[1], []]}, None), ({"prompt": None}, None), ({}, None),
    ({"prompt": "x", "model": "gpt-4"}, "model_not_found")])
def test_bad_prompts_and_models(small, body, code):
    url, _ = small
    status, _, payload = request(url, "POST", "/v1/completions", body, auth())
    err = error_of(payload)
    assert status in (400, 404, 422), payload
    if code is not None:
        assert err["code"] == code


def test_malformed_json_and_wrong_content(small):
    url, _ = small
    for raw in (b"{", b"[1, 2]", b"null", b"\xff\xfe", b'{"messages": "hi"}'):
        status, _, body = request(url, "POST", "/v1/chat/completions", raw, auth())
        assert status in (400, 422), (raw, status, body)
        error_of(body)


def test_chat_schema_errors(small):
    url, _ = small
    for body in ({"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
                 {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                 {"messages": [{"role": "user", "content": "x"}], "tools": [{"x": 1}]},
                 {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}):
        status, _, payload = request(url, "POST", "/v1/chat/completions", body, auth())
        assert status == 422, (body, payload)
        error_of(payload)


def test_api_key(small):
    url, _ = small
    for headers in ({}, {"Authorization": "Bearer wrong-key-0000000"},
                    {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}):
        status, hdrs, body = request(url, "POST", "/v1/completions", {"prompt": "x"}, headers)
        assert status == 401 and hdrs["www-authenticate"] == "Bearer"
        assert error_of(body)["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        client(url, "wrong-key-0000000").models.list()
    assert request(url, "GET", "/health")[0] == 200            # probes need no key
    assert [m.id for m in client(url, KEY).models.list().data] == ["tiny-moe"]


def test_body_over_the_limit_is_413(small):
    url, _ = small
    status, _, body = request(url, "POST", "/v1/completions",
                              {"prompt": "x" * 5000, "max_tokens": 1}, auth())
    assert status == 413 and error_of(body)["code"] == "body_too_large"
    assert "4096" in body["error"]["message"]


def test_unknown_route_is_404_in_the_error_shape(small):
    url, _ = small
    status, _, body = request(url, "GET", "/v1/nothing", headers=auth())
    assert status == 404 and error_of(body)["type"] == "not_found_error"


def test_full_queue_is_429_with_retry_after_then_disconnect_frees_the_slot(small, slow):
    url, _ = small
    long = {"prompt": PROMPT, "max_tokens": 50, "stream": True, "temperature": 0,
            "stop": ["never-seen-zzz"]}
    with open_stream(url, "/v1/completions", long, auth()) as running:
        assert running.status == 200
        running.readline()                                        # it has started
        wait_for(lambda: slow()["slots_busy"] == 1, what="the slot to be busy")
        with open_stream(url, "/v1/completions", long, auth()):
            wait_for(lambda: slow()["queue_depth"] == 1, what="the request to queue")
            with pytest.raises(openai.RateLimitError) as e:
                client(url, KEY).completions.create(model="tiny-moe", prompt="x", max_tokens=2)
            err = error_of(e.value.response.json())
            assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
            assert int(e.value.response.headers["retry-after"]) >= 1
            out0 = slow()["tokens_out"]
        # both clients have closed their connections (the waiting one, then the running one)
    wait_for(lambda: slow()["slots_busy"] == 0 and slow()["queue_depth"] == 0, timeout=5,
             what="the slot to be freed after the clients left")
    assert slow()["tokens_out"] - out0 < 10                      # not run to max_tokens
    r = client(url, KEY).completions.create(model="tiny-moe", prompt="x", max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_non_streaming_client_that_leaves_frees_the_slot(small, slow):
    url, _ = small
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions",
                 body=json.dumps({"prompt": PROMPT, "max_tokens": 50,
                                  "stop": ["never-seen-zzz"]}).encode(),
                 headers={"Content-Type": "application/json", **auth()})
    wait_for(lambda: slow()["slots_busy"] == 1, what="the slot to be busy")
    out0 = slow()["tokens_out"]
    conn.close()                                                  # gone before the answer
    wait_for(lambda: slow()["slots_busy"] == 0, timeout=5, what="the slot to be freed")
    assert slow()["tokens_out"] - out0 < 10


def test_text_that_cannot_be_encoded_is_a_400_not_a_500(small):
    url, _ = small
    for path, body in (("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}'),
                       ("/v1/completions", b'{"prompt": "x", "\\udc00": 1}'),
                       ("/v1/completions", b'{"prompt": "x", "model": "\\ud800"}')):
        status, _, payload = request(url, "POST", path, body, auth())
        assert 400 <= status < 500, (body, status, payload)
        error_of(payload)


def test_more_choices_than_slots_and_queue_are_served_in_turn(small):
    """4 choices on 1 slot + a queue of 1: the request is served in turn, not refused."""
    url, _ = small
    status, _, body = request(url, "POST", "/v1/completions",
                              {"prompt": ["a", "b"], "n": 2, "max_tokens": 1,
                               "temperature": 0}, auth())
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 4


def test_too_many_prompts_is_a_422(small):
    from colibri.server.schemas import MAX_PROMPTS
    url, _ = small
    status, _, body = request(url, "POST", "/v1/completions",
                              {"prompt": [[1]] * (MAX_PROMPTS + 1), "max_tokens": 1}, auth())
    assert status == 422 and "prompt" in error_of(body)["message"], body
