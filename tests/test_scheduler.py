"""colibri.generation.batching.Scheduler: the contract the server builds on (params, events,
admission, queue, cancel, stops, logprobs, routing, seeds, the background thread)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import colibri
import colibri.api as api
from colibri.generation.batching import (ContextLengthError, QueueFullError, SamplingParams,
                                         Scheduler, TokenEvent)
from colibri.errors import ColibriError
from colibri.generation.sampling import log_softmax

PROMPTS = ["def fib(n):", "Once upon a time", "import numpy as np\n", "The hummingbird"]


@pytest.fixture(scope="module")
def model():
    m = api.load(colibri.default_model_path(), threads=1, kv_dtype="f32")
    yield m
    m.close()


def ids_of(model, text):
    return model.tokenizer.encode(text)


def run_all(sched):
    while sched.step():
        pass


def events(handle) -> list[TokenEvent]:
    return list(handle)


def text_of(evs) -> str:
    return "".join(e.text for e in evs)


# ---------------------------------------------------------------------------------------------
# parameters and admission errors
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("max_tokens", -1), ("max_tokens", -3), ("max_tokens", 2**40), ("max_tokens", 1.5),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", 1e9),
    ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.2),
    ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", float("inf")),
    ("seed", -1), ("seed", 2**64), ("stop", ["ok", ""]), ("stop", "abc"), ("stop", ["x"] * 17),
    ("stop_ids", [-1]), ("logprobs", -1), ("logprobs", 21), ("return_routing", "yes"),
    ("prompt_logprobs", -1), ("prompt_logprobs", 21),
])
def test_check_names_the_field_value_and_range(field, value):
    p = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field) as err:
        p.check()
    assert repr(value)[:20] in str(err.value) and "must be" in str(err.value)


def test_defaults_are_generate_defaults(model):
    p = SamplingParams()
    p.check()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty,
            p.presence_penalty, p.frequency_penalty, p.seed, p.stop, p.stop_ids, p.logprobs,
            p.return_routing) == (64, 0.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, None, [], None, None, False)
    s = Scheduler(model, parallel=1)
    h = s.submit(ids_of(model, PROMPTS[0]), SamplingParams(max_tokens=20))
    run_all(s)
    assert text_of(events(h)) == model.generate(PROMPTS[0], max_new_tokens=20)


def test_context_length_error_states_both_numbers(model):
    s = Scheduler(model, parallel=2, ctx=32)
    with pytest.raises(ContextLengthError, match=r"prompt has 20 tokens and max_tokens is 13: "
                                                 r"33 tokens exceed the context of 32") as err:
        s.submit(list(range(3, 23)), SamplingParams(max_tokens=13))
    assert isinstance(err.value, ValueError)
    s.submit(list(range(3, 23)), SamplingParams(max_tokens=12))          # exactly fits


def test_bad_prompts_and_stop_ids(model):
    s = Scheduler(model, parallel=1)
    with pytest.raises(ValueError, match="non-empty"):
        s.submit([], SamplingParams())
    V = model.vocab_size
    with pytest.raises(ValueError, match=rf"out of range \[0, {V}\): min 0, max {V}"):
        s.submit([0, V], SamplingParams())
    with pytest.raises(ValueError, match="stop_ids"):
        s.submit([5], SamplingParams(stop_ids=[5000]))
    with pytest.raises(ValueError, match="params must be a SamplingParams"):
        s.submit([5], dict(max_tokens=3))


def test_queue_full_raises_with_retry_after(model):
    s = Scheduler(model, parallel=1, max_queue=2)
    for _ in range(3):                              # one for the free slot, two waiting
        s.submit([5, 6], SamplingParams(max_tokens=4))
    with pytest.raises(QueueFullError, match="queue is full") as err:
        s.submit([5, 6], SamplingParams(max_tokens=4))
    assert err.value.retry_after > 0
    assert s.stats()["queue_depth"] == 3
    s.step()                                        # the slot took one: still two waiting
    with pytest.raises(QueueFullError):
        s.submit([5, 6], SamplingParams(max_tokens=4))
    no_wait = Scheduler(model, parallel=2, max_queue=0)
    no_wait.submit([5], SamplingParams(max_tokens=2))
    no_wait.submit([5], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        no_wait.submit([5], SamplingParams(max_tokens=2))


def test_admission_counts_kv_bytes(model):
    bpt = model.new_cache(ctx=1).nbytes
    s = Scheduler(model, parallel=4, ctx=64, kv_budget=40 * bpt)
    assert s.kv_bytes_per_token == bpt and s.stats()["kv_bytes_budget"] == 40 * bpt
    with pytest.raises(ContextLengthError, match="more than the whole budget"):
        s.submit([5] * 20, SamplingParams(max_tokens=21))
    a = s.submit([5] * 10, SamplingParams(max_tokens=20, stop_ids=[]))
    b = s.submit([6] * 10, SamplingParams(max_tokens=20, stop_ids=[]))
    s.step()
    st = s.stats()           # 30 + 30 tokens do not fit 40: b waits with slots free
    assert (st["slots_busy"], st["queue_depth"], st["kv_bytes_in_use"]) == (1, 1, 30 * bpt)
    run_all(s)
    assert a.finish_reason == b.finish_reason == "length"
    st = s.stats()
    assert (st["slots_busy"], st["queue_depth"], st["kv_bytes_in_use"]) == (0, 0, 0)
    assert st["requests_finished"] == 2 and st["tokens_out"] == 40 and st["tokens_in"] == 20


# ---------------------------------------------------------------------------------------------
# tokens, text and stops
# ---------------------------------------------------------------------------------------------

def test_batch_of_requests_equals_each_alone(model):
    s = Scheduler(model, parallel=3, prefill_chunk=4)
    hs = [s.submit(ids_of(model, p), SamplingParams(max_tokens=16)) for p in PROMPTS]
    run_all(s)
    for p, h in zip(PROMPTS, hs):
        evs = events(h)
        assert text_of(evs) == model.generate(p, max_new_tokens=16)
        assert h.completion_tokens == sum(e.token >= 0 for e in evs)
        assert evs[-1].finish_reason == h.finish_reason and h.prompt_tokens == len(ids_of(model, p))
        assert all(e.finish_reason is None for e in evs[:-1])


def test_stop_string_across_token_boundaries(model):
    prompt = ids_of(model, PROMPTS[0])
    s = Scheduler(model, parallel=1)
    h = s.submit(prompt, SamplingParams(max_tokens=24))
    run_all(s)
    pieces = [e.text for e in events(h)]
    full = "".join(pieces)
    j = next(k for k in range(2, len(pieces) - 2) if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2)
    for stop in (pieces[j][-2:] + pieces[j + 1][:2],                        # two tokens
                 pieces[j][-1:] + pieces[j + 1] + pieces[j + 2][:1]):       # three tokens
        cut = full.index(stop)
        h = s.submit(prompt, SamplingParams(max_tokens=24, stop=["zzzz", stop]))
        run_all(s)
        evs = events(h)
        assert text_of(evs) == full[:cut]
        assert evs[-1].finish_reason == "stop" and h.finish_reason == "stop"
        assert model.generate(PROMPTS[0], max_new_tokens=24, stop=[stop]) == full[:cut]


def test_stop_ids_end_without_the_token(model):
    prompt = ids_of(model, PROMPTS[0])
    s = Scheduler(model, parallel=1)
    first = s.submit(prompt, SamplingParams(max_tokens=8, stop_ids=[]))
    run_all(s)
    toks = [e.token for e in events(first)]
    h = s.submit(prompt, SamplingParams(max_tokens=8, stop_ids=[toks[3]]))
    run_all(s)
    evs = events(h)
    assert [e.token for e in evs[:-1]] == toks[:toks.index(toks[3])]
    assert evs[-1].token == -1 and evs[-1].finish_reason == "stop"


def test_logprobs_are_log_softmax_of_the_penalised_logits(model):
    prompt = ids_of(model, PROMPTS[1])
    s = Scheduler(model, parallel=1)
    p = SamplingParams(max_tokens=4, logprobs=5, presence_penalty=0.4, frequency_penalty=0.9,
                       stop_ids=[])
    h = s.submit(prompt, p)
    run_all(s)
    evs = events(h)
    toks = [e.token for e in evs]
    for i, ev in enumerate(evs):
        logits = model.forward(np.array(prompt + toks[:i]))[-1].astype(np.float64)
        for t in set(toks[:i]):                       # the OpenAI penalties, by hand
            c = toks[:i].count(t)
            logits[t] -= c * 0.9 + 0.4
        want = log_softmax(logits)
        assert ev.token == int(np.argmax(want))
        assert ev.logprob == pytest.approx(want[ev.token], abs=1e-4)
        best = np.argsort(-want)[:5]
        assert [t for t, _ in ev.top_logprobs] == list(best)
        np.testing.assert_allclose([v for _, v in ev.top_logprobs], want[best], atol=1e-4)
    h = s.submit(prompt, SamplingParams(max_tokens=2, logprobs=0))
    run_all(s)
    assert all(e.logprob is not None and e.top_logprobs is None for e in events(h)
               if e.token >= 0)


def test_routing_per_token_is_the_pass_that_consumed_it(model):
    prompt = ids_of(model, PROMPTS[2])
    s = Scheduler(model, parallel=2)
    h = s.submit(prompt, SamplingParams(max_tokens=5, return_routing=True, stop_ids=[]))
    other = s.submit(ids_of(model, PROMPTS[0]), SamplingParams(max_tokens=7))
    run_all(s)
    evs = events(h)
    toks = [e.token for e in evs]
    _, trace = model.forward(np.array(prompt + toks), return_routing=True)
    want = np.stack(trace.ids)                                             # (M, S, K)
    for i, ev in enumerate(evs):
        assert ev.routing.dtype == np.int32 and ev.routing.shape == want[:, 0].shape
        np.testing.assert_array_equal(ev.routing, want[:, len(prompt) + i])
    assert all(e.routing is None for e in events(other))


def test_seeded_sampling_is_the_same_whatever_else_runs(model):
    target = ids_of(model, PROMPTS[1])
    sp = SamplingParams(max_tokens=20, temperature=1.0, top_k=50, seed=1234)
    alone = Scheduler(model, parallel=1)
    h = alone.submit(target, sp)
    run_all(alone)
    want = [e.token for e in events(h)]
    busy = Scheduler(model, parallel=4, prefill_chunk=3)
    others = [busy.submit(ids_of(model, p), SamplingParams(max_tokens=30, temperature=0.8,
                                                           seed=i)) for i, p in enumerate(PROMPTS)]
    busy.step()
    busy.step()
    h = busy.submit(target, sp)
    run_all(busy)
    assert [e.token for e in events(h)] == want
    assert all(o.finish_reason for o in others)


# ---------------------------------------------------------------------------------------------
# continuous batching, cancel, errors, the thread
# ---------------------------------------------------------------------------------------------

def test_new_request_joins_and_long_prompt_is_chunked(model):
    s = Scheduler(model, parallel=2, prefill_chunk=8)
    seen: list[tuple[int, str]] = []
    step = [0]
    s.submit([5, 6, 7, 8], SamplingParams(max_tokens=40, stop_ids=[]),
             on_event=lambda ev: seen.append((step[0], "a")))
    for step[0] in range(3):
        s.step()
    s.submit(list(range(10, 50)), SamplingParams(max_tokens=3, stop_ids=[]),   # 5 chunks
             on_event=lambda ev: seen.append((step[0], "b")))
    for step[0] in range(3, 10):
        s.step()
    a_steps = [k for k, who in seen if who == "a"]
    assert a_steps == list(range(10))              # a token every step, prefill or not
    assert [k for k, who in seen if who == "b"][0] == 7   # 40 prompt tokens: steps 3..7
    assert s.stats()["tokens_in"] == 44


def test_cancel_frees_the_slot(model):
    s = Scheduler(model, parallel=1)
    a = s.submit([5, 6, 7], SamplingParams(max_tokens=50, stop_ids=[]))
    b = s.submit([8, 9], SamplingParams(max_tokens=3, stop_ids=[]))
    c = s.submit([8, 9], SamplingParams(max_tokens=3, stop_ids=[]))
    for _ in range(4):
        s.step()
    a.cancel()
    c.cancel()                                     # still queued
    s.step()
    evs = events(a)
    assert evs[-1].finish_reason == "cancelled" and a.finish_reason == "cancelled"
    assert a.completion_tokens == 4 == len(evs) - 1
    assert events(c)[-1].finish_reason == "cancelled" and c.completion_tokens == 0
    st = s.stats()
    assert (st["slots_busy"], st["queue_depth"]) == (1, 0)      # b took the slot at once
    run_all(s)
    assert b.finish_reason == "length" and s.stats()["kv_bytes_in_use"] == 0


def test_forward_error_ends_the_requests_with_error(model, monkeypatch):
    s = Scheduler(model, parallel=2)
    h = s.submit([5, 6], SamplingParams(max_tokens=3))

    def boom(*a, **k):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(model, "forward_ragged", boom)
    monkeypatch.setattr(model, "forward", boom)       # a step of one request runs forward
    assert s.step()
    evs = events(h)
    assert evs[-1].finish_reason == "error" and isinstance(h.error, RuntimeError)
    assert s.stats()["kv_bytes_in_use"] == 0 and not s.step()


def test_nan_logits_end_that_request_only(model, monkeypatch):
    s = Scheduler(model, parallel=2)
    bad = s.submit([5, 6], SamplingParams(max_tokens=3, stop_ids=[]))
    good = s.submit([7, 8], SamplingParams(max_tokens=3, stop_ids=[]))
    fast = model.forward_ragged

    def poisoned(segments, return_routing=False):
        logits = fast(segments, return_routing)
        logits[0] = np.nan                          # the first segment: bad's
        return logits

    monkeypatch.setattr(model, "forward_ragged", poisoned)
    s.step()
    monkeypatch.setattr(model, "forward_ragged", fast)
    run_all(s)
    assert bad.finish_reason == "error" and "NaN" in str(bad.error)
    assert good.finish_reason == "length" and good.completion_tokens == 3


def test_broken_on_event_cancels_its_request(model):
    s = Scheduler(model, parallel=1)

    def broken(ev):
        raise OSError("client went away")

    h = s.submit([5, 6], SamplingParams(max_tokens=30, stop_ids=[]), on_event=broken)
    s.step()
    s.step()
    assert h.finish_reason == "cancelled" and s.stats()["slots_busy"] == 0


def test_background_thread_serves_concurrent_clients(model):
    s = Scheduler(model, parallel=3, max_queue=16)
    s.start()
    results: dict[int, str] = {}
    calls = []

    def client(i):
        h = s.submit(ids_of(model, PROMPTS[i % 4]), SamplingParams(max_tokens=12),
                     on_event=calls.append)
        results[i] = text_of(events(h))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    s.stop()
    for i, text in results.items():
        assert text == model.generate(PROMPTS[i % 4], max_new_tokens=12)
    assert len(results) == 6 and sum(e.finish_reason is not None for e in calls) == 6
    st = s.stats()
    assert st["requests_finished"] == 6 and st["kv_bytes_in_use"] == 0
    with pytest.raises(ColibriError, match="stopped"):
        s.submit([5], SamplingParams())


def test_stop_without_drain_cancels(model):
    s = Scheduler(model, parallel=1)
    s.start()
    a = s.submit([5, 6], SamplingParams(max_tokens=500, stop_ids=[]))
    b = s.submit([5, 6], SamplingParams(max_tokens=5, stop_ids=[]))
    next(iter(a))                                  # a is running
    s.stop(drain=False)
    assert events(a)[-1].finish_reason == "cancelled"
    assert b.finish_reason == "cancelled"
    assert s.stats()["kv_bytes_in_use"] == 0


# ---------------------------------------------------------------------------------------------
# a request alone, embeddings, no text: what colibri.generate's one prompt runs on
# ---------------------------------------------------------------------------------------------

def test_a_request_alone_gets_the_bits_of_forward(model):
    """Alone in its steps a request runs through Model.forward: each logprob is exactly
    log_softmax of colibri.forward's logits through one cache (the prompt, then one token at
    a time), also when the prefix cache gave it 32 tokens (the other 8 then take forward's
    general path, not the ragged step's row attention), and its routing is the full
    RoutingTrace of each token's pass."""
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, model.vocab_size, 40)]
    s = Scheduler(model, parallel=1)
    for cached in (0, 32):                          # the second finds the first's blocks
        h = s.submit(prompt, SamplingParams(max_tokens=4, logprobs=0, stop_ids=[],
                                            return_routing=True))
        run_all(s)
        evs = [e for e in events(h) if e.token >= 0]
        assert h.cached_tokens == cached and len(evs) == 4
        cache = model.new_cache(ctx=64)
        logits = model.forward(np.array(prompt), cache=cache, last_only=True)[-1]
        if cached:
            cache.truncate(cached)
            logits = model.forward(np.array(prompt[cached:]), cache=cache, last_only=True)[-1]
        for ev in evs:
            assert ev.logprob == float(log_softmax(logits)[ev.token])
            out, trace = model.forward(np.array([ev.token]), cache=cache, last_only=True,
                                       return_routing=True)
            logits = out[-1]
            for got, want in zip(ev.trace.ids + ev.trace.weights, trace.ids + trace.weights):
                np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(ev.routing, np.stack(trace.ids)[:, -1])


