"""Speculative decoding (generate(..., draft=...): colibri.generation.speculative's rule, the
drafters, a SpeculativeScheduler's loop): greedy output token for token that of plain decoding on
several families and the shipped model, a drafter of one's own, the statistics, the context limit,
the cache rollback bit for bit against a cache that never saw the rejected tokens (MLA, sliding
windows, sinks), and the rejection rule keeping the target distribution (chi-square)."""
from __future__ import annotations

import numpy as np
import pytest

import colibri
import colibri.api as api
from colibri.generation.drafters import (Backoff, DraftMismatchError, DraftModel, PromptLookup,
                                         make_drafter)
from colibri.generation.sampling import Sampler
from colibri.generation.speculative import SpeculativeStats, judge, verify

pytest.importorskip("transformers")
scipy_stats = pytest.importorskip("scipy.stats")

from routing_models import converted  # noqa: E402


@pytest.fixture(autouse=True)
def untimed_backoff(monkeypatch):
    """Back off on acceptance only: on these tiny models a verification costs several plain
    steps, and the timed backoff would (rightly) stop speculating after a probe or two,
    leaving the paths under test unexercised."""
    import colibri.generation.speculative_batch as where
    monkeypatch.setattr(where, "Backoff", lambda k, timed=True: Backoff(k, timed=False))

# ---------------------------------------------------------------------------------------------
# drafters
# ---------------------------------------------------------------------------------------------

def test_prompt_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    pl = PromptLookup(max_ngram=3, min_ngram=1)
    h = [5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6, 7]
    # the 3-gram 5 6 7 occurs at 0 only: what followed it
    assert pl.propose(h, 3)[0] == [8, 1, 6]
    # 2-gram 6 7 (no earlier 3-gram 9 6 7): the latest earlier occurrence, at 5
    assert pl.propose([5, 6, 7, 8, 1, 6, 7, 9, 3, 6, 7], 2)[0] == [9, 3]
    assert pl.propose([1, 2, 3, 4], 4) == ([], None)                 # nothing to look up
    assert pl.propose([4, 4], 3)[0] == [4, 4, 4]                     # a loop: continued
    assert pl.propose([1, 7, 8, 7, 8], 5)[0] == [7, 8, 7, 8, 7]      # period 2
    assert PromptLookup(max_ngram=2, min_ngram=2).propose([1, 2, 3, 1, 9, 1], 2) == ([], None)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(max_ngram=1, min_ngram=2)


def test_backoff_shortens_and_pauses_then_recovers():
    b = Backoff(4, timed=False)
    assert b.next_length() == 4
    b.update(4, 1)
    assert b.next_length() == 2                          # a + 1
    b.update(2, 0)
    assert b.next_length() == 1                          # first miss: shortest, no pause
    b.update(1, 0)                                       # second miss: pause 4 steps
    assert [b.next_length() for _ in range(5)] == [0, 0, 0, 0, 1]
    b.update(1, 1)
    assert b.next_length() == 2 and b.misses == 0        # all accepted: grows again
    for _ in range(20):
        b.update(b.next_length() or 1, 0)
    assert b.pause <= 64


def test_timed_backoff_pauses_when_verifying_costs_more_than_it_saves():
    b = Backoff(4)
    assert [b.next_length() for _ in range(4)] == [0, 0, 0, 1]   # plain steps measured first,
    b.update(0, 0, 0.500)                  # then a probe of one draft; the first plain step
    b.update(0, 0, 0.010)                  # builds the decode state: not counted
    b.update(0, 0, 0.010)
    for d, seconds in ((1, 0.012), (2, 0.016), (3, 0.020)):   # every draft kept, paying:
        b.update(d, d, seconds)                                # one more each time
        assert b.next_length() == d + 1
    b.update(4, 4, 0.030)                  # 5 tokens in 30 ms: 6 ms each, pays
    assert b.next_length() == 4 and b.misses == 0
    for i in range(10):                    # 3 of 4 accepted in 45 ms: 11.25 ms a token
        b.update(4, 3, 0.045)
        if b.misses >= 2:
            break
    assert b.misses == 2 and 4 <= i <= 8   # the running mean crossed plain's 10 ms
    assert [b.next_length() for _ in range(5)] == [0, 0, 0, 0, 4]   # paused, then a probe
    b.update(4, 4, 0.051)                  # slower than 5 plain steps: cannot ever pay
    assert b.pause == 64


