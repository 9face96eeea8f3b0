"""Echo with prompt log-probabilities on /v1/completions, prompt batches, best_of, vLLM's
tokenizer routes and the served OpenAPI document's model bounds (a real server on loopback,
the shipped model)."""
from __future__ import annotations

import numpy as np
import pytest

from colibri.generation.sampling import log_softmax
from colibri.server import Settings
from colibri.server.schemas import MAX_PROMPTS
from colibri.generation.stops import default_stop_ids

from server_helpers import KEY, client, request, running_server

PROMPT = "def fibonacci(n):"
CTX = 128


@pytest.fixture(scope="module")
def served():
    with running_server(Settings(parallel=2, ctx=CTX, max_queue=2, api_key=KEY,
                                 threads=1)) as (url, app):
        yield url, app.state.holder.current


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def post(url, path, body, headers=None):
    return request(url, "POST", path, body, auth() if headers is None else headers)


def reference_logprobs(model, ids: list[int]) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i >= 1, from one whole forward pass without a cache
    (Model.forward: not the ragged step the scheduler uses)."""
    logits = model.forward(np.array(ids))                          # (S, V)
    return np.array([log_softmax(logits[i - 1])[ids[i]] for i in range(1, len(ids))])


def test_echo_scores_the_prompt_without_generating(served):
    url, engine = served
    tok = engine.tokenizer
    ids = tok.encode(PROMPT)
    status, _, body = post(url, "/v1/completions", {"prompt": PROMPT, "echo": True,
                                                    "logprobs": 3, "max_tokens": 0})
    assert status == 200, body
    (choice,) = body["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.token_text(t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = np.array(lp["token_logprobs"][1:])
    np.testing.assert_allclose(got, reference_logprobs(engine.model, ids), atol=2e-3)   # summation order: docs/batching.md
    for i, top in enumerate(lp["top_logprobs"][1:], start=1):
        assert lp["tokens"][i] in top and 3 <= len(top) <= 4
        assert max(top.values()) >= lp["token_logprobs"][i] - 1e-9
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]]))
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                             "total_tokens": len(ids)}


def test_echo_with_generation_puts_the_prompt_before_the_completion(served):
    url, engine = served
    ids = engine.tokenizer.encode(PROMPT)
    plain = client(url, KEY).completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=4,
                                                temperature=0, logprobs=1)
    echoed = client(url, KEY).completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=4,
                                                 temperature=0, logprobs=1, echo=True)
    a, b = plain.choices[0], echoed.choices[0]
    assert b.text == PROMPT + a.text
    assert b.logprobs.tokens == [engine.tokenizer.token_text(t) for t in ids] + a.logprobs.tokens
    # the head over every prompt row is a GEMM, over the last one a GEMV: summation order
    np.testing.assert_allclose(b.logprobs.token_logprobs[len(ids):],
                               a.logprobs.token_logprobs, atol=1e-5)
    assert b.logprobs.text_offset[len(ids):] == [len(PROMPT) + o for o in a.logprobs.text_offset]


def test_a_batch_of_prompts_gives_one_choice_each_in_order(served):
    """lm-eval's local-completions: a list of token-id prompts, echo, max_tokens 0; and a
    list of texts."""
    url, engine = served
    tok = engine.tokenizer
    texts = ["The cat sat", "on the mat and", "x = 1"]
    id_prompts = [tok.encode(t) for t in texts]
    status, _, body = post(url, "/v1/completions", {"prompt": id_prompts, "echo": True,
                                                    "logprobs": 1, "max_tokens": 0,
                                                    "temperature": 0})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for ids, choice in zip(id_prompts, body["choices"]):
        assert choice["text"] == tok.decode(ids)
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][1:],
                                   reference_logprobs(engine.model, ids), atol=2e-3)   # summation order: docs/batching.md
    status, _, by_text = post(url, "/v1/completions", {"prompt": texts, "echo": True,
                                                       "logprobs": 0, "max_tokens": 0})
    assert status == 200 and [c["text"] for c in by_text["choices"]] == texts
    for a, b in zip(body["choices"], by_text["choices"]):
        # the two batches may step their prompts in other groupings (summation order)
        np.testing.assert_allclose(a["logprobs"]["token_logprobs"][1:],
                                   b["logprobs"]["token_logprobs"][1:], rtol=0, atol=1e-4)
        assert b["logprobs"]["token_logprobs"][0] is None
        assert all(t is None for t in b["logprobs"]["top_logprobs"])


@pytest.mark.parametrize("extra, status, what", [
    ({"echo": True, "stream": True}, 422, "stream"),
    ({"prompt": ""}, 422, "prompt"),
    ({"prompt": []}, 422, "prompt"),
    ({"prompt": [[]]}, 422, "prompt"),
    ({"prompt": [[1]] * (MAX_PROMPTS + 1)}, 422, "prompt"),
    ({"prompt": ["a"] * (MAX_PROMPTS + 1)}, 422, "prompt"),
    ({"prompt": [[1, 10**6]]}, 400, "token"),
    ({"prompt": [1, -1]}, 422, "prompt"),
    ({"prompt": list(range(1, CTX + 2))}, 400, "context"),
])
def test_bad_scoring_requests_are_4xx_naming_the_field(served, extra, status, what):
    url, _ = served
    got, _, body = post(url, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1,
                                                 "max_tokens": 0, **extra})
    assert got == status, body
    assert what in str(body["error"]).lower(), body


def test_best_of_generates_candidates_and_answers_the_best(served):
    url, _ = served
    status, _, body = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4,
                                                    "best_of": 3, "n": 2, "temperature": 1.0,
                                                    "seed": 5, "logprobs": 0})
    assert status == 200, body
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    means = [np.mean(c["logprobs"]["token_logprobs"]) for c in choices]
    assert means[0] >= means[1]
    assert body["usage"]["completion_tokens"] == 12       # every candidate's tokens count
    for best_of in (1, 2):                                # at most n: n choices
        status, _, body = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2,
                                                        "best_of": best_of, "n": 2})
        assert status == 200 and len(body["choices"]) == 2, body


def test_tokenizer_routes_in_vllms_shapes_behind_the_key(served):
    url, engine = served
    tok = engine.tokenizer
    status, _, body = post(url, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert status == 200, body
    assert body["tokens"] == tok.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == CTX and len(body["token_strs"]) == body["count"]
    status, _, back = post(url, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": tok.decode(body["tokens"])}
    status, _, info = request(url, "GET", "/tokenizer_info", headers=auth())
    assert status == 200 and info["tokenizer_class"] == type(tok.hf).__name__
    assert info["eos_token"] == tok.hf.eos_token
    status, _, bad = post(url, "/detokenize", {"tokens": [engine.model.vocab_size]})
    assert status == 400 and bad["error"]["code"] == "invalid_token_id"
    for method, path, payload in (("POST", "/tokenize", {"prompt": "x"}),
                                  ("POST", "/detokenize", {"tokens": [1]}),
                                  ("GET", "/tokenizer_info", None)):
        assert request(url, method, path, payload)[0] == 401


def test_the_served_openapi_document_states_the_models_bounds(served):
    url, engine = served
    status, _, doc = request(url, "GET", "/openapi.json", headers=auth())
    assert status == 200
    comp = doc["components"]["schemas"]["CompletionRequest"]
    V = engine.model.vocab_size
    id_lists = [b for b in comp["properties"]["prompt"]["anyOf"] if b.get("type") == "array"
                and b["items"].get("type") == "integer"]
    assert id_lists and id_lists[0]["items"]["maximum"] == V - 1
    assert id_lists[0]["maxItems"] == CTX
    maxima = [b.get("maximum") for b in comp["properties"]["max_tokens"]["anyOf"]]
    assert CTX - 1 in maxima
    assert {"/tokenize", "/detokenize", "/tokenizer_info"} <= set(doc["paths"])


def test_a_choice_a_stop_token_ended_lists_that_token_last(served):
    """lm-eval's local-completions reads token_logprobs[len(context):-1] as the continuation,
    the last entry being the generated token: a choice that stopped on EOS at once lists the
    EOS there (as vLLM does), so no prompt token is dropped. Its text is not echoed."""
    url, engine = served
    model, tok = engine.model, engine.tokenizer
    stops = set(default_stop_ids(model))
    V = model.vocab_size

    def greedy_next(prompts):                        # argmax of each prompt's next token
        return model.forward_ragged([(model.new_cache(ctx=4), p) for p in prompts]).argmax(1)

    u = next(i for i, g in enumerate(greedy_next([[i] for i in range(V)])) if g in stops)
    t = next(i for i, g in enumerate(greedy_next([[i, u] for i in range(V)])) if g in stops)
    eos = int(greedy_next([[t, u]])[0])
    status, _, body = post(url, "/v1/completions", {"prompt": [[t, u]], "echo": True,
                                                    "logprobs": 1, "max_tokens": 1,
                                                    "temperature": 0})
    assert status == 200, body
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop" and choice["text"] == tok.decode([t, u])
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.token_text(t), tok.token_text(u), tok.token_text(eos)]
    logits = model.forward(np.array([t, u, eos]))
    want = [log_softmax(logits[0])[u], log_softmax(logits[1])[eos]]
    assert lp["token_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=2e-3)
    assert list(lp["top_logprobs"][2]) == [tok.token_text(eos)]          # it was the greedy one
    assert lp["text_offset"][2] == len(choice["text"])
    assert body["usage"]["completion_tokens"] == 0
