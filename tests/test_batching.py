"""The ragged step (Model.forward_ragged) and model.generate([p, p, ...]): each sequence of a
batch gets what it gets alone, and what transformers computes for it."""
from __future__ import annotations

import numpy as np
import pytest

import colibri
import colibri.api as api
from numeric import assert_close

pytest.importorskip("transformers")

from routing_models import converted  # noqa: E402

# max |logit error| / max(1, max |logit|) of a row inside a ragged step against the same row
# through its own forward. f32 activations: the kernels sum a block of tokens in another order
# than one token (kernels.linear's notes: the f32 GEMM path from 4 rows, the routers among
# others), ~1.4e-6 measured; 16-bit codes amplify such last-bit differences through the
# layers, ~4e-5 measured (shipped model, q4 experts); int8 codes ~2e-6 on the random test
# models, but one flipped code can cost ~1e-2 (measured on a 1024-wide q4 model,
# docs/batching.md; 2.7e-3 on the shipped chat model): that bound, for int8.
TOL = {"f32": 1e-5, "int16": 2e-4, "int8": 1e-2}
HF_TOL = 1e-4                 # against transformers' float32 logits (test_model.F32_TOL)


@pytest.fixture(scope="module")
def shipped():
    return {act: api.load(colibri.default_model_path(), threads=1, activations=act,
                           kv_dtype="f32")
            for act in TOL}


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def family(request, hf_checkpoint, tmp_path_factory):
    src, m = converted(hf_checkpoint, tmp_path_factory, request.param)
    yield src, m
    m.close()


def _prompts(model, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, model.vocab_size, n) for n in lengths]


def _alone(model, prompt, feed):
    """Logits of the last prompt token, then of each token of `feed`, through one cache."""
    cache = model.new_cache(ctx=64)
    rows = [model.forward(prompt, cache=cache, last_only=True)[-1]]
    rows += [model.forward(np.array([t]), cache=cache)[-1] for t in feed]
    return rows


# ---------------------------------------------------------------------------------------------
# the ragged step
# ---------------------------------------------------------------------------------------------

def _ragged_vs_alone(model, tol):
    prompts = _prompts(model, (5, 17, 1, 9))
    feed = (3, 7, 11)
    want = [_alone(model, p, feed) for p in prompts]
    caches = [model.new_cache(ctx=64) for _ in prompts]
    got = [[row] for row in model.forward_ragged(list(zip(caches, prompts)))]
    for t in feed:
        for j, row in enumerate(model.forward_ragged([(c, [t]) for c in caches])):
            got[j].append(row)
    for g, w in zip(got, want):
        assert_close(np.stack(g), np.stack(w), tol)
    assert [c.length for c in caches] == [len(p) + len(feed) for p in prompts]


@pytest.mark.parametrize("act", list(TOL))
def test_ragged_matches_each_sequence_alone_shipped(shipped, act):
    _ragged_vs_alone(shipped[act], TOL[act])


def test_ragged_matches_each_sequence_alone_families(family):
    _ragged_vs_alone(family[1], TOL["f32"])


@pytest.fixture(scope="module")
def q4_all(hf_checkpoint, tmp_path_factory):
    """tiny Mixtral with every matrix at q4 (attention and head too), per activations."""
    from colibri.convert import convert
    src = hf_checkpoint("mixtral", initializer_range=0.15)
    path = convert(src, tmp_path_factory.mktemp("q4all") / "m.colibri", dtype="f32",
                   quant="q4", quantize="experts,shared,attn,head,dense", progress=False)
    models = {act: api.load(path, threads=1, activations=act, kv_dtype="f32")
              for act in TOL}
    yield models
    for m in models.values():
        m.close()


@pytest.mark.parametrize("act", list(TOL))
def test_ragged_matches_each_sequence_alone_q4(q4_all, act):
    _ragged_vs_alone(q4_all[act], TOL[act])