# ---------------------------------------------------------------------------------------------
# temperature 0: the tokens of plain decoding
# ---------------------------------------------------------------------------------------------

REPEATING = [7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12, 7, 8]


def _both(m, prompt, n=40, **kw):
    plain = m.generate(prompt, max_new_tokens=n, stop=[], **{k: v for k, v in kw.items()
                                                            if k != "draft"})
    spec = m.generate(prompt, max_new_tokens=n, stop=[], **kw)
    return plain, spec, m.last_stats


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
                                        "deepseek_v2"])
def family(request, hf_checkpoint, tmp_path_factory):
    _, m = converted(hf_checkpoint, tmp_path_factory, request.param)
    yield m
    m.close()


def test_greedy_prompt_lookup_is_plain_decoding(family):
    drafted = accepted = 0
    for prompt, kw in ((REPEATING, {}), (list(range(20, 52)), {}),
                       (REPEATING, dict(repetition_penalty=1.3)), (REPEATING * 3, {})):
        plain, spec, st = _both(family, np.array(prompt), draft="prompt-lookup",
                                num_draft_tokens=5, **kw)
        np.testing.assert_array_equal(spec, plain)
        drafted += st.draft_tokens
        accepted += st.accepted_tokens
    assert 0 < accepted < drafted                 # both outcomes were exercised


def test_greedy_draft_model_is_plain_decoding(hf_checkpoint, tmp_path_factory, family):
    if family.config.family != "mixtral":
        pytest.skip("one family is enough for the draft model's bookkeeping")
    _, other = converted(hf_checkpoint, tmp_path_factory, "mixtral", seed=3)  # same tokenizer
    for draft in (family, other):
        plain, spec, st = _both(family, np.array(REPEATING), n=30, draft=draft,
                                num_draft_tokens=3)
        np.testing.assert_array_equal(spec, plain)
        assert st.verify_passes > 0
        if draft is family:                       # itself as its draft: every draft accepted
            assert st.accepted_tokens == st.draft_tokens > 0


def test_shipped_model_prompt_lookup_and_stops():
    m = api.load(colibri.default_model_path())
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n" * 3
    plain, spec, st = _both(m, code, n=80, draft="prompt-lookup", num_draft_tokens=6)
    assert spec == plain and st.accepted_tokens > 0
    assert st.experts_per_token > 0 and 0 < st.acceptance_rate <= 1
    # a stop string and the model's own stop ids end it at the same place
    for kw in (dict(stop=["return"]), dict(stop=None), dict(max_new_tokens=7)):
        kw = dict(dict(max_new_tokens=60), **kw)
        a = m.generate(code, **kw)
        assert m.generate(code, draft="prompt-lookup", **kw) == a
    ids = m.generate(m.tokenizer.encode(code), max_new_tokens=30)
    np.testing.assert_array_equal(m.generate(m.tokenizer.encode(code), max_new_tokens=30,
                                             draft="prompt-lookup"), ids)


class Fixed:
    """A drafter of one's own (start, propose, accepted only): drafts `ahead` copied from a
    known continuation, the calls it saw recorded."""

    def __init__(self, continuation, ahead=True):
        self.continuation, self.ahead = list(continuation), ahead
        self.calls, self.proposed, self.started = [], 0, None

    def start(self, prompt, ctx):
        self.started, self.n_prompt = (len(prompt), ctx), len(prompt)

    def propose(self, history, k, sampler=None, n_prompt=0):
        at = len(history) - self.n_prompt
        drafts = self.continuation[at:at + k] if self.ahead else []
        self.proposed += bool(drafts)
        return drafts, None

    def accepted(self, length):
        self.calls.append(length)