def test_a_prompt_of_embeddings_and_events_without_text(model):
    """input_embeds: the same greedy tokens as the prompt's ids (beside it in the same
    steps); detokenize=False: the ids without text, and no stop strings."""
    prompt = ids_of(model, PROMPTS[3])
    x = model.embed(np.array([prompt]))[0]
    s = Scheduler(model, parallel=2)
    by_ids = s.submit(prompt, SamplingParams(max_tokens=6, stop_ids=[]))
    by_x = s.submit([], SamplingParams(max_tokens=6, stop_ids=[], detokenize=False),
                    input_embeds=x)
    run_all(s)
    a, b = events(by_ids), events(by_x)
    assert [e.token for e in a] == [e.token for e in b] and len(b) == 6
    assert text_of(a) and all(e.text == "" for e in b)
    assert by_x.prompt_tokens == len(prompt) and by_x.cached_tokens == 0
    with pytest.raises(ValueError, match="stop"):
        s.submit(prompt, SamplingParams(stop=["x"], detokenize=False))
    with pytest.raises(ValueError, match="input_embeds must be"):
        s.submit([], SamplingParams(), input_embeds=x[:0])
    with pytest.raises(ValueError, match="prompt_logprobs"):
        s.submit([], SamplingParams(prompt_logprobs=1), input_embeds=x)
    with pytest.raises(ValueError, match="not both"):
        s.submit(prompt, SamplingParams(), input_embeds=x)