def test_ragged_mixes_decode_tokens_and_a_prefill_chunk(shipped):
    """One step holding two decoding sequences and the second chunk of a third's prompt."""
    m = shipped["f32"]
    a, b, c = _prompts(m, (6, 4, 20), seed=1)
    ca, cb, cc = (m.new_cache(ctx=64) for _ in range(3))
    m.forward_ragged([(ca, a), (cb, b), (cc, c[:8])])
    got = m.forward_ragged([(ca, [9]), (cc, c[8:]), (cb, [4])])
    want = [_alone(m, a, [9])[-1], _alone(m, c, [])[-1], _alone(m, b, [4])[-1]]
    assert_close(got, np.stack(want), TOL["f32"])


def test_ragged_routing_is_the_forward_trace(family):
    m = family[1]
    prompts = _prompts(m, (3, 7))
    caches = [m.new_cache(ctx=16) for _ in prompts]
    _, routing = m.forward_ragged(list(zip(caches, prompts)), return_routing=True)
    for p, r in zip(prompts, routing):
        _, trace = m.forward(p, return_routing=True)
        assert r.dtype == np.int32 and r.shape == (len(m.moe_layers), len(p),
                                                  m.config.num_experts_per_tok)
        np.testing.assert_array_equal(r, np.stack(trace.ids))


def test_ragged_matches_transformers_for_a_batch(family):
    """Prompts of different lengths prefilled in one step, then one decode step for all:
    each last-token row against transformers on that sequence alone."""
    import torch

    from hf_factory import load_hf_model
    src, m = family
    hf = load_hf_model(src)
    prompts = _prompts(m, (4, 11, 7), seed=2)
    caches = [m.new_cache(ctx=32) for _ in prompts]
    first = m.forward_ragged(list(zip(caches, prompts)))
    nxt = [int(np.argmax(r)) for r in first]
    second = m.forward_ragged([(c, [t]) for c, t in zip(caches, nxt)])
    for j, p in enumerate(prompts):
        with torch.no_grad():
            ids = torch.tensor(np.append(p, nxt[j])[None])
            want = hf(ids).logits[0].float().numpy()
        assert_close(first[j], want[-2], HF_TOL)
        assert_close(second[j], want[-1], HF_TOL)


def test_ragged_rejects_bad_segments(shipped):
    m = shipped["f32"]
    c = m.new_cache(ctx=4)
    with pytest.raises(ValueError, match="non-empty list"):
        m.forward_ragged([])
    with pytest.raises(ValueError, match="segment 1: its cache is already used"):
        m.forward_ragged([(c, [1]), (c, [2])])
    V = m.vocab_size
    with pytest.raises(ValueError, match=rf"segment 0: ids out of range \[0, {V}\)"):
        m.forward_ragged([(c, [V])])
    with pytest.raises(ValueError, match="segment 0: cache must be for one sequence"):
        m.forward_ragged([(m.new_cache(ctx=4, batch=2), [1])])
    with pytest.raises(colibri.CacheOverflowError, match="ctx 4"):
        m.forward_ragged([(c, [1, 2, 3, 4, 5])])
    assert c.length == 0                                    # nothing ran


# ---------------------------------------------------------------------------------------------
# model.generate over several prompts
# ---------------------------------------------------------------------------------------------

def test_generate_batch_greedy_equals_each_alone_shipped(shipped):
    m = shipped["int16"]
    prompts = ["def fib(n):", "Once upon a time", "import numpy as np\n", "The hummingbird",
               "class Node:"]
    got = m.generate(prompts, max_new_tokens=24, parallel=3)
    assert got == [m.generate(p, max_new_tokens=24) for p in prompts]
    assert len(m.generate(prompts[:2], max_new_tokens=24) and m.last_stats) == 2


def test_generate_batch_greedy_equals_each_alone_families(family):
    m = family[1]
    prompts = [list(p) for p in _prompts(m, (3, 9, 5, 1), seed=3)]
    got = m.generate(prompts, max_new_tokens=12, stop=[])
    for p, g in zip(prompts, got):
        np.testing.assert_array_equal(g, m.generate(p, max_new_tokens=12, stop=[]))


def test_generate_batch_stops_each_sequence_on_its_own(shipped):
    m = shipped["int16"]
    prompts = ["def fib(n):", "Once upon a time", "The hummingbird"]
    got = m.generate(prompts, max_new_tokens=30, stop=["\n\n", "return"])
    want = [m.generate(p, max_new_tokens=30, stop=["\n\n", "return"]) for p in prompts]
    assert got == want
    reasons = [s.finish_reason for s in m.generate(prompts, max_new_tokens=30,
                                                   stop=["\n\n", "return"]) and m.last_stats]
    assert "stop" in reasons