def test_a_drafter_of_ones_own_and_the_stats():
    m = api.load(colibri.default_model_path())
    M, K = len(m.moe_layers), m.config.num_experts_per_tok
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n" * 2
    plain = m.generate(m.tokenizer.encode(code), max_new_tokens=30, stop=[])
    # drafts that are the continuation: every one accepted, fewer passes
    d = Fixed(plain)
    spec = m.generate(m.tokenizer.encode(code), max_new_tokens=30, stop=[], draft=d,
                      num_draft_tokens=4)
    st = m.last_stats
    np.testing.assert_array_equal(spec, plain)
    assert isinstance(st, SpeculativeStats) and d.started[0] == len(m.tokenizer.encode(code))
    assert st.verify_passes == d.proposed > 0 and st.accepted_tokens == st.draft_tokens
    assert st.decode_steps < 29 and st.generated_tokens == 30
    assert st.draft_seconds > 0 and st.draft_seconds < st.decode_seconds
    plain_passes = st.decode_steps - st.verify_passes
    assert plain_passes * M * K < st.experts_read <= (plain_passes * M * K
                                                       + (st.draft_tokens + st.verify_passes) * M * K)
    assert d.calls and d.calls == sorted(d.calls)
    # drafts never offered: plain passes only, each reading M * K experts
    m.generate(code, max_new_tokens=12, stop=[], draft=Fixed(plain, ahead=False))
    st = m.last_stats
    assert st.verify_passes == st.draft_tokens == 0 and st.decode_steps == 11
    assert st.experts_read == 11 * M * K and st.experts_per_token == M * K
    # wrong drafts: rejected, the output still plain decoding's
    wrong = Fixed([(t + 1) % m.vocab_size for t in plain])
    np.testing.assert_array_equal(m.generate(m.tokenizer.encode(code), max_new_tokens=30,
                                             stop=[], draft=wrong), plain)
    assert m.last_stats.verify_passes > 0 and m.last_stats.accepted_tokens == 0
    # one request at a time: a batched scheduler refuses a drafter that keeps state
    from colibri.generation.speculative_batch import Speculation, SpeculativeScheduler
    with pytest.raises(ValueError, match="parallel=1"):
        SpeculativeScheduler(m, Speculation(m, Fixed(plain)), parallel=2)


@pytest.mark.parametrize("draft", ["prompt-lookup", "self"])
def test_generation_up_to_the_context_limit(draft):
    m = api.load(colibri.default_model_path())
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n" * 2
    ids = m.tokenizer.encode(code)
    for room in (1, 2, 7):
        kw = dict(max_new_tokens=40, stop=[], ctx=len(ids) + room)
        plain = m.generate(ids, **kw)
        spec = m.generate(ids, draft=m if draft == "self" else draft, **kw)
        st = m.last_stats
        np.testing.assert_array_equal(spec, plain)
        assert st.generated_tokens == room and st.finish_reason == "ctx"
        assert st.decode_steps <= room - 1           # no pass feeds the last token


def test_bad_arguments_are_named(tmp_path):
    m = api.load(colibri.default_model_path())
    with pytest.raises(ValueError, match="num_draft_tokens"):
        m.generate("hi", draft="prompt-lookup", num_draft_tokens=0)
    with pytest.raises(ValueError, match="one prompt"):
        m.generate(["a", "b"], draft="prompt-lookup")
    with pytest.raises(FileNotFoundError, match="no-such"):
        m.generate("hi", draft=str(tmp_path / "no-such.colibri"))
    with pytest.raises(TypeError, match="draft must be"):
        m.generate("hi", draft=3)


def test_draft_with_another_tokenizer_is_refused(hf_checkpoint, tmp_path_factory):
    _, a = converted(hf_checkpoint, tmp_path_factory, "mixtral")
    shipped = api.load(colibri.default_model_path())
    with pytest.raises(DraftMismatchError, match=str(a.file.path)):
        DraftModel(a, shipped)
    with pytest.raises(DraftMismatchError, match="vocabulary"):
        make_drafter(shipped, a)


