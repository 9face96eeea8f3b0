"""Speculation inside continuous batching (colibri.generation.speculative_batch) and `serve
--draft`: every request gets, token for token, what the plain Scheduler gives it at temperature 0,
through the real server and the official openai client too."""
from __future__ import annotations

import numpy as np
import pytest

import colibri
import colibri.api as api
from colibri.generation.batching import SamplingParams, Scheduler
from colibri.generation.drafters import Backoff
from colibri.generation.speculative_batch import Speculation, SpeculativeScheduler

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n" * 2


@pytest.fixture(autouse=True)
def untimed_backoff(monkeypatch):
    """Back off on acceptance only: on these tiny models a verification costs several plain
    steps, and the timed backoff would (rightly) stop speculating after a probe or two,
    leaving the paths under test unexercised."""
    import colibri.generation.speculative_batch as where
    monkeypatch.setattr(where, "Backoff", lambda k, timed=True: Backoff(k, timed=False))

@pytest.fixture(scope="module")
def shipped():
    return api.load(colibri.default_model_path())


def _run(sched, prompts, params):
    handles = [sched.submit(p, params[i % len(params)]) for i, p in enumerate(prompts)]
    while sched.step():
        pass
    return [[(e.token, e.text, e.finish_reason) for e in h] for h in handles]


def test_batched_speculation_is_the_plain_scheduler(shipped):
    tok = shipped.tokenizer
    prompts = [tok.encode(CODE), tok.encode("Once upon a time"), tok.encode(CODE[:60]),
               tok.encode("def f(x):"), tok.encode(CODE + CODE)]
    params = [SamplingParams(max_tokens=40, stop_ids=[]),
              SamplingParams(max_tokens=25, stop=["return"]),
              SamplingParams(max_tokens=30, repetition_penalty=1.2),
              SamplingParams(max_tokens=20, logprobs=2)]          # this one decodes plainly
    want = _run(Scheduler(shipped, parallel=3), prompts, params)
    spec = SpeculativeScheduler(shipped, Speculation(shipped, "prompt-lookup", 4), parallel=3)
    got = _run(spec, prompts, params)
    assert [[t for t, _, _ in g] for g in got] == [[t for t, _, _ in w] for w in want]
    assert got == want
    st = spec.stats()
    assert 0 < st["accepted_tokens"] <= st["draft_tokens"]


def test_batched_draft_model_and_its_errors(shipped):
    tok = shipped.tokenizer
    prompts = [tok.encode(CODE), tok.encode("Hello there")]
    params = [SamplingParams(max_tokens=24, stop_ids=[])]
    want = _run(Scheduler(shipped, parallel=2), prompts, params)
    spec = SpeculativeScheduler(shipped, Speculation(shipped, shipped, 3), parallel=2)
    assert _run(spec, prompts, params) == want
    assert spec.stats()["accepted_tokens"] == spec.stats()["draft_tokens"] > 0   # itself
    with pytest.raises(ValueError, match="num_draft_tokens"):
        Speculation(shipped, "prompt-lookup", 33)


def test_serve_with_draft_through_the_openai_client():
    pytest.importorskip("fastapi")
    from colibri.server.settings import Settings
    from server_helpers import client, running_server
    import urllib.request
    texts = []
    for draft in (None, "prompt-lookup"):
        with running_server(Settings(parallel=2, draft=draft, draft_tokens=4)) as (url, _):
            c = client(url)
            r = c.completions.create(model="tiny-moe", prompt=[CODE, CODE[:70]], max_tokens=40,
                                     temperature=0)
            chunks = c.completions.create(model="tiny-moe", prompt=CODE, max_tokens=40,
                                          temperature=0, stream=True)
            streamed = "".join(ch.choices[0].text for ch in chunks)
            texts.append(([ch.text for ch in r.choices], streamed))
            metrics = urllib.request.urlopen(f"{url}/metrics").read().decode()
            assert ("colibri_draft_tokens_total" in metrics) == (draft is not None)
    assert texts[1] == texts[0] and texts[0][1] == texts[0][0][0]
    from colibri.errors import ColibriError
    with pytest.raises(ColibriError, match="no such file"):
        Settings(draft="/nonexistent.colibri").check()


def test_a_prompt_of_embeddings_beside_drafting_requests(shipped):
    """A request whose prompt is embeddings prefills alone (Scheduler._forward_embeds) while
    other requests carry drafts in the same step; everyone gets the plain Scheduler's tokens.
    Drafting pauses and resumes (the backoff), so the second request comes at each step of
    the first's decoding in turn: some of those steps carry drafts."""
    tok = shipped.tokenizer
    code = tok.encode(CODE + CODE)
    emb = shipped.embed(np.array([tok.encode("def mul(a, b):")]))[0]
    params = SamplingParams(max_tokens=30, stop_ids=[])

    def run(sched, after):
        first = sched.submit(code, params)
        for _ in range(after):
            sched.step()
        second = sched.submit([], params, input_embeds=emb)
        while sched.step():
            pass
        return [e.token for e in first], [e.token for e in second]

    mixed = 0
    for after in range(2, 12):
        want = run(Scheduler(shipped, parallel=2), after)
        spec = SpeculativeScheduler(shipped, Speculation(shipped, "prompt-lookup", 4),
                                    parallel=2)
        seen = set()                # what the current step ran: drafts, an embeddings prompt
        speculate, forward, step = spec.speculation.forward, shipped.forward, spec.step

        def drafts(*a, **kw):
            seen.add("drafts")
            return speculate(*a, **kw)

        def embeds(*a, **kw):
            if kw.get("input_embeds") is not None:
                seen.add("embeds")
            return forward(*a, **kw)

        def one_step():
            seen.clear()
            out = step()
            nonlocal mixed
            mixed += seen == {"drafts", "embeds"}
            return out

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(spec.speculation, "forward", drafts)
            mp.setattr(shipped, "forward", embeds)
            mp.setattr(spec, "step", one_step)
            assert run(spec, after) == want, after
    assert mixed > 0


def test_steps_without_drafts_are_plain_scheduler_steps(shipped, monkeypatch):
    """A step where no request carries drafts (nothing to look up, or a paused backoff)
    runs the plain Scheduler's pass, and a paused backoff does not ask the drafter."""
    class Never:                                  # a drafter with nothing to propose
        asked = 0

        def start(self, prompt, ctx):
            pass

        def propose(self, history, k, sampler, n_prompt=0):
            Never.asked += 1
            return [], None

        def accepted(self, length):
            pass

    forwarded = []
    real = Speculation.forward
    monkeypatch.setattr(Speculation, "forward",
                        lambda self, *a: forwarded.append(1) or real(self, *a))
    tok = shipped.tokenizer
    params = [SamplingParams(max_tokens=30, stop_ids=[])]
    want = _run(Scheduler(shipped, parallel=1), [tok.encode(CODE)], params)
    spec = SpeculativeScheduler(shipped, Speculation(shipped, Never(), 4), parallel=1)
    assert _run(spec, [tok.encode(CODE)], params) == want
    # 29 decode steps after the prefill's token; the last has no room for a draft
    assert forwarded == [] and Never.asked == 28
    assert spec.stats()["draft_tokens"] == 0

    paused = Backoff(4, timed=False)
    paused.pause = 10 ** 6
    monkeypatch.setattr("colibri.generation.speculative_batch.Backoff",
                        lambda k, timed=True: paused)
    Never.asked = 0
    spec = SpeculativeScheduler(shipped, Speculation(shipped, Never(), 4), parallel=1)
    assert _run(spec, [tok.encode(CODE)], params) == want
    assert Never.asked == 0 and forwarded == []