def test_generate_batch_stream_yields_index_and_piece(shipped):
    m = shipped["int16"]
    prompts = ["def fib(n):", "Once upon a time"]
    pairs = list(m.generate(prompts, max_new_tokens=10, stream=True))
    assert {i for i, _ in pairs} == {0, 1}
    joined = ["".join(p for i, p in pairs if i == j) for j in range(2)]
    assert joined == m.generate(prompts, max_new_tokens=10)
    # interleaved: both sequences produce pieces before either is done
    first_of_1 = next(k for k, (i, _) in enumerate(pairs) if i == 1)
    last_of_0 = max(k for k, (i, _) in enumerate(pairs) if i == 0)
    assert first_of_1 < last_of_0
    ids = list(m.generate([[5, 6, 7], [8, 9]], max_new_tokens=4, stop=[], stream=True))
    assert sorted(i for i, _ in ids) == [0] * 4 + [1] * 4
    assert all(isinstance(t, int) for _, t in ids)


def test_generate_batch_seeded_sampling_equals_alone(shipped):
    m = shipped["int16"]
    prompts = ["def fib(n):", "Once upon a time", "The hummingbird"]
    kw = dict(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=11)
    assert m.generate(prompts, **kw) == [m.generate(p, **kw) for p in prompts]


def test_batch_without_a_tokenizer(hf_checkpoint, tmp_path_factory):
    import warnings

    from colibri.generation.batching import SamplingParams, Scheduler
    from colibri.convert import convert
    src = hf_checkpoint("olmoe", tokenizer=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = convert(src, tmp_path_factory.mktemp("bare") / "m.colibri", dtype="f32",
                       progress=False)
    m = api.load(path, threads=1, kv_dtype="f32")
    prompts = [[5, 6, 7], [9, 10]]
    got = m.generate(prompts, max_new_tokens=6, stop=[])
    for p, g in zip(prompts, got):
        np.testing.assert_array_equal(g, m.generate(p, max_new_tokens=6, stop=[]))
    s = Scheduler(m, parallel=2)
    h = s.submit([5, 6], SamplingParams(max_tokens=3, stop_ids=[]))
    while s.step():
        pass
    assert [e.text for e in h] == ["", "", ""] and h.finish_reason == "length"
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        s.submit([5, 6], SamplingParams(stop=["x"]))
    m.close()


def test_generate_batch_ctx_and_errors(shipped):
    m = shipped["int16"]
    ids = [[5, 6, 7], [8, 9]]
    got = m.generate(ids, max_new_tokens=10, stop=[], ctx=6)
    assert [len(g) for g in got] == [3, 4]                  # ctx - prompt each
    for p, g in zip(ids, got):
        np.testing.assert_array_equal(g, m.generate(p, max_new_tokens=10, stop=[], ctx=6))
    assert [g.size for g in m.generate(ids, max_new_tokens=0)] == [0, 0]
    with pytest.raises(ValueError, match="all text prompts or all token ids"):
        m.generate(["abc", [5, 6]])
    with pytest.raises(ValueError, match="return_routing and input_embeds work with one prompt"):
        m.generate(["abc", "de"], return_routing=True)
    with pytest.raises(colibri.ColibriError, match="prompt 1 has 5 tokens but ctx is 5"):
        m.generate([[1], [1, 2, 3, 4, 5]], ctx=5)


def test_single_prompt_generate_unchanged(shipped):
    """A list of ids is one prompt, as before; a (1, S) array too."""
    m = shipped["int16"]
    one = m.generate([5, 6, 7], max_new_tokens=5, stop=[])
    assert isinstance(one, np.ndarray) and one.shape == (5,)
    np.testing.assert_array_equal(m.generate(np.array([[5, 6, 7]]), max_new_tokens=5, stop=[]),
                                  one)
    two = m.generate(np.array([[5, 6, 7], [5, 6, 7]]), max_new_tokens=5, stop=[])
    assert len(two) == 2 and all(np.array_equal(t, one) for t in two)