# ---------------------------------------------------------------------------------------------
# the rollback: bit for bit a cache that never saw the rejected tokens
# ---------------------------------------------------------------------------------------------

def _gpt_oss(tmp_path_factory):
    import transformers
    from family_parity import make_checkpoint
    from colibri.convert import convert
    cfg = transformers.GptOssConfig(
        vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=4096, sliding_window=4,
        initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    d = tmp_path_factory.mktemp("spec-gpt-oss")
    src = make_checkpoint(d / "hf", cfg)
    return api.load(convert(src, d / "m.colibri", dtype="f32", progress=False), threads=1,
                    kv_dtype="f32")


@pytest.mark.parametrize("which", ["mixtral-window", "deepseek_v2", "gpt_oss", "shipped-f16"])
def test_rollback_is_a_cache_that_never_saw_the_rejected(which, hf_checkpoint,
                                                         tmp_path_factory):
    if which == "mixtral-window":      # a sliding window shorter than what is rolled back
        _, m = converted(hf_checkpoint, tmp_path_factory, "mixtral", sliding_window=3)
        assert m.config.sliding_window == 3
    elif which == "deepseek_v2":       # the MLA latent cache
        _, m = converted(hf_checkpoint, tmp_path_factory, "deepseek_v2")
    elif which == "gpt_oss":           # sinks and alternating sliding layers
        m = _gpt_oss(tmp_path_factory)
    else:
        m = api.load(colibri.default_model_path())
    rng = np.random.default_rng(0)
    V = m.vocab_size
    prompt = rng.integers(3, V, 9)
    accepted = rng.integers(3, V, 3)        # the pending token and two accepted drafts
    seen = m.new_cache(ctx=40)
    m.forward(prompt, cache=seen)
    before = seen.length
    rows = verify(m, seen, np.concatenate([accepted, rng.integers(3, V, 4)]))  # 4 rejected
    assert rows.shape == (7, V)
    seen.truncate(before + accepted.size)
    # a copy holding only the accepted slots (zeros past its length: it never saw the
    # rejected), and one whose slots past its length are NaN (any read of them would show)
    never = seen.prefix_copy(seen.length)
    other = seen.copy()
    for plane in other.k + other.v:
        plane[:, :, other.length:] = 0x7FC0 if plane.dtype == np.uint16 else np.nan
    for c in (seen, other):
        assert c.length == never.length
        for a, b in zip(c.k + c.v, never.k + never.v):
            np.testing.assert_array_equal(a[:, :, :c.length], b[:, :, :c.length])
        np.testing.assert_array_equal(c.valid[:, :c.length], never.valid[:, :c.length])
        np.testing.assert_array_equal(c.pos[:, :c.length], never.pos[:, :c.length])
    # everything that follows: decode steps, another verification, a rollback of that
    cont = rng.integers(3, V, 6)
    outs = []
    for c in (seen, other, never):
        o = [m.forward(np.array([t]), cache=c)[-1] for t in cont[:2]]
        o.append(verify(m, c, cont[2:]))
        c.truncate(c.length - 2)
        o.append(m.forward(np.array([cont[0]]), cache=c)[-1])
        outs.append(o)
    for o in outs[1:]:
        for a, b in zip(o, outs[0]):
            np.testing.assert_array_equal(a, b)
    # and the rows of the verification are, within the kernels' summation order, those of
    # feeding the tokens one by one
    one = m.new_cache(ctx=40)
    m.forward(prompt, cache=one)
    step = [m.forward(np.array([t]), cache=one)[-1] for t in accepted]
    np.testing.assert_allclose(rows[:3], np.stack(step), rtol=0, atol=2e-3 * np.abs(step).max())


# ---------------------------------------------------------------------------------------------
# sampling keeps the target distribution
# ---------------------------------------------------------------------------------------------

def _chi2_p(counts, probs):
    keep = probs * counts.sum() >= 5                     # pool the rare cells
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
    obs, exp = obs[exp > 0], exp[exp > 0]
    return scipy_stats.chisquare(obs, exp).pvalue


@pytest.mark.parametrize("point_mass", [True, False])
def test_judge_keeps_p(point_mass):
    rng = np.random.default_rng(1)
    V = 10
    p = rng.dirichlet(np.ones(V) * 0.7)
    q = rng.dirichlet(np.ones(V) * 0.7)
    if point_mass:
        q = np.zeros(V)
        q[int(np.argsort(p)[-3])] = 1.0                 # a draft that is often wrong
    counts = np.zeros(V)
    n_acc = 0
    for _ in range(20000):
        d = int(rng.choice(V, p=q))
        ok, alt = judge(p, d, None if point_mass else q, rng)
        n_acc += ok
        counts[d if ok else alt] += 1
    assert _chi2_p(counts, p) > 1e-3
    # the acceptance rate of the rule is sum min(p, q)
    assert abs(n_acc / 20000 - np.minimum(p, q).sum()) < 0.02


@pytest.fixture(scope="module")
def tiny_vocab(hf_checkpoint, tmp_path_factory):
    """Two random mixtral models of 12 tokens, no tokenizer: a target and a draft."""
    from colibri.convert import convert
    out = []
    for seed in (0, 5):
        src = hf_checkpoint("mixtral", seed=seed, tokenizer=False, vocab_size=12,
                            initializer_range=0.3, bos_token_id=0, eos_token_id=1,
                            pad_token_id=0)
        path = convert(src, tmp_path_factory.mktemp(f"spec-v12-{seed}") / "m.colibri",
                       dtype="f32", progress=False)
        out.append(api.load(path, threads=1, kv_dtype="f32"))
    yield out
    for m in out:
        m.close()


def _exact_marginals(m, prompt, settings, n):
    """The exact distribution of each of the first n generated tokens under plain sampling
    with `settings` (every prefix enumerated): list of float64 (V,)."""
    V = m.vocab_size
    layer = {(): 1.0}
    out = []
    for _ in range(n):
        marginal, nxt = np.zeros(V), {}
        for prefix, w in layer.items():
            s = Sampler(**settings)
            h = list(prompt) + list(prefix)
            logits = m.forward(np.array(h))[-1]
            dist = s.distribution(s.penalise(logits, h, list(prefix)))
            marginal += w * dist
            for t in np.flatnonzero(dist > 1e-4):
                nxt[prefix + (int(t),)] = w * dist[t]
        out.append(marginal)
        layer = nxt
    return out


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model"])
def test_sampling_keeps_the_target_distribution(tiny_vocab, drafter):
    target, draft = tiny_vocab
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    settings = dict(temperature=1.3, top_k=8, top_p=0.95, repetition_penalty=1.2)
    n_tok, runs = 3, 1500
    exact = _exact_marginals(target, prompt, settings, n_tok)
    counts = np.zeros((n_tok, target.vocab_size))
    drafted = accepted = 0
    for seed in range(runs):
        d = PromptLookup(2, 1) if drafter == "prompt-lookup" else DraftModel(draft, target)
        toks = target.generate(prompt, max_new_tokens=n_tok, stop=[], seed=seed, draft=d,
                               num_draft_tokens=2, **settings)
        st = target.last_stats
        drafted += st.draft_tokens
        accepted += st.accepted_tokens
        for i, t in enumerate(toks):
            counts[i, t] += 1
    assert 0 < accepted < drafted
    for i in range(n_tok):
        assert _chi2_p(counts[i], exact[i]) > 1e-3, (i, counts[i], exact[i] * runs)


def test_sampler_distribution_is_what_choose_draws():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(12).astype(np.float32) * 0.8
    s = Sampler(temperature=1.2, top_k=7, top_p=0.97, min_p=0.05, seed=0)
    counts = np.bincount([s.choose(logits) for _ in range(20000)], minlength=12)
    assert _chi2_p(counts, s.distribution(logits)) > 1e-3
    g = Sampler().distribution(logits)
    assert g[int(np.argmax(logits))] == 1.0 and g.sum() == 1.0
